"""A small in-memory Redis that runs tdstore's Lua scripts under lupa (Lua 5.1 and 5.4).

:class:`LuaRedis` keeps a key space (strings as ``bytes``, hashes as
``dict[bytes, bytes]``, TTLs in ``ttls`` as milliseconds, never expiring) and runs a
script the way a Redis-wire server does:

* a fresh ``LuaRuntime`` per call, with ``KEYS``/``ARGV`` tables of binary-safe strings,
  a ``redis`` table (``call``, ``pcall``, ``error_reply``, ``status_reply``, ``log``,
  ``sha1hex``) and a ``cjson`` table (``encode``, ``decode``, ``null``); with
  ``struct_lib=True`` also Redis's ``struct`` (``pack``, ``unpack``: the formats Python's
  struct module shares with it), as on Redis, Valkey and KeyDB;
* the sandbox Redis builds: no ``os``/``io``/``require``/``dofile``/``loadfile``, no
  ``bit``/``cmsgpack`` and by default no ``struct`` (as fakeredis: a script may use
  struct only behind a probe, lua/lib/prio.lua), creating a global is
  an error, and on Lua 5.1 so is reading a global that does not exist (Redis 5.1 sets the
  same metatable on ``_G``);
* ``redis.call`` arguments are converted as the server converts them: strings as they
  are, numbers formatted with ``%.17g`` on Lua 5.1 and with Lua 5.4's ``tostring`` rules
  there (so a float ``3.0`` reaches the command as ``"3.0"``); other types are refused;
* replies are converted Redis-style: integers to Lua numbers, bulk strings to strings,
  a nil bulk to ``false``, arrays to tables, status replies to ``{ok=...}``; a command
  error raises inside the script (:class:`RedisCommandError`);
* the script's result is converted back the way a client receives it: ``{err=msg}``
  raises :class:`LuaScriptError`, numbers are truncated to ``int``, strings are ``bytes``,
  tables are lists, ``nil``/``false`` are ``None``; a Lua error (``error()``, a runtime
  error, a failed ``redis.call``) raises :class:`LuaRuntimeError`.

A command the shim does not implement raises :class:`UnsupportedCommand`, which is not a
Redis error reply: ``redis.pcall`` does not swallow it and the test fails loudly.

Strings too large to allocate in a test can be declared with
:meth:`LuaRedis.set_virtual_string`: ``STRLEN`` reports the declared length, ``SETRANGE``
records its writes (see :class:`VirtualString`) without allocating anything.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
import struct as pystruct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lupa.lua51
import lupa.lua54

from tdstore._backend.scripts import get_script
from tdstore.errors import LUA_ERRORS, TDStoreError

__all__ = [
    "LUA_VERSIONS",
    "LuaRedis",
    "VirtualString",
    "ScriptFailure",
    "LuaScriptError",
    "LuaRuntimeError",
    "LuaCompileError",
    "RedisCommandError",
    "ShimError",
    "UnsupportedCommand",
    "Status",
    "compile_source",
    "tdstore_error",
    "lua_number_arg",
]

LUA_VERSIONS: tuple[str, ...] = ("5.1", "5.4")
_RUNTIMES = {"5.1": lupa.lua51, "5.4": lupa.lua54}

_CODE_RE = re.compile(r"(TDS_[A-Z]+)\b ?(.*)", re.S)
_INT_RE = re.compile(rb"\A(?:0|-?[1-9][0-9]*)\Z")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #


class ShimError(Exception):
    """The test harness was used in a way it does not support (never a Redis error)."""


class UnsupportedCommand(ShimError):
    """``redis.call`` named a command the shim does not emulate."""


class ScriptFailure(Exception):
    """A script call failed; ``message`` is the text a client would receive."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def code(self) -> str | None:
        """The ``TDS_*`` code the message starts with, or ``None``."""
        match = _CODE_RE.match(self.message)
        return match.group(1) if match else None


class LuaScriptError(ScriptFailure):
    """The script returned an error reply (``redis.error_reply(msg)`` / ``{err=msg}``)."""


