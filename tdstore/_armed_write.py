"""Row writes of large runs in one round trip: a connection left WATCHing the store between writes.

``_backend.write_runs_watched`` guards its SETRANGEs with WATCH on the store's meta hash:
WATCH, read the layout version, then MULTI/EXEC, which the server runs only if the meta
hash did not change since the WATCH. That costs three round trips before the bytes move.

Here the check of the next write is done at the end of the previous one: after EXEC, the
same packet WATCHes the meta hash and the data keys again and reads the layout version,
the expiry and whether the data keys exist. The connection is then kept out of the pool,
still WATCHing ("armed"). The next write on it sends MULTI, the SETRANGEs and EXEC at once
(and re-arms in the same packet); if anything watched changed in between, EXEC does nothing
and the write is re-planned, exactly as when the WATCH is issued just before. A write that
finds no armed connection (the first one, another thread holding it, a changed layout)
issues WATCH and the reads in one packet first: two round trips instead of four.

The armed connection belongs to the IO loop of the process that armed it; a fork, a new
client, an error or a cancellation drops it (disconnected, never reused).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio
import redis.exceptions

from tdstore._backend import write_runs_watched
from tdstore._chunks import setrange_commands, written_keys
from tdstore._keys import StoreKeys
from tdstore._scripts import ScriptRunner
from tdstore.errors import DataLostError, StaleLayoutError, StoreNotFoundError, translate_response_error

__all__ = ["ArmedSlot", "write_runs_armed"]

#: A pool must lend at least this many connections for one to be kept out of it (a small
#: or blocking pool would starve the store's other calls).
_MIN_POOL = 64

#: Armed connections inherited through fork(): never touched nor collected (closing one
#: would unregister the parent's socket from the epoll instance both processes share).
_INHERITED: list[Any] = []


@dataclass
class _Armed:
    client: Any  #: the redis.asyncio client whose pool lent ``connection``
    connection: Any
    lv: str
    exp: str
    data_keys: frozenset[str]


class ArmedSlot:
    """Holds at most one armed connection of a store; used only on the IO loop's thread.

    ``cool``: writes left to send the plain way (``write_runs_watched``) after another
    client's write to the same data aborted an armed one: the data keys are WATCHed too (a
    deleted or evicted key must abort the write, not be recreated zero-padded), so row
    writers of one entry would keep aborting each other, while the plain way WATCHes the
    meta hash only for a moment.
    """

    __slots__ = ("armed", "cool")

    def __init__(self) -> None:
        self.armed: _Armed | None = None
        self.cool = 0

    def take(self, client: Any) -> _Armed | None:
        armed, self.armed = self.armed, None
        if armed is not None and armed.client is not client:
            _INHERITED.append(armed)  # a replaced client (after a fork): its connection is not ours to touch
            return None
        return armed

    async def drop(self, armed: _Armed | None) -> None:
        """Disconnects an armed connection (this forgets its WATCH) and gives it back to its pool."""
        if armed is None:
            return
        await _discard(armed.client, armed.connection)


async def _discard(client: Any, connection: Any) -> None:
    try:
        await connection.disconnect()
    finally:
        await client.connection_pool.release(connection)


def _s(value: Any) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


async def _read_replies(connection: Any, count: int) -> list[Any]:
    """Reads ``count`` replies; an error reply is returned in place (the stream stays in step)."""
    out: list[Any] = []
    for _ in range(count):
        try:
            out.append(await connection.read_response())
        except redis.exceptions.ResponseError as err:
            out.append(err)
    return out


def _can_park(client: Any) -> bool:
    pool = client.connection_pool
    return type(pool) is redis.asyncio.ConnectionPool and (pool.max_connections or 0) >= _MIN_POOL


def _arm_commands(keys: StoreKeys, data_keys: Sequence[str]) -> list[tuple[Any, ...]]:
    return [("WATCH", keys.meta, *data_keys), ("HMGET", keys.meta, "lv", "exp"), ("EXISTS", *data_keys)]


def _armed_from(client: Any, connection: Any, replies: list[Any], data_keys: Sequence[str]) -> _Armed | None:
    """The armed state read by :func:`_arm_commands`'s replies, or None if they do not arm."""
    watch, meta, exists = replies
    if isinstance(watch, Exception) or isinstance(meta, Exception) or isinstance(exists, Exception):
        return None
    lv, exp = meta
    if lv is None or exists != len(data_keys):
        return None
    return _Armed(client, connection, _s(lv), _s(exp), frozenset(data_keys))


#: Writes sent the plain way after a contended one (see ArmedSlot).
COOL_WRITES = 32


