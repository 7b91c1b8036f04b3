"""Loads the Lua scripts of ``lua/``, checks their contract headers, and calls them by EVALSHA.

Each script is one file named after its handle (``commit.lua`` -> ``"commit"``). A line
``--@include lib/NAME.lua`` is replaced by that helper file's text when the script is
loaded: scripts cannot ``require`` on the server. The SHA1 is computed here, calls use
EVALSHA only, and a ``NOSCRIPT`` reply (the server restarted or ran SCRIPT FLUSH) loads
the script and retries once: :meth:`ScriptRunner.call` for one call,
:meth:`ScriptRunner.run_pipeline` for a pipeline or MULTI (every script loaded, the
pipeline sent again once), :meth:`ScriptRunner.ensure_loaded` before a MULTI whose other
commands must not run without the script.

Servers with script flags (Redis 7+, Valkey) get the scripts with a ``#!lua`` first line:
the server then refuses a script up front when it is out of memory, instead of failing at
its first write. Older servers (Redis 6, KeyDB, fakeredis) reject that line, so it is added
only where :func:`probe_shebang` found it supported.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import redis.exceptions

from tdstore._backend.protocols import AsyncClient, AsyncPipeline
from tdstore._backend.translate import translate
from tdstore._core.layout import Arg

__all__ = ["Script", "ScriptHeader", "get_script", "script_names", "ScriptRunner", "parse_header"]

_INCLUDE_RE = re.compile(r"^--@include (lib/[A-Za-z0-9_]+\.lua)\s*$", re.M)
_HEADER_RE = re.compile(r"\A--\[\[ (\w+)\n(.*?)\n\]\]", re.S)
_ANY_HEADER_RE = re.compile(r"\A--\[\[.*?\]\]\n", re.S)
_DECL_RE = re.compile(r"^(KEYS|ARGV)\[(\d+)(\.\.)?\]", re.M)
_ERROR_RE = re.compile(r"^\s+(TDS_[A-Z]+)\s", re.M)
_SHEBANG = "#!lua\n"
_FLAGS_RE = re.compile(r"^Flags: ([a-z-]+(?:,[a-z-]+)*)\s*$", re.M)


@dataclass(frozen=True)
class ScriptHeader:
    """The contract block at the top of a script."""

    name: str
    keys: tuple[tuple[int, bool], ...]  # (index, variadic "n..")
    argv: tuple[tuple[int, bool], ...]
    errors: tuple[str, ...]
    text: str


def parse_header(source: str) -> ScriptHeader:
    """Parses the ``--[[ name ... ]]`` contract block of a script's source."""
    match = _HEADER_RE.match(source)
    if match is None:
        raise ValueError("a script must open with a --[[ name ... ]] contract block")
    name, text = match.group(1), match.group(2)
    keys: list[tuple[int, bool]] = []
    argv: list[tuple[int, bool]] = []
    for kind, idx, variadic in _DECL_RE.findall(text):
        (keys if kind == "KEYS" else argv).append((int(idx), bool(variadic)))
    errors_part = text.split("Errors:", 1)[1] if "Errors:" in text else ""
    errors = tuple(_ERROR_RE.findall(errors_part))
    return ScriptHeader(name, tuple(keys), tuple(argv), errors, text)


def _lua_dir() -> Any:
    return importlib.resources.files("tdstore") / "lua"


def script_names() -> list[str]:
    """The handles of every script shipped with the package."""
    return sorted(
        entry.name[:-4]
        for entry in _lua_dir().iterdir()
        if entry.name.endswith(".lua") and entry.is_file()
    )


@dataclass(frozen=True)
class Script:
    """One server-side script: its assembled source and both of its SHA1s."""

    name: str
    raw: str
    source: str
    header: ScriptHeader
    shas: dict[bool, str] = field(default_factory=dict, compare=False)

    def text(self, shebang: bool) -> str:
        return self.shebang_line() + self.source if shebang else self.source

    def shebang_line(self) -> str:
        """``#!lua`` with the flags the header declares (``Flags: no-writes`` for readers)."""
        flags = _FLAGS_RE.search(self.header.text)
        return f"#!lua flags={flags.group(1)}\n" if flags else _SHEBANG

    def sha(self, shebang: bool) -> str:
        return self.shas[shebang]


@cache
def get_script(name: str) -> Script:
    """The script ``lua/<name>.lua``, with its includes inlined."""
    root = _lua_dir()
    raw = (root / f"{name}.lua").read_text()

    def include(match: re.Match[str]) -> str:
        lib = (root / match.group(1)).read_text()
        # drop the helper's own comment block; keep line structure simple
        return _ANY_HEADER_RE.sub("", lib, count=1).strip("\n")

    source = _INCLUDE_RE.sub(include, raw)
    header = parse_header(raw)
    if header.name != name:
        raise ValueError(f"lua/{name}.lua declares the name {header.name!r}")
    script = Script(name, raw, source, header)
    for flag in (False, True):
        script.shas[flag] = hashlib.sha1(script.text(flag).encode()).hexdigest()
    return script