class LuaRuntimeError(ScriptFailure):
    """The script raised a Lua error: ``error()``, a runtime error, a failed ``redis.call``."""


class LuaCompileError(ScriptFailure):
    """The script's source does not compile."""


class RedisCommandError(LuaRuntimeError):
    """A command called by ``redis.call`` returned an error reply (e.g. ``ERR no such key``)."""


class _CjsonError(LuaRuntimeError):
    """``cjson.encode``/``cjson.decode`` refused its input (raised inside the script)."""


def tdstore_error(exc: ScriptFailure) -> TDStoreError:
    """Maps a script failure to the tdstore exception of its ``TDS_*`` code."""
    match = _CODE_RE.match(exc.message)
    if match is None or match.group(1) not in LUA_ERRORS:
        raise ValueError(f"not a tdstore script error: {exc.message!r}")
    return LUA_ERRORS[match.group(1)](match.group(2).strip())


@dataclass(frozen=True)
class Status:
    """A status reply (``+OK``); reaches Lua as ``{ok=...}``."""

    text: bytes


_OK = Status(b"OK")


# --------------------------------------------------------------------------- #
# Values
# --------------------------------------------------------------------------- #


@dataclass
class VirtualString:
    """A string value of ``length`` bytes that is never allocated.

    Its bytes are zeros overlaid with ``writes`` (``(offset, data)``, applied in order).
    """

    length: int
    writes: list[tuple[int, bytes]] = field(default_factory=list)

    def read(self, start: int, stop: int) -> bytes:
        if stop - start > 1 << 20:
            raise ShimError("refusing to materialise more than 1 MiB of a virtual string")
        out = bytearray(max(0, stop - start))
        for offset, data in self.writes:
            lo, hi = max(start, offset), min(stop, offset + len(data))
            if lo < hi:
                out[lo - start : hi - start] = data[lo - offset : hi - offset]
        return bytes(out)


def _b(value: Any) -> bytes:
    """bytes of a Python-side argument (str, bytes, int)."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bool):
        raise TypeError("booleans are not Redis arguments")
    if isinstance(value, int):
        return str(value).encode()
    raise TypeError(f"unsupported argument type {type(value).__name__}")


def _lua54_float_str(value: float) -> bytes:
    """Lua 5.4's ``tostring`` of a float: ``%.14g``, plus ``.0`` when it looks integral."""
    if math.isnan(value):
        return b"nan" if math.copysign(1.0, value) > 0 else b"-nan"
    if math.isinf(value):
        return b"inf" if value > 0 else b"-inf"
    text = f"{value:.14g}"
    if re.fullmatch(r"-?[0-9]+", text):
        text += ".0"
    return text.encode()


def lua_number_arg(value: int | float, lua_version: str) -> bytes:
    """The bytes a server passes to a command for a Lua number argument."""
    if lua_version == "5.1":  # every Lua 5.1 number is a double; Redis formats with %.17g
        return f"{float(value):.17g}".encode()
    if isinstance(value, int):  # Lua 5.4 integer subtype
        return str(value).encode()
    return _lua54_float_str(value)


def _parse_int(raw: bytes, message: str = "ERR value is not an integer or out of range") -> int:
    """Redis' string2ll: optional '-', no '+', no spaces, no leading zeros, int64 range."""
    if not _INT_RE.match(raw):
        raise RedisCommandError(message)
    value = int(raw)
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise RedisCommandError(message)
    return value


_WRONGTYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"


# --------------------------------------------------------------------------- #
# The emulated server
# --------------------------------------------------------------------------- #


_SANDBOX_LUA = b"""
local strict_read = ...
os = nil; io = nil; package = nil; require = nil; dofile = nil; loadfile = nil
module = nil; python = nil
local mt = {}
mt.__newindex = function(t, n, v)
  error("Script attempted to create global variable '" .. tostring(n) .. "'", 2)
end
if strict_read then
  mt.__index = function(t, n)
    error("Script attempted to access nonexistent global variable '" .. tostring(n) .. "'", 2)
  end
end
setmetatable(_G, mt)
"""

