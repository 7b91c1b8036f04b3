"""``durability=``: a write is acknowledged only once replicas (``WAIT``) or the disk (``WAITAOF``) have it.

The store option (``TensorDictStore(..., durability="replicas:1", durability_timeout=1.0)``) is
parsed into a :class:`Durability` here. Its connections are of a class made by
:func:`durable_class` from the store's own connection class: every packet that holds a write
gets ``WAIT numreplicas timeout`` (or ``WAITAOF 1 0 timeout``) after its last command, in the
same packet, and the reply to it is read and taken off before the caller sees the packet's
replies. ``WAIT`` covers every write the connection sent before it (the server waits for the
replication offset of that client's last write), so the one at the end of a MULTI/EXEC covers
the transaction, and the one after a script covers what the script wrote.

Where a WAIT falls short, the write was applied on the master but is not yet safe. The
operation is not cut short (a half-done operation is worse than a slow one): the shortfall is
noted in the operation's :class:`Outcome`, the rest of the operation's packets go without
WAIT (one wait per operation at most), and the operation raises
:class:`~tdstore.errors.DurabilityError` when it is done (``Connection.run`` and the direct
calls, :func:`finish`). A packet sent outside an operation raises at once.

Which commands write: :data:`WRITES` (``BITFIELD`` only with a ``SET`` or ``INCRBY``), and
``EVALSHA``/``EVAL`` of any script but those declared
``Flags: no-writes`` (reads), ``rate_sample`` (the rate limiter's sample counters, not
data: a learner's sample does not wait for replicas; see docs/deployment.md) and ``reserve``
(the first step of a two-step append: it takes rows, and the append's write step, whose packet
waits, follows it; a replica that has the write step has the reserve too, the replication
stream being in order, so one wait covers both).
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache

import redis.asyncio.connection
import redis.connection
import redis.exceptions

from tdstore.errors import ClientConfigError, DurabilityError

__all__ = [
    "Durability", "Outcome", "WRITES", "begin", "durable_class", "end", "finish", "parse", "wait_for", "writes",
]

#: Commands that change data (the packet that holds one gets the WAIT). Everything tdstore
#: sends that writes is here; the rest of the list is there so that a new call site is
#: covered without a change here.
WRITES = frozenset(
    name.encode()
    for name in (
        "SET", "SETRANGE", "SETEX", "PSETEX", "SETNX", "MSET", "MSETNX", "GETSET", "GETDEL", "GETEX", "APPEND",
        "DEL", "UNLINK", "INCR", "INCRBY", "INCRBYFLOAT", "DECR", "DECRBY", "HSET", "HSETNX", "HMSET", "HDEL",
        "HINCRBY", "HINCRBYFLOAT", "EXPIRE", "PEXPIRE", "EXPIREAT", "PEXPIREAT", "PERSIST", "RENAME", "RENAMENX",
        "COPY", "RESTORE", "MOVE", "LPUSH", "RPUSH", "LPOP", "RPOP", "LSET", "LTRIM", "LREM", "LINSERT", "LMOVE",
        "SADD", "SREM", "SPOP", "SMOVE", "ZADD", "ZREM", "ZINCRBY", "ZPOPMIN", "ZPOPMAX", "ZREMRANGEBYSCORE",
        "ZREMRANGEBYRANK", "XADD", "XDEL", "XTRIM", "BITOP", "SETBIT", "BITFIELD", "FLUSHDB", "FLUSHALL",
        "FCALL", "SWAPDB",
    )
)
_SCRIPT_CALLS = frozenset((b"EVALSHA", b"EVAL"))
#: scripts that write, but need no wait of their own: the rate limiter's counters, and an
#: append's reserve step, covered by its write step's wait (see the module's docstring)
UNGUARDED_SCRIPTS = ("rate_sample", "reserve")

_SPEC_RE = re.compile(r"\Areplicas:([0-9]+)\Z")


@dataclass(frozen=True)
class Durability:
    """A store's ``durability=`` setting: ``WAIT replicas ms``, or ``WAITAOF 1 0 ms`` (``fsync``)."""

    spec: str
    replicas: int  # the replicas to wait for ("replicas:N"); 0 for "fsync"
    timeout: float  # seconds

    @property
    def fsync(self) -> bool:
        return self.spec == "fsync"

    @property
    def timeout_ms(self) -> int:
        return max(1, round(self.timeout * 1000))

    def command(self) -> tuple[str | int, ...]:
        """The command that goes at the end of a writing packet."""
        if self.fsync:
            return ("WAITAOF", 1, 0, self.timeout_ms)
        return ("WAIT", self.replicas, self.timeout_ms)

    def probe(self) -> tuple[str | int, ...]:
        """A command that checks, at setup, that the server has the wait (returns at once:
        a new connection has written nothing to wait for)."""
        if self.fsync:
            return ("WAITAOF", 1, 0, 1)
        return ("WAIT", 0, 1)

    def shortfall(self, reply: object) -> str | None:
        """What the reply to :meth:`command` says is missing (None: the write is safe)."""
        if isinstance(reply, BaseException):
            return f"the server refused {self.command()[0]} ({reply}); {self.needs()}"
        if self.fsync:
            if isinstance(reply, list) and reply and isinstance(reply[0], int) and reply[0] >= 1:
                return None
            return f"the master did not fsync it to its append-only file within {self.timeout:g} s (WAITAOF: {reply!r})"
        if isinstance(reply, int) and not isinstance(reply, bool) and reply >= self.replicas:
            return None
        return (
            f"only {reply!r} of the {self.replicas} replica{'s' if self.replicas != 1 else ''} it requires "
            f"acknowledged it within {self.timeout:g} s"
        )

    def needs(self) -> str:
        if self.fsync:
            return (
                'durability="fsync" needs WAITAOF (Redis 7.2 or later, Valkey 8) and the server\'s append-only file '
                "on (appendonly yes)"
            )
        return 'durability="replicas:N" needs WAIT (Redis, Valkey, KeyDB; not fakeredis) on the master'


