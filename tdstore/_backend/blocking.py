"""The blocking-socket driver's connection handling: a connection of a blocking client kept
between direct exchanges (no pool checkout per call), and the exchanges themselves (commands sent
in one packet, replies read as values; a MULTI/EXEC of them). The asyncio driver is
:mod:`tdstore._backend.loop`; what goes on the wire is :mod:`tdstore._backend.wire`'s.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import redis.exceptions

from tdstore._backend.protocols import SyncClient
from tdstore._backend.translate import translate
from tdstore._backend.wire import alive, exchange_sync
from tdstore._core.layout import Arg, Command

__all__ = ["discard", "take_spare", "keep_spare", "exchange", "transaction", "call_script"]


def discard(client: SyncClient, connection: redis.connection.Connection) -> None:
    try:
        connection.disconnect()
    finally:
        client.connection_pool.release(connection)


#: The attribute of a blocking client of tdstore's that holds a connection kept between
#: direct exchanges: ``(pid, connection)``.
_SPARE = "_tdstore_spare"


def take_spare(client: SyncClient) -> Any:
    """A connection of ``client``'s pool for one exchange: the one kept after the last (no
    checkout), else one from the pool. Thread-safe: ``dict.pop`` hands it to one thread."""
    held = client.__dict__.pop(_SPARE, None)
    if held is not None:
        pid, connection = held
        if pid == os.getpid():  # (a forked child leaves its parent's connection alone)
            if alive(connection):
                return connection
            discard(client, connection)  # closed by the server, or by close()
    return client.connection_pool.get_connection()


def keep_spare(client: SyncClient, connection: redis.connection.Connection) -> None:
    """Keeps ``connection`` (idle, nothing to read on it) for the next exchange of
    ``client``; back to the pool when another thread's is kept already."""
    held = (os.getpid(), connection)
    if client.__dict__.setdefault(_SPARE, held) is not held:
        client.connection_pool.release(connection)


def exchange(client: SyncClient, commands: Sequence[Command]) -> list[Any]:
    """Sends ``commands`` in one packet on a connection of a blocking client and returns their
    replies, errors as values (armed_write's exchange): what ``pipeline(transaction=False)
    .execute(raise_on_error=False)`` does for commands whose replies need no parsing callback
    (GETRANGE, STRLEN, HGET), without redis-py's per-pipeline bookkeeping (a third of a
    one-row read's client time)."""
    connection = take_spare(client)  # (the one kept after the last exchange: no pool checkout)
    try:
        replies = exchange_sync(connection, commands)
    except BaseException:
        discard(client, connection)  # replies may be left unread on it
        raise
    keep_spare(client, connection)
    return replies


def transaction(client: SyncClient, commands: Sequence[Command]) -> list[Any]:
    """MULTI, ``commands`` and EXEC sent in one packet on a blocking client (:func:`exchange`):
    EXEC's replies, errors as values, as ``pipeline(transaction=True).execute(raise_on_error=
    False)`` gives them for commands whose replies need no parsing callback, without redis-py's
    per-command bookkeeping (measured on the busy 2-core VM, the MULTIs of ``to_tensordict()``
    of 32 small leaves and of a lazy element read: 254 and 98 us a call, against 325 and 170
    through the pipeline).

    Raises what the server refused before EXEC ran (a command it would not queue, e.g. over
    maxmemory; EXECABORT), as redis-py's errors: the caller's direct try then falls back to
    the IO loop's read, which deals with it (see ``Connection.read``).
    """
    replies = exchange(client, [("MULTI",), *commands, ("EXEC",)])
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    result = replies[-1]
    if not isinstance(result, list) or len(result) != len(commands):
        raise redis.exceptions.ResponseError(f"EXEC answered {result!r:.100} to a MULTI of {len(commands)} commands")
    return result


def call_script(client: SyncClient, sha: str, keys: Sequence[str], args: Sequence[Arg]) -> object:
    """One EVALSHA in one packet on a blocking client (:func:`exchange`): what
    ``ScriptRunner.call`` does on the IO loop, without its NOSCRIPT retry (the caller sends the
    call again that way when this raises anything but a script's TDS_* error).

    Raises:
        TDStoreError subclasses for the script's TDS_* error codes; redis-py's errors else.
    """
    reply = exchange(client, [("EVALSHA", sha, len(keys), *keys, *args)])[0]
    if isinstance(reply, Exception):
        if not isinstance(reply, redis.exceptions.NoScriptError):
            exc = translate(reply)
            if exc is not reply:
                raise exc from reply
        raise reply
    return reply