_REDIS_LUA = b"""
local redis = ...
redis.error_reply = function(msg)
  if type(msg) ~= 'string' and type(msg) ~= 'number' then
    error('wrong number or type of arguments', 2)
  end
  return {err = msg}
end
redis.status_reply = function(msg)
  if type(msg) ~= 'string' and type(msg) ~= 'number' then
    error('wrong number or type of arguments', 2)
  end
  return {ok = msg}
end
redis.log = function(level, ...) end
redis.LOG_DEBUG, redis.LOG_VERBOSE, redis.LOG_NOTICE, redis.LOG_WARNING = 0, 1, 2, 3
redis.replicate_commands = function() return true end
"""


class LuaRedis:
    """In-memory Redis key space plus a Lua script runner (see the module docstring).

    Args:
        proto_max_bulk_len: the largest string SETRANGE may produce (Redis' default 512 MiB).
        max_alloc: a guard of the shim: SETRANGE growing a real (non-virtual) string past
            this many bytes raises :class:`ShimError` instead of allocating it.
        json_integers: ``cjson.decode`` returns integral JSON numbers as Lua integers on
            Lua 5.4 (lua-cjson builds differ); by default every number decodes to a float,
            the case that exposes ``"3.0"`` formatting.
        strict_globals: emulate Redis' protection of ``_G`` (see the module docstring).
        virtual_strlen: ``{key: length}`` strings created with :meth:`set_virtual_string`.
        virtual_above: when set, a SETRANGE that would grow a real string past this many
            bytes turns it into a :class:`VirtualString` (its bytes so far become its
            first write) instead of allocating it.
        struct_lib: give the scripts Redis's ``struct`` library (see the module docstring).
    """

    def __init__(
        self,
        *,
        proto_max_bulk_len: int = 512 * 1024 * 1024,
        max_alloc: int = 64 * 1024 * 1024,
        json_integers: bool = False,
        strict_globals: bool = True,
        virtual_strlen: dict[Any, int] | None = None,
        virtual_above: int | None = None,
        struct_lib: bool = False,
    ) -> None:
        self.struct_lib = struct_lib
        self.data: dict[bytes, bytes | dict[bytes, bytes] | VirtualString] = {}
        self.ttls: dict[bytes, int] = {}
        self.log: list[tuple[bytes, ...]] = []
        self.proto_max_bulk_len = proto_max_bulk_len
        self.max_alloc = max_alloc
        self.json_integers = json_integers
        self.strict_globals = strict_globals
        self.virtual_above = virtual_above
        for key, length in (virtual_strlen or {}).items():
            self.set_virtual_string(key, length)
        self._commands: dict[bytes, tuple[Callable[..., Any], int, int | None]] = {
            # name: (handler, min args, max args) counting arguments after the name
            b"GET": (self._cmd_get, 1, 1),
            b"SET": (self._cmd_set, 2, None),
            b"INCR": (self._cmd_incr, 1, 1),
            b"INCRBY": (self._cmd_incrby, 2, 2),
            b"DEL": (self._cmd_del, 1, None),
            b"EXISTS": (self._cmd_exists, 1, None),
            b"RENAME": (self._cmd_rename, 2, 2),
            b"PERSIST": (self._cmd_persist, 1, 1),
            b"EXPIRE": (self._cmd_expire, 2, 2),
            b"PEXPIRE": (self._cmd_pexpire, 2, 2),
            b"TYPE": (self._cmd_type, 1, 1),
            b"SETRANGE": (self._cmd_setrange, 3, 3),
            b"GETRANGE": (self._cmd_getrange, 3, 3),
            b"STRLEN": (self._cmd_strlen, 1, 1),
            b"BITCOUNT": (self._cmd_bitcount, 1, 3),
            b"HSET": (self._cmd_hset, 3, None),
            b"HGET": (self._cmd_hget, 2, 2),
            b"HMGET": (self._cmd_hmget, 2, None),
            b"HDEL": (self._cmd_hdel, 2, None),
            b"HLEN": (self._cmd_hlen, 1, 1),
            b"HGETALL": (self._cmd_hgetall, 1, 1),
            b"HINCRBY": (self._cmd_hincrby, 3, 3),
        }

    # ------------------------------------------------------------------ helpers

    def set_virtual_string(self, key: Any, length: int) -> None:
        """Creates ``key`` as a string of ``length`` zero bytes that is never allocated."""
        self.data[_b(key)] = VirtualString(length)

    def snapshot(self) -> tuple[dict[bytes, Any], dict[bytes, int]]:
        """A deep copy of the key space and the TTLs, to compare before/after a call."""
        return copy.deepcopy(self.data), dict(self.ttls)

    def call(self, *args: Any) -> Any:
        """Runs one command from Python (test setup); returns bytes/int/list/None/Status."""
        return self._execute([_b(a) for a in args])

    def commands(self, name: str) -> list[tuple[bytes, ...]]:
        """The argument tuples of every ``name`` command the last script ran."""
        upper = name.upper().encode()
        return [entry[1:] for entry in self.log if entry[0].upper() == upper]

    # ------------------------------------------------------------------ scripts

    def run(self, script_name: str, keys: list[Any], argv: list[Any], lua_version: str = "5.1") -> Any:
        """EVAL of ``lua/<script_name>.lua`` (assembled source) on this key space."""
        return self.eval(get_script(script_name).source, keys, argv, lua_version)

    def eval(self, source: str, keys: list[Any], argv: list[Any], lua_version: str = "5.1") -> Any:
        """EVAL of ``source``; ``self.log`` then holds the commands it ran."""
        module = _RUNTIMES[lua_version]
        lua = module.LuaRuntime(
            unpack_returned_tuples=True, encoding=None, register_eval=False, register_builtins=False
        )
        self.log = []
        self._install(lua, [_b(k) for k in keys], [_b(a) for a in argv], lua_version)
        try:
            function = lua.execute(b"return function()\n" + source.encode() + b"\nend")
        except module.LuaSyntaxError as exc:
            raise LuaCompileError(f"Error compiling script: {exc}") from None
        try:
            result = function()
        except module.LuaError as exc:
            raise LuaRuntimeError(str(exc)) from None
        return self._from_lua(result, lua_version)

    def _install(self, lua: Any, keys: list[bytes], argv: list[bytes], lua_version: str) -> None:
        g = lua.globals()
        g.KEYS = lua.table_from(keys)
        g.ARGV = lua.table_from(argv)

        def call(*args: Any) -> Any:
            return self._to_lua(lua, self._execute(self._lua_args(args, lua_version)))

        def pcall(*args: Any) -> Any:
            try:
                return call(*args)
            except RedisCommandError as exc:
                return lua.table_from({b"err": exc.message.encode()})

        redis = lua.table_from(
            {
                b"call": call,
                b"pcall": pcall,
                b"sha1hex": lambda text: hashlib.sha1(self._lua_args((text,), lua_version)[0]).hexdigest().encode(),
            }
        )
        lua.execute(_REDIS_LUA, redis)
        g.redis = redis
        null, is_null = lua.execute(
            b"local null = setmetatable({}, {__tostring = function() return 'null' end})\n"
            b"return null, function(v) return rawequal(v, null) end"
        )
        g.cjson = lua.table_from(
            {
                b"encode": lambda value: _json_encode(value, is_null, lua_version),
                b"decode": lambda text: self._json_decode(lua, text, null),
                b"null": null,
            }
        )
        if self.struct_lib:
            g.struct = lua.table_from({b"pack": _struct_pack, b"unpack": _struct_unpack})
        lua.execute(_SANDBOX_LUA, self.strict_globals and lua_version == "5.1")

    @staticmethod
    def _lua_args(args: tuple[Any, ...], lua_version: str) -> list[bytes]:
        if not args:
            raise RedisCommandError("ERR Please specify at least one argument for this redis lib call")
        out = []
        for arg in args:
            if isinstance(arg, bytes):
                out.append(arg)
            elif isinstance(arg, (int, float)) and not isinstance(arg, bool):
                out.append(lua_number_arg(arg, lua_version))
            else:
                raise RedisCommandError("ERR Lua redis lib command arguments must be strings or integers")
        return out

    def _to_lua(self, lua: Any, value: Any) -> Any:
        if value is None:
            return False  # a nil bulk reply reaches Lua as false
        if isinstance(value, Status):
            return lua.table_from({b"ok": value.text})
        if isinstance(value, list):
            return lua.table_from([self._to_lua(lua, v) for v in value])
        return value

    def _from_lua(self, value: Any, lua_version: str) -> Any:
        module = _RUNTIMES[lua_version]
        if value is None or value is False:
            return None
        if value is True:
            return 1
        if isinstance(value, float):
            return int(value)  # Redis truncates a Lua number to an integer reply
        if isinstance(value, (int, bytes)):
            return value
        if module.lua_type(value) == "table":
            err = value[b"err"]
            if err is not None:
                raise LuaScriptError(err.decode(errors="replace") if isinstance(err, bytes) else str(err))
            ok = value[b"ok"]
            if ok is not None:
                return ok
            out = []
            i = 1
            while value[i] is not None:
                out.append(self._from_lua(value[i], lua_version))
                i += 1
            return out
        return None  # functions, userdata: Redis replies nil

    # ------------------------------------------------------------------ cjson

    def _json_decode(self, lua: Any, text: Any, null: Any) -> Any:
        if not isinstance(text, bytes):
            if isinstance(text, (int, float)) and not isinstance(text, bool):
                text = str(text).encode()
            else:
                raise _CjsonError("bad argument #1 to 'decode' (string expected)")
        try:
            parsed = json.loads(text.decode("utf-8", "surrogateescape"))
        except ValueError as exc:
            raise _CjsonError(f"Expected value but found invalid token: {exc}") from None

        def convert(obj: Any) -> Any:
            if obj is None:
                return null
            if isinstance(obj, bool):
                return obj
            if isinstance(obj, (int, float)):
                if self.json_integers and isinstance(obj, int):
                    return obj
                return float(obj)
            if isinstance(obj, str):
                return obj.encode("utf-8", "surrogateescape")
            if isinstance(obj, list):
                return lua.table_from([convert(v) for v in obj])
            return lua.table_from({k.encode("utf-8", "surrogateescape"): convert(v) for k, v in obj.items()})

        return convert(parsed)

    # ------------------------------------------------------------------ commands

    def _execute(self, args: list[bytes]) -> Any:
        name = args[0].upper()
        self.log.append((name, *args[1:]))
        entry = self._commands.get(name)
        if entry is None:
            raise UnsupportedCommand(f"the Lua shim does not emulate the command {args[0].decode(errors='replace')!r}")
        handler, lo, hi = entry
        nargs = len(args) - 1
        if nargs < lo or (hi is not None and nargs > hi):
            raise RedisCommandError(f"ERR wrong number of arguments for '{name.decode().lower()}' command")
        return handler(*args[1:])

    def _delete(self, key: bytes) -> bool:
        self.ttls.pop(key, None)
        return self.data.pop(key, None) is not None

    def _string(self, key: bytes) -> bytes | VirtualString | None:
        value = self.data.get(key)
        if isinstance(value, dict):
            raise RedisCommandError(_WRONGTYPE)
        return value

    def _hash(self, key: bytes) -> dict[bytes, bytes] | None:
        value = self.data.get(key)
        if value is not None and not isinstance(value, dict):
            raise RedisCommandError(_WRONGTYPE)
        return value

    def _cmd_get(self, key: bytes) -> bytes | None:
        value = self._string(key)
        if isinstance(value, VirtualString):
            raise ShimError("GET of a virtual string")
        return value

    def _cmd_set(self, key: bytes, value: bytes, *options: bytes) -> Any:
        ttl: int | None = None
        nx = xx = keepttl = get = False
        i = 0
        while i < len(options):
            opt = options[i].upper()
            if opt in (b"EX", b"PX") and i + 1 < len(options) and ttl is None and not keepttl:
                amount = _parse_int(options[i + 1])
                if amount <= 0:
                    raise RedisCommandError("ERR invalid expire time in 'set' command")
                ttl = amount * 1000 if opt == b"EX" else amount
                i += 2
                continue
            if opt == b"NX" and not xx:
                nx = True
            elif opt == b"XX" and not nx:
                xx = True
            elif opt == b"KEEPTTL" and ttl is None:
                keepttl = True
            elif opt == b"GET":
                get = True
            else:
                raise RedisCommandError("ERR syntax error")
            i += 1
        old = self._string(key) if get else self.data.get(key)
        if isinstance(old, VirtualString):
            raise ShimError("SET ... GET of a virtual string")
        exists = key in self.data
        if (nx and exists) or (xx and not exists):
            return old if get else None
        self.data[key] = value
        if ttl is not None:
            self.ttls[key] = ttl
        elif not keepttl:
            self.ttls.pop(key, None)
        return old if get else _OK

    def _cmd_incr(self, key: bytes) -> int:
        """INCR: a missing key counts as 0; the TTL stays (Redis keeps it on INCR)."""
        current = self._string(key)
        if isinstance(current, VirtualString):
            raise ShimError("INCR of a virtual string")
        value = 0 if current is None else _parse_int(current)
        if value == _INT64_MAX:
            raise RedisCommandError("ERR increment or decrement would overflow")
        self.data[key] = str(value + 1).encode()
        return value + 1

    def _cmd_incrby(self, key: bytes, amount_raw: bytes) -> int:
        """INCRBY: as INCR, by a signed 64-bit amount."""
        current = self._string(key)
        if isinstance(current, VirtualString):
            raise ShimError("INCRBY of a virtual string")
        amount = _parse_int(amount_raw)
        value = 0 if current is None else _parse_int(current)
        if not _INT64_MIN <= value + amount <= _INT64_MAX:
            raise RedisCommandError("ERR increment or decrement would overflow")
        self.data[key] = str(value + amount).encode()
        return value + amount

    def _cmd_del(self, *keys: bytes) -> int:
        return sum(self._delete(key) for key in keys)

    def _cmd_exists(self, *keys: bytes) -> int:
        return sum(key in self.data for key in keys)

    def _cmd_rename(self, src: bytes, dst: bytes) -> Status:
        if src not in self.data:
            raise RedisCommandError("ERR no such key")
        if src == dst:
            return _OK
        value = self.data.pop(src)
        ttl = self.ttls.pop(src, None)
        self._delete(dst)
        self.data[dst] = value
        if ttl is not None:
            self.ttls[dst] = ttl
        return _OK

    def _cmd_persist(self, key: bytes) -> int:
        return int(key in self.data and self.ttls.pop(key, None) is not None)

    def _expire(self, key: bytes, ms: int) -> int:
        if key not in self.data:
            return 0
        if ms <= 0:  # an expire time in the past deletes the key
            self._delete(key)
        else:
            self.ttls[key] = ms
        return 1

    def _cmd_expire(self, key: bytes, seconds: bytes) -> int:
        return self._expire(key, _parse_int(seconds) * 1000)

    def _cmd_pexpire(self, key: bytes, ms: bytes) -> int:
        return self._expire(key, _parse_int(ms))

    def _cmd_type(self, key: bytes) -> Status:
        value = self.data.get(key)
        if value is None:
            return Status(b"none")
        return Status(b"hash" if isinstance(value, dict) else b"string")

    def _cmd_setrange(self, key: bytes, offset_raw: bytes, value: bytes) -> int:
        offset = _parse_int(offset_raw)
        if offset < 0:
            raise RedisCommandError("ERR offset is out of range")
        current = self._string(key)
        if current is None:
            if not value:
                return 0
            current = b""
        elif not value:
            return current.length if isinstance(current, VirtualString) else len(current)
        if offset + len(value) > self.proto_max_bulk_len:
            raise RedisCommandError("ERR string exceeds maximum allowed size (proto-max-bulk-len)")
        if not isinstance(current, VirtualString) and self.virtual_above is not None and offset + len(value) > self.virtual_above:
            current = self.data[key] = VirtualString(len(current), [(0, current)] if current else [])
        if isinstance(current, VirtualString):
            current.writes.append((offset, value))
            current.length = max(current.length, offset + len(value))
            return current.length
        if offset + len(value) > self.max_alloc:
            raise ShimError(f"SETRANGE would allocate {offset + len(value)} bytes (max_alloc {self.max_alloc})")
        if len(current) < offset:
            current = current + b"\0" * (offset - len(current))
        new = current[:offset] + value + current[offset + len(value) :]
        self.data[key] = new
        return len(new)

    def _cmd_getrange(self, key: bytes, start_raw: bytes, end_raw: bytes) -> bytes:
        start, end = _parse_int(start_raw), _parse_int(end_raw)
        current = self._string(key)
        if current is None:
            return b""
        size = current.length if isinstance(current, VirtualString) else len(current)
        if start < 0:
            start = max(size + start, 0)
        if end < 0:
            end = max(size + end, 0)
        end = min(end, size - 1)
        if size == 0 or start > end:
            return b""
        if isinstance(current, VirtualString):
            return current.read(start, end + 1)
        return current[start : end + 1]

    def _cmd_bitcount(self, key: bytes, *bounds: bytes) -> int:
        """The set bits of the string, or of its bytes start..end (inclusive, as GETRANGE)."""
        if len(bounds) == 1:
            raise RedisCommandError("ERR syntax error")
        current = self._string(key)
        if current is None:
            return 0
        size = current.length if isinstance(current, VirtualString) else len(current)
        raw = self._cmd_getrange(key, *bounds) if bounds else self._cmd_getrange(key, b"0", str(size - 1).encode())
        return sum(bin(byte).count("1") for byte in raw)

    def _cmd_strlen(self, key: bytes) -> int:
        current = self._string(key)
        if current is None:
            return 0
        return current.length if isinstance(current, VirtualString) else len(current)

    def _cmd_hset(self, key: bytes, *pairs: bytes) -> int:
        if len(pairs) % 2:
            raise RedisCommandError("ERR wrong number of arguments for 'hset' command")
        table = self._hash(key)
        if table is None:
            table = self.data[key] = {}
        added = 0
        for i in range(0, len(pairs), 2):
            added += pairs[i] not in table
            table[pairs[i]] = pairs[i + 1]
        return added

    def _cmd_hget(self, key: bytes, name: bytes) -> bytes | None:
        table = self._hash(key)
        return None if table is None else table.get(name)

    def _cmd_hmget(self, key: bytes, *names: bytes) -> list[bytes | None]:
        table = self._hash(key) or {}
        return [table.get(name) for name in names]

    def _cmd_hdel(self, key: bytes, *names: bytes) -> int:
        table = self._hash(key)
        if table is None:
            return 0
        removed = 0
        for name in names:
            removed += table.pop(name, None) is not None
        if not table:
            self._delete(key)
        return removed

    def _cmd_hlen(self, key: bytes) -> int:
        return len(self._hash(key) or {})

    def _cmd_hgetall(self, key: bytes) -> list[bytes]:
        return [item for pair in (self._hash(key) or {}).items() for item in pair]

    def _cmd_hincrby(self, key: bytes, name: bytes, incr_raw: bytes) -> int:
        incr = _parse_int(incr_raw)
        table = self._hash(key)
        current = 0
        if table is not None and name in table:
            current = _parse_int(table[name], "ERR hash value is not an integer")
        new = current + incr
        if not _INT64_MIN <= new <= _INT64_MAX:
            raise RedisCommandError("ERR increment or decrement would overflow")
        if table is None:
            table = self.data[key] = {}
        table[name] = str(new).encode()
        return new