def parse(durability: object, durability_timeout: object, timeout: float, where: str) -> Durability | None:
    """The setting of ``durability=`` and ``durability_timeout=`` (checked; None: the default)."""
    if durability is None:
        if durability_timeout is not None:
            raise ClientConfigError(
                f"{where} got durability_timeout={durability_timeout!r} without durability=: pass "
                'durability="replicas:N" or durability="fsync" beside it'
            )
        return None
    expected = 'durability= takes "replicas:N" (N >= 1: WAIT for N replicas), "fsync" (WAITAOF) or None'
    if not isinstance(durability, str):
        raise ClientConfigError(f"{where}: {expected}, got {durability!r}")
    spec = durability.strip().lower()
    match = _SPEC_RE.match(spec)
    if match is not None:
        replicas = int(match.group(1))
        if replicas < 1:
            raise ClientConfigError(f"{where}: {expected}, got {durability!r} (0 replicas is the default: None)")
    elif spec == "fsync":
        replicas = 0
    else:
        raise ClientConfigError(f"{where}: {expected}, got {durability!r}")
    wait = 1.0 if durability_timeout is None else durability_timeout
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 < wait < timeout:
        raise ClientConfigError(
            f"{where}: durability_timeout= is the seconds a write waits for its {'fsync' if replicas == 0 else 'replicas'}, "
            f"a number > 0 and below the store's timeout= ({timeout:g} s, the longest a reply may take), got "
            f"{durability_timeout!r}"
        )
    return Durability(spec, replicas, float(wait))


# --------------------------------------------------------------------------- #
# which packets write
# --------------------------------------------------------------------------- #


#: The BITFIELD subcommands that write; one of GETs only reads.
_BITFIELD_WRITES = frozenset({b"SET", b"INCRBY"})


def _name(arg: object) -> bytes:
    if isinstance(arg, bytes):
        return arg.upper()
    if isinstance(arg, str):
        return arg.upper().encode()
    return b""


@cache
def _unguarded_shas() -> frozenset[bytes]:
    """The SHA1s (both forms: with and without the ``#!lua`` line) of the scripts that need no WAIT."""
    from tdstore._backend.scripts import get_script, script_names

    shas: set[bytes] = set()
    for name in script_names():
        script = get_script(name)
        if "Flags: no-writes" in script.header.text or name in UNGUARDED_SCRIPTS:
            shas.update(sha.encode() for sha in script.shas.values())
    return frozenset(shas)


