"""Row writes of large runs in one round trip: a connection left WATCHing the store between writes.

``row_writes.write_runs_watched`` guards its SETRANGEs with WATCH on the store's meta hash:
WATCH, read the layout version, then MULTI/EXEC, which the server runs only if the meta
hash did not change since the WATCH. That costs three round trips before the bytes move.

Here the check of the next write is done at the end of the previous one: after EXEC, the
same packet WATCHes the meta hash and the data keys again and reads the layout version,
the expiry, the write version and whether the data keys exist as strings. The connection
is then kept out of the pool, still WATCHing ("armed"). The next write on it sends MULTI, the SETRANGEs and EXEC at once
(and re-arms in the same packet); if anything watched changed in between, EXEC does nothing
and the write is re-planned, exactly as when the WATCH is issued just before. A write that
finds no armed connection (the first one, another thread holding it, a changed layout)
issues WATCH and the reads in one packet first: two round trips instead of four.

:class:`_ArmedWrite` holds the commands and the meaning of their replies, without I/O, and
``_write_op`` the operation, written once (:mod:`tdstore._backend.drive`); two drivers run it:

* :func:`write_runs_direct`, on the store's blocking direct client (see
  ``Connection.direct_client``), from the calling thread: no hop to the IO loop, and the
  payload goes to the socket with ``sendall`` straight from the tensor's memory (redis.asyncio
  joins a command's arguments into one ``bytes`` first, a copy of the payload);
* :func:`write_runs_armed`, on the IO loop, for connections the direct client cannot make
  (TLS, custom connection classes) and calls made from the IO loop's thread.

An armed connection belongs to the client, and so to the process, that armed it; a fork, a
new client, an error or a cancellation drops it (disconnected, never reused).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio
import redis.exceptions

from tdstore._backend.blocking import discard
from tdstore._backend.drive import Checkout, ConnOp, Discard, Exchange, Release, Usable, run_async, run_blocking
from tdstore._backend.protocols import AsyncClient, SyncClient
from tdstore._backend.row_writes import write_runs_watched
from tdstore._backend.scripts import ScriptRunner
from tdstore._backend.translate import translate
from tdstore._core.chunks import setrange_commands, written_keys
from tdstore._core.keys import StoreKeys
from tdstore._core.layout import Command, counter_damage, data_key_commands, data_key_damage
from tdstore.errors import DataLostError, StaleLayoutError, StoreLockedError, StoreNotFoundError

__all__ = ["ArmedSlot", "COOL_WRITES", "write_runs_armed", "write_runs_direct"]

#: A pool must lend at least this many connections for one to be kept out of it (a small
#: or blocking pool would starve the store's other calls).
_MIN_POOL = 64

#: Writes sent the plain way after a contended one (see ArmedSlot).
COOL_WRITES = 32

#: Armed connections inherited through fork(): never touched nor collected (closing one
#: would unregister the parent's socket from the epoll instance both processes share).
_INHERITED: list[_Armed] = []

Groups = Sequence[tuple[tuple[str, ...], Sequence[tuple[int, int]], Any]]


@dataclass
class _Armed:
    client: Any  #: the client whose pool lent ``connection``
    connection: Any
    lv: str
    exp: str
    data_keys: frozenset[str]
    locked: bool = False  #: the store's lock (meta "lock") when armed: the meta hash is WATCHed


class ArmedSlot:
    """Holds at most one armed connection of one client of a store.

    ``cool``: writes left to send the plain way (``write_runs_watched``) after another
    client's write to the same data aborted an armed one: the data keys are WATCHed too (a
    deleted or evicted key must abort the write, not be recreated zero-padded), so row
    writers of one entry would keep aborting each other, while the plain way WATCHes the
    meta hash only for a moment.

    Thread-safe: the direct driver's slot is shared by every thread of the process.
    """

    __slots__ = ("armed", "cool", "_lock")

    def __init__(self) -> None:
        self.armed: _Armed | None = None
        self.cool = 0
        self._lock = threading.Lock()

    def take(self, client: Any) -> _Armed | None:
        with self._lock:
            armed, self.armed = self.armed, None
        if armed is not None and armed.client is not client:
            _INHERITED.append(armed)  # a replaced client (after a fork): its connection is not ours to touch
            return None
        return armed

    def put(self, armed: _Armed) -> _Armed | None:
        """Keeps ``armed``; returns the one it displaces (another thread's), to be dropped."""
        with self._lock:
            old, self.armed = self.armed, armed
        if old is not None and old.client is not armed.client:
            _INHERITED.append(old)
            return None
        return old

    def keep(self, armed: _Armed) -> bool:
        """Keeps ``armed`` when the slot is empty; False (nothing kept) when another thread's is there."""
        with self._lock:
            if self.armed is not None:
                return False
            self.armed = armed
            return True

    def cooling(self) -> bool:
        """Whether this write goes the plain way (and counts it)."""
        with self._lock:
            if self.cool <= 0:
                return False
            self.cool -= 1
            return True

    def contended(self, count: int = COOL_WRITES) -> None:
        with self._lock:
            self.cool = count

    async def drop(self, armed: _Armed | None) -> None:
        """Disconnects an armed connection of an asyncio client (this forgets its WATCH) and gives it back."""
        if armed is not None:
            await _discard(armed.client, armed.connection)

    def drop_sync(self, armed: _Armed | None) -> None:
        """:meth:`drop` for a connection of a blocking client."""
        if armed is not None:
            discard(armed.client, armed.connection)


async def _discard(client: AsyncClient, connection: redis.asyncio.connection.AbstractConnection) -> None:
    try:
        await connection.disconnect()
    finally:
        await client.connection_pool.release(connection)


def _s(value: Any) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def _can_park(client: SyncClient | AsyncClient) -> bool:
    pool = client.connection_pool
    if isinstance(pool, redis.ConnectionPool):
        return type(pool) is redis.ConnectionPool  # the direct client's own (unbounded) pool
    return type(pool) is redis.asyncio.ConnectionPool and (pool.max_connections or 0) >= _MIN_POOL


class _ArmedWrite:
    """One armed write: its commands and what their replies mean (no I/O; both drivers share it)."""

    def __init__(
        self, keys: StoreKeys, groups: Groups, expected: str, park: bool, *, check_lock: bool = False, whole: bool = False
    ) -> None:
        self.keys, self.groups, self.expected, self.park = keys, groups, expected, park
        #: refused on a locked store (a whole entry set anew: lock_() forbids it, as TensorDict's does)
        self.check_lock = check_lock
        #: whole entries written in place: a data key gone (evicted) is written whole again, not refused
        self.whole = whole
        self.data_keys = sorted(written_keys(keys, groups))
        self.sent = 0  #: commands of the write packet (MULTI ... EXEC)

    def usable(self, armed: _Armed | None, connected: bool) -> bool:
        # a connection dropped meanwhile (e.g. the pool was reset) would reconnect on send,
        # without the WATCH: the write must not go out on it
        return (
            armed is not None and connected and armed.lv == self.expected and armed.data_keys.issuperset(self.data_keys)
            and not (self.check_lock and armed.locked)
        )  # fmt: skip

    def arm_commands(self) -> list[Command]:
        keys, data_keys = self.keys, self.data_keys
        # (the write version is read to be checked: the MULTI's INCR of a damaged one would fail
        # after the SETRANGEs, which a server does not roll back)
        # (and each data key's type: a SETRANGE refused at a key of another type would leave
        # the MULTI's other commands applied, see data_key_commands)
        return [
            ("WATCH", keys.meta, *data_keys), ("HMGET", keys.meta, "lv", "exp", "lock"), ("GET", keys.wv),
            *data_key_commands(data_keys),
        ]

    def checked(self, replies: list[Any]) -> str:
        """The store's expiry from :meth:`arm_commands`' replies on a fresh connection; raises if it cannot write."""
        for reply in replies[:2]:
            if isinstance(reply, Exception):
                raise reply
        lv, exp, lock = replies[1]
        if lv is None:
            raise StoreNotFoundError(f"no store at {self.keys.meta}")
        if _s(lv) != self.expected:
            raise StaleLayoutError(f"layout version is {_s(lv)}, client assumed {self.expected}")
        if self.check_lock and _s(lock) == "1":
            raise StoreLockedError(f"the store at {self.keys.meta} is locked")
        damage: Exception | None = counter_damage(replies[2], self.keys.wv)
        if damage is not None:
            raise damage
        self._check_data(replies[3:])
        return _s(exp)

    def _check_data(self, replies: Sequence[object]) -> None:
        """Raises where the data keys' replies show one of another type, or one gone (unless
        ``whole``: a write of whole entries creates them)."""
        damage, exists = data_key_damage(self.data_keys, replies, self.keys.base)
        if damage is not None:
            raise damage
        if not exists and not self.whole:
            # a SETRANGE into an evicted key would recreate it zero-padded: refuse instead
            raise DataLostError(f"an entry written at {self.keys.base} is registered but its bytes are gone from the server")

    def commands(self, exp: str) -> list[Command]:
        """MULTI, the write version's INCR, the SETRANGEs, EXEC; then the re-arming reads when parking."""
        keys = self.keys
        commands: list[Command] = [("MULTI",), ("INCR", keys.wv)]
        for key, offset, data in setrange_commands(keys, self.groups):
            commands.append(("SETRANGE", key, offset, data))
        if exp:
            # the counter may be created by this INCR: it expires with the store (the meta
            # hash is WATCHed, so "exp" cannot change meanwhile)
            commands.append(("PEXPIREAT", keys.wv, int(exp)))
        commands.append(("EXEC",))
        self.sent = len(commands)
        return commands + (self.arm_commands() if self.park else [])

    def rearmed(self, client: Any, connection: Any, replies: list[Any]) -> _Armed | None:
        """The armed state the re-arming replies leave the connection in, or None if they do not arm."""
        if not self.park:
            return None
        watch, meta, wv = replies[self.sent : self.sent + 3]
        if isinstance(watch, Exception) or isinstance(meta, Exception):
            return None
        damage, exists = data_key_damage(self.data_keys, replies[self.sent + 3 :], self.keys.base)
        if counter_damage(wv, self.keys.wv) is not None or damage is not None:
            return None  # the next write arms afresh, and checked() says what is wrong
        lv, exp, lock = meta
        if lv is None or not exists:
            return None
        return _Armed(client, connection, _s(lv), _s(exp), frozenset(self.data_keys), _s(lock) == "1")

    def contended(self, replies: list[Any]) -> bool:
        """EXEC did nothing while the layout holds and the data keys exist: another client wrote
        the same data keys (the write then goes the plain way)."""
        if not self.park or replies[self.sent - 1] is not None:
            return False
        meta = replies[self.sent + 1]
        damage, exists = data_key_damage(self.data_keys, replies[self.sent + 3 :], self.keys.base)
        lv = meta[0] if isinstance(meta, list) else None
        return _s(lv) == self.expected and damage is None and exists

    def settle(self, slot: ArmedSlot, client: Any, connection: Any, replies: list[Any]) -> tuple[bool, list[Any], bool]:
        """After the write packet's replies: keeps the re-armed connection in ``slot``, or marks
        the slot contended. Returns (contended, the connections to drop, whether ``connection``
        goes back to the pool as it is); the driver does the I/O."""
        contended = self.contended(replies)
        rearmed = None if contended else self.rearmed(client, connection, replies)
        if contended:
            slot.contended()
        if rearmed is not None:
            displaced = slot.put(rearmed)
            return contended, [] if displaced is None else [displaced.connection], False
        if self.park:
            return contended, [connection], False  # (disconnecting forgets the WATCH)
        return contended, [], True  # EXEC ended the WATCH

    def outcome(self, replies: list[Any]) -> None:
        """Raises what the write's replies report (after :meth:`contended` said False)."""
        queued, result = replies[1 : self.sent - 1], replies[self.sent - 1]
        if isinstance(result, redis.exceptions.ResponseError):
            # EXECABORT: a command was refused when queued (e.g. over maxmemory); nothing ran
            first = next((r for r in queued if isinstance(r, Exception)), None)
            if isinstance(first, redis.exceptions.OutOfMemoryError):
                raise first
            raise result
        if result is None:
            # something watched changed: the layout, or a data key's existence
            if self.park:
                meta = replies[self.sent + 1]
                if isinstance(meta, list) and _s(meta[0]) == self.expected:
                    self._check_data(replies[self.sent + 3 :])  # (a data key replaced or gone meanwhile: the EXEC ran nothing)
            raise StaleLayoutError("the layout changed during an indexed write")
        for reply in result:
            if isinstance(reply, redis.exceptions.ResponseError):
                exc = translate(reply)
                raise exc from (reply if exc is not reply else None)


# --------------------------------------------------------------------------- #
# the operation, and its two drivers
# --------------------------------------------------------------------------- #


def _write_op(
    client: SyncClient | AsyncClient, keys: StoreKeys, slot: ArmedSlot, groups: Groups, expected: str, *,
    check_lock: bool = False, whole: bool = False,
) -> ConnOp[bool]:
    """One armed write (see the module docstring), for either driver.

    Returns False, having written nothing, when the write is to go the plain way
    (``write_runs_watched``): the slot is cooling down after contention, or this write's EXEC
    was aborted by another client's write of the same data.
    """
    if slot.cooling():
        return False
    write = _ArmedWrite(keys, groups, expected, _can_park(client), check_lock=check_lock, whole=whole)
    armed = slot.take(client)
    if armed is not None and not write.usable(armed, (yield Usable(armed.connection))):
        yield Discard(armed.client, armed.connection)
        armed = None
    connection: Any = armed.connection if armed is not None else None
    try:
        if armed is None:
            connection = yield Checkout(client)
            exp = write.checked((yield Exchange(connection, write.arm_commands())))
        else:
            exp = armed.exp
        replies = yield Exchange(connection, write.commands(exp))
    except BaseException:
        # a refusal before MULTI leaves the WATCH set; a failure or cancellation mid-way
        # leaves replies unread: either way the connection is not reused
        if connection is not None:
            yield Discard(client, connection)
        raise
    contended, drop, release = write.settle(slot, client, connection, replies)
    for conn in drop:
        yield Discard(client, conn)
    if release:
        yield Release(client, connection)
    if contended:
        return False
    write.outcome(replies)
    return True


async def write_runs_armed(
    client: AsyncClient, keys: StoreKeys, runner: ScriptRunner, slot: ArmedSlot, groups: Groups, *, expected: str,
    check_lock: bool = False, whole: bool = False,
) -> None:
    """Writes ``(path, runs, payload)`` groups with SETRANGEs in one MULTI, guarded as ``write_runs_watched``,
    on the IO loop (the operation run by :func:`tdstore._backend.drive.run_async`).

    Same guarantee: all runs of all entries land in one step, or none, and only if the
    layout is still version ``expected``; the write version is bumped with them.

    ``check_lock``: refused while the store is locked (a whole entry set anew). ``whole``: the
    groups are whole entries written in place (each from byte 0 to its end): a data key gone
    from the server is written whole again instead of refused.

    Raises:
        StaleLayoutError: the layout version differs, or something watched changed.
        StoreNotFoundError: the store does not exist.
        StoreLockedError: ``check_lock`` and the store is locked.
        DataLostError: a data key written to is gone from the server (not with ``whole``).
    """
    if not await run_async(_write_op(client, keys, slot, groups, expected, check_lock=check_lock, whole=whole)):
        await write_runs_watched(
            client, keys, runner, groups, expected=expected, check_lock=check_lock, small_via_script=not whole
        )


def write_runs_direct(
    client: SyncClient, keys: StoreKeys, slot: ArmedSlot, groups: Groups, *, expected: str, check_lock: bool = False,
    whole: bool = False,
) -> bool:
    """:func:`write_runs_armed` on a blocking client, from the calling thread (the same
    operation, run by :func:`tdstore._backend.drive.run_blocking`).

    Returns False, having written nothing, when the write is to go the plain way
    (``write_runs_watched`` on the IO loop): the slot is cooling down after contention, or
    this write's EXEC was aborted by another client's write of the same data.

    Raises:
        the errors of :func:`write_runs_armed`, and redis-py's connection errors (the
        write is then all applied or not at all, as any MULTI/EXEC).
    """
    return run_blocking(_write_op(client, keys, slot, groups, expected, check_lock=check_lock, whole=whole))