# --------------------------------------------------------------------------- #
# struct (Redis's lua_struct.c; only what Python's struct module means the same way)
# --------------------------------------------------------------------------- #

_STRUCT_FMT = re.compile(rb"\A[<>=!]?[dfxbBhHiIlL0-9]*\Z")


def _struct_fmt(fmt: bytes) -> str:
    if not isinstance(fmt, bytes) or not _STRUCT_FMT.match(fmt):
        raise ShimError(f"struct format {fmt!r}: the shim knows byte order and d f x b B h H i I l L only")
    return fmt.decode()


def _struct_pack(fmt: bytes, *values: Any) -> bytes:
    return pystruct.pack(_struct_fmt(fmt), *values)


def _struct_unpack(fmt: bytes, data: bytes, pos: int | float = 1) -> tuple[Any, ...]:
    """The values, then the position after them (1-based), as Redis's struct.unpack returns them."""
    code = _struct_fmt(fmt)
    start = int(pos) - 1
    size = pystruct.calcsize(code)
    if start < 0 or start + size > len(data):
        raise ValueError("data string too short")  # (a Lua error inside the script, as on Redis)
    return (*pystruct.unpack_from(code, data, start), start + size + 1)


# --------------------------------------------------------------------------- #
# cjson.encode
# --------------------------------------------------------------------------- #