def _text(arg: object) -> bytes:
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, (bytes, bytearray, memoryview)):
        return bytes(arg)
    return b""


def writes(commands: Iterable[Sequence[object]]) -> bool:
    """Whether any of ``commands`` writes."""
    for command in commands:
        if not command:
            continue
        name = _name(command[0])
        if name in WRITES:
            if name == b"BITFIELD" and not any(_name(arg) in _BITFIELD_WRITES for arg in command[2:]):
                continue  # (GET subcommands only: a read, as a sample's flag check)
            return True
        if name in _SCRIPT_CALLS:
            if len(command) < 2:
                return True
            if name == b"EVAL":
                # a script's text: one that calls no command (a probe: "return 1") writes nothing
                if b"call(" in _text(command[1]):
                    return True
                continue
            if _text(command[1]).lower() not in _unguarded_shas():
                return True
    return False


# --------------------------------------------------------------------------- #
# the outcome of an operation
# --------------------------------------------------------------------------- #


class Outcome:
    """What the WAITs of one operation found: the first shortfall (None: all safe)."""

    __slots__ = ("short",)

    def __init__(self) -> None:
        self.short: str | None = None


_OUTCOME: contextvars.ContextVar[Outcome | None] = contextvars.ContextVar("tdstore_durability", default=None)


def begin() -> tuple[Outcome, contextvars.Token[Outcome | None]]:
    """Starts an operation in this context (thread, or task of the IO loop)."""
    outcome = Outcome()
    return outcome, _OUTCOME.set(outcome)


def end(token: contextvars.Token[Outcome | None]) -> None:
    _OUTCOME.reset(token)


def finish(outcome: Outcome, durability: Durability, what: str) -> None:
    """Raises :class:`~tdstore.errors.DurabilityError` when a WAIT of the operation fell short.

    ``what``: the store and server, for the message.
    """
    if outcome.short is None:
        return
    raise DurabilityError(
        f"a write to {what} was applied on the master, but {outcome.short} (durability={durability.spec!r}, "
        f"durability_timeout={durability.timeout:g}). It is not yet safe: a failover now may lose it. "
        + (
            "Check the replicas (INFO replication on the master: connected_slaves, their lag), or lower N."
            if not durability.fsync
            else "Check the server's disk and its appendonly settings."
        ),
        spec=durability.spec,
        detail=outcome.short,
    )


def wait_for(durability: Durability | None, commands: Sequence[Sequence[object]]) -> tuple[str | int, ...] | None:
    """The WAIT to send after ``commands``, or None: they write nothing, or this operation fell short already."""
    if durability is None or not writes(commands):
        return None
    outcome = _OUTCOME.get()
    if outcome is not None and outcome.short is not None:
        return None  # one wait per operation at most: it raises at its end anyway
    return durability.command()


def note(durability: Durability, reply: object) -> None:
    """Takes the reply to a WAIT: a shortfall goes into the operation's outcome (raises outside one)."""
    short = durability.shortfall(reply)
    if short is None:
        return
    outcome = _OUTCOME.get()
    if outcome is None:
        raise DurabilityError(
            f"a write was applied on the master, but {short} (durability={durability.spec!r}); it is not yet safe",
            spec=durability.spec,
            detail=short,
        )
    if outcome.short is None:
        outcome.short = short


# --------------------------------------------------------------------------- #
# the connection classes
# --------------------------------------------------------------------------- #