async def write_runs_armed(
    client: Any,
    keys: StoreKeys,
    runner: ScriptRunner,
    slot: ArmedSlot,
    groups: Sequence[tuple[tuple[str, ...], Sequence[tuple[int, int]], Any]],
    *,
    expected: str,
) -> None:
    """Writes ``(path, runs, payload)`` groups with SETRANGEs in one MULTI, guarded as ``write_runs_watched``.

    Same guarantee: all runs of all entries land in one step, or none, and only if the
    layout is still version ``expected``; the write version is bumped with them.

    Raises:
        StaleLayoutError: the layout version differs, or something watched changed.
        StoreNotFoundError: the store does not exist.
        DataLostError: a data key written to is gone from the server.
    """
    if slot.cool > 0:
        slot.cool -= 1
        await write_runs_watched(client, keys, runner, groups, expected=expected)
        return
    data_keys = sorted(written_keys(keys, groups))
    armed = slot.take(client)
    if armed is not None and (
        # disconnected meanwhile (e.g. the pool was reset): redis-py would reconnect on send,
        # without the WATCH, so the write must not go out on it
        not armed.connection.is_connected or armed.lv != expected or not armed.data_keys.issuperset(data_keys)
    ):
        await slot.drop(armed)
        armed = None
    connection: Any = armed.connection if armed is not None else None
    try:
        if armed is None:
            connection = await client.connection_pool.get_connection()
            await connection.send_packed_command(connection.pack_commands(_arm_commands(keys, data_keys)), check_health=False)
            replies = await _read_replies(connection, 3)
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            lv, exp = replies[1]
            if lv is None:
                raise StoreNotFoundError(f"no store at {keys.meta}")
            if _s(lv) != expected:
                raise StaleLayoutError(f"layout version is {_s(lv)}, client assumed {expected}")
            if replies[2] != len(data_keys):
                # a SETRANGE into an evicted key would recreate it zero-padded: refuse instead
                raise DataLostError(
                    f"an entry written at {keys.base} is registered but its bytes are gone from the server"
                )
            exp = _s(exp)
        else:
            exp = armed.exp
        commands: list[tuple[Any, ...]] = [("MULTI",), ("INCR", keys.wv)]
        for key, offset, data in setrange_commands(keys, groups):
            commands.append(("SETRANGE", key, offset, data))
        if exp:
            # the counter may be created by this INCR: it expires with the store (the meta
            # hash is WATCHed, so "exp" cannot change meanwhile)
            commands.append(("PEXPIREAT", keys.wv, int(exp)))
        commands.append(("EXEC",))
        arm = _arm_commands(keys, data_keys) if _can_park(client) else []
        await connection.send_packed_command(connection.pack_commands(commands + arm), check_health=False)
        replies = await _read_replies(connection, len(commands) + len(arm))
    except BaseException:
        # a refusal before MULTI leaves the WATCH set; a failure or cancellation mid-way
        # leaves replies unread: either way the connection is not reused
        if connection is not None:
            await _discard(client, connection)
        raise
    if arm:
        slot.armed = _armed_from(client, connection, replies[len(commands) :], data_keys)
        if slot.armed is None:
            await _discard(client, connection)  # (disconnecting forgets the WATCH)
    else:
        await client.connection_pool.release(connection)  # EXEC ended the WATCH
    queued, result = replies[1 : len(commands) - 1], replies[len(commands) - 1]
    if isinstance(result, redis.exceptions.ResponseError):
        # EXECABORT: a command was refused when queued (e.g. over maxmemory); nothing ran
        first = next((r for r in queued if isinstance(r, Exception)), None)
        if isinstance(first, redis.exceptions.OutOfMemoryError):
            raise first
        raise result
    if result is None:
        # something watched changed: the layout, a data key's existence, or (most often)
        # another client wrote rows of the same entry
        state = slot.armed
        meta, exists = (replies[len(commands) + 1], replies[-1]) if arm else (None, None)
        lv = meta[0] if isinstance(meta, list) else None
        if not arm or _s(lv) != expected:
            raise StaleLayoutError("the layout changed during an indexed write")
        if exists != len(data_keys):
            raise DataLostError(f"an entry written at {keys.base} is registered but its bytes are gone from the server")
        # the layout holds: contention on the data; write the plain way for a while
        slot.armed, slot.cool = None, COOL_WRITES
        await slot.drop(state)
        await write_runs_watched(client, keys, runner, groups, expected=expected)
        return
    for reply in result:
        if isinstance(reply, redis.exceptions.ResponseError):
            exc = translate_response_error(reply)
            raise exc from (reply if exc is not reply else None)