_JSON_ESCAPES = {0x22: b'\\"', 0x5C: b"\\\\", 0x2F: b"\\/", 0x08: b"\\b", 0x0C: b"\\f", 0x0A: b"\\n", 0x0D: b"\\r", 0x09: b"\\t"}


def _json_string(raw: bytes) -> bytes:
    """lua-cjson's string escaping: bytes >= 0x80 pass through unchanged."""
    out = bytearray(b'"')
    for byte in raw:
        if byte in _JSON_ESCAPES:
            out += _JSON_ESCAPES[byte]
        elif byte < 0x20 or byte == 0x7F:
            out += b"\\u%04x" % byte
        else:
            out.append(byte)
    out += b'"'
    return bytes(out)


def _json_number(value: int | float) -> bytes:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        raise _CjsonError("Cannot serialise number: must not be NaN or Inf")
    return f"{value:.14g}".encode()


def _json_encode(value: Any, is_null: Callable[[Any], bool], lua_version: str, depth: int = 0) -> bytes:
    module = _RUNTIMES[lua_version]
    if depth > 1000:
        raise _CjsonError("Cannot serialise, excessive nesting (1001)")
    if value is None or (module.lua_type(value) == "table" and is_null(value)):
        return b"null"
    if isinstance(value, bool):
        return b"true" if value else b"false"
    if isinstance(value, (int, float)):
        return _json_number(value)
    if isinstance(value, bytes):
        return _json_string(value)
    if module.lua_type(value) != "table":
        raise _CjsonError(f"Cannot serialise {module.lua_type(value)}: type not supported")
    items = list(value.items())
    int_keys = [k for k, _ in items if isinstance(k, (int, float)) and not isinstance(k, bool) and k == int(k) and k >= 1]
    if items and len(int_keys) == len(items):
        size = int(max(int_keys))
        if size > 10 and size > 2 * len(items):  # lua-cjson's "excessively sparse array"
            raise _CjsonError("Cannot serialise table: excessively sparse array")
        by_index = {int(k): v for k, v in items}
        parts = [_json_encode(by_index.get(i), is_null, lua_version, depth + 1) for i in range(1, size + 1)]
        return b"[" + b",".join(parts) + b"]"
    parts = []
    for k, v in items:
        if isinstance(k, bytes):
            key = k
        elif isinstance(k, (int, float)) and not isinstance(k, bool):
            key = _json_number(k)
        else:
            raise _CjsonError("Cannot serialise table: table key must be a number or string")
        parts.append(_json_string(key) + b":" + _json_encode(v, is_null, lua_version, depth + 1))
    return b"{" + b",".join(parts) + b"}"


# --------------------------------------------------------------------------- #
# Compilation only
# --------------------------------------------------------------------------- #


def compile_source(source: str, lua_version: str) -> None:
    """Compiles ``source`` as a script body (wrapped in a function) without running it."""
    module = _RUNTIMES[lua_version]
    lua = module.LuaRuntime(unpack_returned_tuples=True, encoding=None, register_eval=False, register_builtins=False)
    try:
        lua.execute(b"return function()\n" + source.encode() + b"\nend")
    except module.LuaSyntaxError as exc:
        raise LuaCompileError(f"Lua {lua_version}: {exc}") from None