class _Durable:
    """What both mixins share: the WAIT added to a writing packet, and the count of its replies."""

    tdstore_durability: Durability

    def __init__(self, *args: object, tdstore_durability: Durability, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.tdstore_durability = tdstore_durability
        self._tds_left: int | None = None  # replies of the packet before its WAIT's

    def _with_wait(self, commands: Iterable[Sequence[object]]) -> list[Sequence[object]] | None:
        """``commands`` with the WAIT after them (its reply counted), or None: no wait."""
        commands = list(commands)
        wait = wait_for(self.tdstore_durability, commands)
        if wait is None:
            return None
        self._tds_left = len(commands)
        return [*commands, wait]

    def pack_commands(self, commands: Iterable[Sequence[object]]) -> object:
        commands = list(commands)
        return super().pack_commands(self._with_wait(commands) or commands)  # type: ignore[misc]

    def _replied(self) -> bool:
        """Counts one reply of the packet; True when the WAIT's reply comes next."""
        left = self._tds_left
        assert left is not None
        self._tds_left = left - 1 if left > 1 else None
        return left == 1


class _DurableAsync(_Durable):
    """Mixin of a ``redis.asyncio`` connection class: WAIT at the end of writing packets."""

    async def send_command(self, *args: object, **kwargs: object) -> None:
        commands = self._with_wait((args,))
        if commands is None:
            return await super().send_command(*args, **kwargs)  # type: ignore[misc,no-any-return]
        packet = super(_Durable, self).pack_commands(commands)  # type: ignore[misc]  # (the base's: no second WAIT)
        await self.send_packed_command(packet, check_health=kwargs.get("check_health", True))  # type: ignore[attr-defined]

    async def read_response(self, *args: object, **kwargs: object) -> object:
        if self._tds_left is None:
            return await super().read_response(*args, **kwargs)  # type: ignore[misc]
        error: BaseException | None = None
        reply: object = None
        try:
            reply = await super().read_response(*args, **kwargs)  # type: ignore[misc]
        except redis.exceptions.ResponseError as err:  # a reply too
            error = err
        except BaseException:
            self._tds_left = None
            raise
        if self._replied():
            try:
                waited: object = await super().read_response()  # type: ignore[misc]
            except redis.exceptions.ResponseError as err:
                waited = err
            note(self.tdstore_durability, waited)
        if error is not None:
            raise error
        return reply

    async def disconnect(self, *args: object, **kwargs: object) -> None:
        self._tds_left = None
        await super().disconnect(*args, **kwargs)  # type: ignore[misc]


class _DurableSync(_Durable):
    """Mixin of a blocking ``redis`` connection class: WAIT at the end of writing packets
    (the blocking drivers' own packets: :func:`tdstore._backend.wire.exchange_sync`)."""

    def send_command(self, *args: object, **kwargs: object) -> None:
        commands = self._with_wait((args,))
        if commands is None:
            super().send_command(*args, **kwargs)  # type: ignore[misc]
            return
        packet = super(_Durable, self).pack_commands(commands)  # type: ignore[misc]  # (the base's: no second WAIT)
        self.send_packed_command(packet, check_health=kwargs.get("check_health", True))  # type: ignore[attr-defined]

    def read_response(self, *args: object, **kwargs: object) -> object:
        if self._tds_left is None:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        error: BaseException | None = None
        reply: object = None
        try:
            reply = super().read_response(*args, **kwargs)  # type: ignore[misc]
        except redis.exceptions.ResponseError as err:
            error = err
        except BaseException:
            self._tds_left = None
            raise
        if self._replied():
            try:
                waited: object = super().read_response()  # type: ignore[misc]
            except redis.exceptions.ResponseError as err:
                waited = err
            note(self.tdstore_durability, waited)
        if error is not None:
            raise error
        return reply

    def disconnect(self, *args: object, **kwargs: object) -> None:
        self._tds_left = None
        super().disconnect(*args, **kwargs)  # type: ignore[misc]


@cache
def durable_class(base: type) -> type:
    """``base`` (a redis-py connection class, blocking or asyncio) with WAIT at the end of its writing packets.

    Its instances take ``tdstore_durability=`` (a :class:`Durability`) beside ``base``'s keywords.
    """
    mixin: type = _DurableAsync if issubclass(base, redis.asyncio.connection.AbstractConnection) else _DurableSync
    return type(f"Durable{base.__name__}", (mixin, base), {"__module__": __name__, "__qualname__": f"Durable{base.__name__}"})


def of(connection: object) -> Durability | None:
    """The durability of a connection (None: a plain one)."""
    return getattr(connection, "tdstore_durability", None)
