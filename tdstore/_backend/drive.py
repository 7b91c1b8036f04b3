"""Operations on one connection, written once, and the two drivers that run them.

An operation that holds a connection across round trips (an armed row write, a ring append:
WATCH, a script, then MULTI/EXEC on the same connection) is written once, as a generator that
yields the I/O it needs and gets each result back (or the error, thrown in at the ``yield``):

* ``Checkout(client)``: a connection of ``client``'s pool;
* ``Exchange(connection, commands)``: the commands sent in one packet, their replies read
  (an error reply as a value; a broken connection raises);
* ``Release(client, connection)``: the connection back to its pool as it is;
* ``Discard(client, connection)``: disconnected (which forgets a WATCH), then back to its pool;
* ``Usable(connection)``: whether a connection kept between operations can still be used.

It does no I/O itself. :func:`run_blocking` runs it on a blocking ``redis.Redis`` from the
calling thread (the payload sent from the tensors' own memory, see
:func:`tdstore._backend.wire.exchange_sync`); :func:`run_async` runs it on a ``redis.asyncio``
client on the IO loop (:func:`tdstore._backend.wire.exchange`). The commands and the meaning of
their replies are the same either way: only the transport differs.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any, NamedTuple, TypeVar, cast

from tdstore._backend import wire
from tdstore._backend.blocking import discard
from tdstore._backend.protocols import AsyncClient, SyncClient
from tdstore._core.layout import Command

__all__ = ["Checkout", "Exchange", "Release", "Discard", "Usable", "ConnOp", "run_blocking", "run_async"]

T = TypeVar("T")


class Checkout(NamedTuple):
    """A connection of ``client``'s pool (the result)."""

    client: SyncClient | AsyncClient


class Exchange(NamedTuple):
    """``commands`` in one packet on ``connection``; the result is their replies, errors as values."""

    connection: Any
    commands: Sequence[Command]


class Release(NamedTuple):
    """``connection`` back to ``client``'s pool, as it is (nothing left to read on it)."""

    client: SyncClient | AsyncClient
    connection: Any


class Discard(NamedTuple):
    """``connection`` disconnected (replies may be left unread on it; a WATCH is forgotten),
    then back to ``client``'s pool. Never raises into the operation."""

    client: SyncClient | AsyncClient
    connection: Any


class Usable(NamedTuple):
    """Whether ``connection``, kept out of its pool between operations, may be used (the result):
    connected, and (blocking) with nothing to read on it, as a server that closed it leaves it."""

    connection: Any
    #: also check that nothing is to be read (a blocking connection: one ``select``)
    idle: bool = False


Effect = Checkout | Exchange | Release | Discard | Usable
#: An operation: yields effects, gets their results, returns its own.
ConnOp = Generator[Effect, Any, T]


def _blocking(effect: Effect) -> Any:
    if type(effect) is Exchange:
        return wire.exchange_sync(effect.connection, effect.commands)
    if type(effect) is Checkout:
        return cast("SyncClient", effect.client).connection_pool.get_connection()
    if type(effect) is Release:
        cast("SyncClient", effect.client).connection_pool.release(effect.connection)
        return None
    if type(effect) is Discard:
        try:
            discard(cast("SyncClient", effect.client), effect.connection)
        except Exception:  # noqa: BLE001 - the connection is given up either way
            pass
        return None
    if type(effect) is Usable:
        return wire.alive(effect.connection) if effect.idle else wire.connected(effect.connection)
    raise TypeError(f"not an effect: {effect!r}")


def run_blocking(op: ConnOp[T]) -> T:
    """Runs ``op`` on a blocking client, from the calling thread."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            effect = op.send(value) if error is None else op.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        error = None
        try:
            value = _blocking(effect)
        except BaseException as err:  # noqa: BLE001 - thrown into the operation, which decides
            value, error = None, err


async def _async(effect: Effect) -> Any:
    if type(effect) is Exchange:
        return await wire.exchange(effect.connection, effect.commands)
    if type(effect) is Checkout:
        return await cast("AsyncClient", effect.client).connection_pool.get_connection()
    if type(effect) is Release:
        await cast("AsyncClient", effect.client).connection_pool.release(effect.connection)
        return None
    if type(effect) is Discard:
        try:
            try:
                await effect.connection.disconnect()
            finally:
                await cast("AsyncClient", effect.client).connection_pool.release(effect.connection)
        except Exception:  # noqa: BLE001 - the connection is given up either way
            pass
        return None
    if type(effect) is Usable:
        return bool(effect.connection.is_connected)
    raise TypeError(f"not an effect: {effect!r}")


async def run_async(op: ConnOp[T]) -> T:
    """Runs ``op`` on an asyncio client, on the IO loop."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            effect = op.send(value) if error is None else op.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        error = None
        try:
            value = await _async(effect)
        except BaseException as err:  # noqa: BLE001 - thrown into the operation, which decides
            value, error = None, err
