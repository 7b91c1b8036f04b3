"""redis-py below its command API, in one module: every private part of redis-py that tdstore
uses is used here, and only here.

Three fast paths need them:

* the blocking drivers (``Connection.direct_client``: reads, armed writes and appends sent
  from the calling thread) write a packet to the connection's socket (``_sock``) with one
  ``sendmsg``, never reconnecting (a write that relies on the connection's WATCH must fail
  when it was closed), and read the replies straight from the hiredis reader
  (``_parser._reader``, ``NOT_ENOUGH_DATA``);
* large writes on the IO loop (``tdstore._backend.large.streamed``) write big buffers in
  slices to the asyncio connection's ``_writer``;
* :func:`exchange` sends a packet on an asyncio connection (public API only).

:data:`MISSING` names the parts the installed redis-py lacks (checked at import, without I/O;
``tests/test_wire.py`` fails when it is not empty, naming them). Without them tdstore falls
back to redis-py's public API: no direct client (every operation goes through the IO loop's
asyncio client), replies read with ``read_response``, large writes sent whole. Slower, the
same results. The supported releases are pinned in pyproject.toml; CI runs part of the
suite on the lowest and the whole suite on the newest.
"""

from __future__ import annotations

import asyncio
import functools
import select
import socket
import types
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import redis.asyncio.connection
import redis.connection
import redis.exceptions

from tdstore._backend import durability as _durability
from tdstore._backend.protocols import AsyncConnection, SyncConnection
from tdstore._core.layout import Command, PackedCommand

_HiredisParser: Any
NOT_ENOUGH_DATA: Any
try:
    from redis._parsers import _HiredisParser
except ImportError:  # pragma: no cover - a release that moved it (see MISSING)
    _HiredisParser = None
try:
    from redis._parsers.hiredis import NOT_ENOUGH_DATA
except ImportError:  # pragma: no cover - redis-py 5.0.0, or a release that moved it
    NOT_ENOUGH_DATA = None

__all__ = [
    "MISSING", "ZERO_COPY_MIN", "alive", "connected", "direct_ok", "error_parser", "exchange", "exchange_sync", "packed", "probe",
    "send_sync", "socket_of", "streamable", "streamed_sends", "unstreamed",
]

#: The private parts the blocking drivers need, and those the streamed writes need.
SYNC_PARTS = (
    "redis._parsers._HiredisParser", "redis._parsers.hiredis.NOT_ENOUGH_DATA", "redis.connection.Connection._sock",
    "redis.connection.Connection._parser", "redis._parsers._HiredisParser.read_from_socket",
)
ASYNC_PARTS = (
    "redis.asyncio.connection.Connection._writer", "redis.asyncio.connection.Connection.connect_check_health",
    "redis.asyncio.connection.Connection.check_health", "redis.asyncio.connection.Connection.socket_timeout",
)


def probe() -> tuple[str, ...]:
    """The private parts of redis-py (of :data:`SYNC_PARTS` and :data:`ASYNC_PARTS`) the
    installed release lacks; no I/O (connections are made, never connected)."""
    missing = []
    if _HiredisParser is None:
        missing.append("redis._parsers._HiredisParser")
    elif not hasattr(_HiredisParser, "read_from_socket"):
        missing.append("redis._parsers._HiredisParser.read_from_socket")
    if NOT_ENOUGH_DATA is None:
        missing.append("redis._parsers.hiredis.NOT_ENOUGH_DATA")
    sync = redis.connection.Connection()
    missing += [f"redis.connection.Connection.{name}" for name in ("_sock", "_parser") if not hasattr(sync, name)]
    aio = redis.asyncio.connection.Connection()
    missing += [
        f"redis.asyncio.connection.Connection.{name}"
        for name in ("_writer", "connect_check_health", "check_health", "socket_timeout") if not hasattr(aio, name)
    ]
    return tuple(missing)


#: What :func:`probe` found missing at import (a test may set it to simulate a release without them).
MISSING: tuple[str, ...] = probe()


def direct_ok() -> bool:
    """Whether the blocking drivers may run (every part of :data:`SYNC_PARTS` is there)."""
    return not any(part in SYNC_PARTS for part in MISSING)


def streamable() -> bool:
    """Whether large writes may be streamed (every part of :data:`ASYNC_PARTS` is there)."""
    return not any(part in ASYNC_PARTS for part in MISSING)


def socket_of(connection: object) -> Any:
    """The socket of a blocking connection of redis-py's, or None (not connected)."""
    return getattr(connection, "_sock", None)


def error_parser(connection: object) -> Callable[[str], Exception]:
    """What the parser of a blocking connection of redis-py's makes of an error reply's text
    (the exception class by its prefix: ``NOSCRIPT``, ``MOVED``, ...); ResponseError for all
    where it has none."""
    parse = getattr(getattr(connection, "_parser", None), "parse_error", None)
    return parse if callable(parse) else redis.exceptions.ResponseError