async def probe_shebang(client: AsyncClient) -> bool:
    """Whether the server accepts a ``#!lua`` first line (script flags: Redis 7+, Valkey)."""
    # EVAL, not SCRIPT LOAD: fakeredis stores any text at LOAD and fails only when it runs
    try:
        return await client.eval(_SHEBANG + "return 1", 0) == 1
    except redis.exceptions.ResponseError:
        return False


class ScriptRunner:
    """Calls scripts on one server; knows whether it takes the ``#!lua`` line, and whether it
    has ``BITFIELD_RO`` (Redis 6.2+, Valkey; not fakeredis), by which reads of rows of
    1-16 bytes go (:mod:`tdstore._backend.reads`), and whether its Lua has ``struct``."""

    def __init__(self, shebang: bool, bitfield: bool = False, struct: bool = False) -> None:
        self.shebang = shebang
        self.bitfield = bitfield
        #: whether the server's Lua has the struct library (Redis, Valkey; not fakeredis):
        #: the priority updates then pass their numbers as doubles (lua/prio_update.lua)
        self.struct = struct

    def sha(self, name: str) -> str:
        return get_script(name).sha(self.shebang)

    async def load_all(self, client: AsyncClient) -> None:
        """Loads every script, so that EVALSHA inside a MULTI finds them (in one round trip)."""
        await self.load_missing(client, [False] * len(script_names()))

    def exists_command(self) -> tuple[str, ...]:
        """``SCRIPT EXISTS`` of every script, in :func:`script_names` order: its reply, given to
        :meth:`load_missing`, loads only those the server does not hold."""
        return ("SCRIPT", "EXISTS", *[self.sha(name) for name in script_names()])

    async def load_missing(self, client: AsyncClient, exists: object) -> None:
        """Loads the scripts that ``exists`` (the reply of :meth:`exists_command`) says the server
        lacks, pipelined in one round trip; every script when the reply is not a list of flags
        (an error: SCRIPT EXISTS refused by an ACL, say)."""
        names = script_names()
        if not isinstance(exists, list) or len(exists) != len(names):
            exists = [False] * len(names)
        missing = [name for name, there in zip(names, exists, strict=True) if not there]
        if not missing:
            return
        async with client.pipeline(transaction=False) as pipe:
            for name in missing:
                pipe.script_load(get_script(name).text(self.shebang))
            replies = await pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply

    async def call(self, client: AsyncClient, name: str, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        """EVALSHA ``name``; loads the script and retries once on NOSCRIPT.

        Raises:
            TDStoreError subclasses for the script's TDS_* error codes.
        """
        script = get_script(name)
        sha = script.sha(self.shebang)
        try:
            try:
                return await client.evalsha(sha, len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                await client.script_load(script.text(self.shebang))
                return await client.evalsha(sha, len(keys), *keys, *args)
        except redis.exceptions.ResponseError as err:
            exc = translate(err)
            if exc is err:
                raise
            raise exc from err

    def queue(self, pipe: AsyncPipeline, name: str, keys: Sequence[str], args: Sequence[Arg]) -> None:
        """Adds an EVALSHA of ``name`` to a pipeline or transaction.

        Send it with :meth:`run_pipeline`, or call :meth:`ensure_loaded` first: a server that
        forgot the script answers NOSCRIPT in the pipeline's replies.
        """
        pipe.evalsha(self.sha(name), len(keys), *keys, *args)

    async def ensure_loaded(self, client: AsyncClient, *names: str) -> None:
        """Loads the scripts ``names`` the server does not hold (SCRIPT EXISTS, then SCRIPT LOAD).

        For a MULTI that must not fail with NOSCRIPT at EXEC (its other commands would have
        run). ``client`` may be a pipeline in immediate mode (after WATCH): neither command
        ends the WATCH.
        """
        exists = await client.script_exists(*[self.sha(name) for name in names])
        for name, there in zip(names, exists, strict=True):
            if not there:
                await client.script_load(get_script(name).text(self.shebang))

    async def run_pipeline(
        self,
        client: AsyncClient,
        send: Callable[[], Awaitable[list[Any]]],
        undo: Callable[[list[Any]], Awaitable[Any]] | None = None,
    ) -> list[Any]:
        """The replies of ``send()``, a pipeline or MULTI whose EVALSHAs :meth:`queue` added.

        When a reply is NOSCRIPT (the server restarted or ran SCRIPT FLUSH since the scripts
        were loaded), ``undo(replies)`` removes what the pipeline's other commands left, every
        script is loaded, and ``send()`` runs once more; its replies are returned as they are.
        """
        replies = await send()
        if not any(isinstance(reply, redis.exceptions.NoScriptError) for reply in replies):
            return replies
        if undo is not None:
            await undo(replies)
        await self.load_all(client)
        return await send()