# --------------------------------------------------------------------------- #
# the asyncio connection
# --------------------------------------------------------------------------- #


async def exchange(connection: AsyncConnection, commands: Sequence[Command]) -> list[Any]:
    """Sends ``commands`` in one packet and reads their replies; an error reply is returned in
    place. Any other failure (a timeout, a broken connection) disconnects the connection, so
    that no reply of this packet is read as another command's."""
    try:
        await connection.send_packed_command(connection.pack_commands(commands), check_health=False)
        out: list[Any] = []
        for _ in commands:
            try:
                out.append(await connection.read_response())
            except redis.exceptions.ResponseError as err:
                out.append(err)
        return out
    except BaseException:
        await connection.disconnect()
        raise


# --------------------------------------------------------------------------- #
# the blocking connection
# --------------------------------------------------------------------------- #


#: Buffer arguments at least this large go to the socket from their own memory, not copied.
ZERO_COPY_MIN = 64 * 1024


@lru_cache(maxsize=4096)
def _bulk_str(arg: str) -> bytes:
    """The RESP bulk string of ``arg`` (keys and field names recur: memoized)."""
    data = arg.encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


def packed(commands: Sequence[Command]) -> list[bytes | memoryview]:
    """The RESP encoding of ``commands``: ``bytes`` pieces, with every large buffer argument
    in between as itself, to be sent from its own memory.

    (redis-py's blocking connections, with hiredis installed, copy a ``memoryview`` argument
    into ``bytes`` and then into the packed command: two copies of the payload.)
    """
    out: list[bytes | memoryview] = []
    head = bytearray()
    # (an Arg, told apart by its exact type below, which mypy does not follow from ``kind``)
    arg: Any
    for command in commands:
        if type(command) is PackedCommand:
            head += command.resp
            continue
        head += b"*%d\r\n" % len(command)
        for arg in command:
            kind = type(arg)  # (exact types first: this runs for every argument of every packet)
            if kind is str:
                head += _bulk_str(arg)
                continue
            if kind is int:
                data = b"%d" % arg
            elif kind is bytes:
                data = arg
            elif isinstance(arg, memoryview):
                head += b"$%d\r\n" % arg.nbytes
                if arg.nbytes >= ZERO_COPY_MIN:
                    out.append(bytes(head))
                    out.append(arg)
                    head = bytearray(b"\r\n")
                    continue
                head += arg
                head += b"\r\n"
                continue
            else:
                data = arg if isinstance(arg, bytes) else str(arg).encode()
            head += b"$%d\r\n" % len(data)
            head += data
            head += b"\r\n"
    out.append(bytes(head))
    return out


#: Buffers one ``sendmsg`` call passes (Linux's IOV_MAX is 1024).
_IOV_BATCH = 512
_GATHER = hasattr(socket.socket, "sendmsg")


def _send_gathered(sock: Any, pieces: Sequence[bytes | memoryview]) -> None:
    """``sendall`` of ``pieces`` back to back, with one ``sendmsg`` system call per batch of
    buffers instead of one call each: the server then finds a packet's commands together
    (one read, not one wake-up per piece), and the client makes fewer system calls."""
    views = [memoryview(piece).cast("B") for piece in pieces]
    i = 0
    while i < len(views):
        batch = views[i : i + _IOV_BATCH]
        sent = sock.sendmsg(batch)
        # (a blocking socket with a timeout may take part of the data: send the rest)
        for view in batch:
            if sent >= view.nbytes:
                sent -= view.nbytes
                i += 1
                continue
            views[i] = view[sent:]
            break


def send_sync(connection: SyncConnection, pieces: Sequence[bytes | memoryview]) -> None:
    """Writes ``pieces`` to the connection's socket, never reconnecting.

    (redis-py's ``send_packed_command`` reconnects a connection found disconnected, e.g. by
    a concurrent ``close()``: a write that relies on the connection's WATCH must fail then.)
    """
    sock = socket_of(connection)
    if sock is None:
        raise redis.exceptions.ConnectionError("the armed connection was closed")
    try:
        if len(pieces) == 1 or not _GATHER:
            for piece in pieces:
                sock.sendall(piece)
        else:
            _send_gathered(sock, pieces)
    except TimeoutError:
        connection.disconnect()
        raise redis.exceptions.TimeoutError("Timeout writing to socket") from None
    except OSError as err:
        connection.disconnect()
        raise redis.exceptions.ConnectionError(f"error while writing to socket: {err}") from err


def exchange_sync(connection: SyncConnection, commands: Sequence[Command]) -> list[Any]:
    """Sends ``commands`` in one packet and reads their replies; an error reply is returned in place.

    On a connection of a store with ``durability=`` a packet that writes ends with its WAIT
    (see tdstore/_backend/durability.py), whose reply is noted and not returned.
    """
    durability = _durability.of(connection)
    wait = None if durability is None else _durability.wait_for(durability, commands)
    if wait is not None:
        commands = [*commands, wait]
    send_sync(connection, packed(commands))
    reader = _hiredis_reader(connection)
    if reader is not None:
        out = _read_replies(getattr(connection, "_parser", None), reader, len(commands))
    else:
        out = []
        for _ in commands:
            try:
                out.append(connection.read_response())
            except redis.exceptions.ResponseError as err:
                out.append(err)
    if wait is not None:
        assert durability is not None
        _durability.note(durability, out.pop())
    return out


def _hiredis_reader(connection: object) -> Any:
    """The hiredis reader of a connection of redis-py's (None for another parser: replies are
    then read one by one through ``read_response``)."""
    parser = getattr(connection, "_parser", None)
    if _HiredisParser is None or NOT_ENOUGH_DATA is None or type(parser) is not _HiredisParser:
        return None
    return getattr(parser, "_reader", None)


def _read_replies(parser: Any, reader: Any, count: int) -> list[Any]:
    """``count`` replies straight from the hiredis reader: what ``read_response`` returns for
    each (RESP2 or RESP3), without its per-reply bookkeeping."""
    push = getattr(parser, "_hiredis_PushNotificationType", None)
    out: list[Any] = []
    while len(out) < count:
        reply = reader.gets()
        kind = type(reply)
        if kind is bytes or kind is int:  # (most replies: QUEUED, OK, counters, lengths)
            out.append(reply)
            continue
        if reply is NOT_ENOUGH_DATA:
            parser.read_from_socket()
            continue
        if isinstance(reply, redis.exceptions.ConnectionError):
            raise reply
        if push is not None and isinstance(reply, push):
            parser.handle_push_response(reply)  # (RESP3: not a reply to a command)
            continue
        if isinstance(reply, list) and reply and isinstance(reply[0], redis.exceptions.ConnectionError):
            raise reply[0]
        out.append(reply)
    return out


def alive(connection: object) -> bool:
    """A parked connection still usable: connected, with nothing to read (a server that
    closed it, on restart or idle timeout, leaves it readable at end of file)."""
    sock = socket_of(connection)
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


def connected(connection: object) -> bool:
    """Whether a blocking connection has its socket (redis-py 6 has no ``is_connected``)."""
    return socket_of(connection) is not None


# --------------------------------------------------------------------------- #
# large writes on the asyncio connection
# --------------------------------------------------------------------------- #


async def _send_streamed(self: Any, command: Any, check_health: bool = True, *, min_bytes: int, piece: int) -> None:
    """``send_packed_command`` of a redis-py connection, writing large memoryviews in slices."""
    if not self.is_connected:
        await self.connect_check_health(check_health=False)
    if check_health:
        await self.check_health()
    if isinstance(command, str):
        command = command.encode()
    if isinstance(command, bytes):
        command = [command]
    writer = self._writer
    timeout = self.socket_timeout
    pending: list[Any] = []

    async def drain() -> None:
        if timeout:
            await asyncio.wait_for(writer.drain(), timeout)
        else:
            await writer.drain()

    try:
        for item in command:
            if isinstance(item, memoryview) and item.nbytes >= min_bytes:
                if pending:
                    writer.write(b"".join(pending))
                    pending = []
                view = item.cast("B") if item.format != "B" or item.ndim != 1 else item
                for offset in range(0, view.nbytes, piece):
                    writer.write(view[offset : offset + piece])
                    await drain()  # the transport holds at most one slice
            else:
                pending.append(item)
        if pending:
            writer.write(b"".join(pending))
        await drain()
    except asyncio.TimeoutError:
        await self.disconnect(nowait=True)
        raise redis.exceptions.TimeoutError("Timeout writing to socket") from None
    except OSError as err:
        await self.disconnect(nowait=True)
        raise redis.exceptions.ConnectionError(f"Error while writing to socket: {err}") from err
    except BaseException:
        # a command cut short: the connection cannot be reused
        await self.disconnect(nowait=True)
        raise


def streamed_sends(conn: AsyncConnection, min_bytes: int, piece: int) -> bool:
    """Makes the asyncio connection ``conn`` send every memoryview argument of at least
    ``min_bytes`` in slices of ``piece`` bytes (until :func:`unstreamed`); False, changing
    nothing, when it cannot (redis-py lacks the parts, or ``conn`` is not one of its own
    socket connections, or it is streamed already)."""
    if not streamable() or not hasattr(conn, "_writer") or "send_packed_command" in vars(conn):
        return False
    send = functools.partial(_send_streamed, min_bytes=min_bytes, piece=piece)
    conn.send_packed_command = types.MethodType(send, conn)  # type: ignore[method-assign]  # (this instance only)
    return True


def unstreamed(conn: object) -> None:
    """Undoes :func:`streamed_sends`."""
    vars(conn).pop("send_packed_command", None)
