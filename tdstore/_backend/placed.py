"""Placed reads: large GETRANGE replies received straight into the tensor they fill.

A read of many large row runs (a sample of 256 rows of 21 KB) normally costs the client
three copies of every byte: hiredis's buffer, one ``bytes`` object per reply, then their
join. For a step that names where each large reply goes (``ReadStep.placed``), the
blocking driver instead parses the packet's replies itself, from the connection's socket,
and each reply with exactly its target's size is received into the target with
``recv_into``: one copy, from the kernel. Every other reply (small ones, errors, a run
of another length than asked) comes back as hiredis would give it, and the step's parser
falls back to the bytes for those.

Measured on the 2-core VM (256 random rows of 21,168 B, Valkey 8 over TCP, same run):
3.0 ms per read received this way, against 5.8 ms through redis-py's pipeline; the same
from a thread other than the main one, where the fresh ``bytes`` objects cost 6.5-13 ms
(glibc gives each thread its own arena, whose pages come and go).

Only for redis-py's own connections over a socket (``tdstore._backend.large.streams``),
without a durability option (whose WAIT the ordinary exchange adds and checks), and for
RESP2 and RESP3 replies of the kinds reads get: anything else makes the exchange fail, and
the read then goes again through the IO loop (a read changes nothing).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Mapping, Sequence

import redis.exceptions

from tdstore._backend import durability as _durability
from tdstore._backend import wire as _wire
from tdstore._backend.blocking import discard, keep_spare, take_spare
from tdstore._backend.protocols import SyncClient
from tdstore._core.layout import Command

__all__ = ["PLACED", "PLACE_MAX", "PLACE_MIN", "PLACE_MIN_PIECE", "usable", "exchange"]

#: What a reply received into its target is replaced by.
PLACED: object = type("Placed", (), {"__repr__": lambda self: "PLACED", "__slots__": ()})()

#: A plan's runs are placed when they add up to at least this many bytes ...
PLACE_MIN = 64 * 1024
#: ... and average at least this many per GETRANGE (below, parsing each reply in Python
#: costs more than the copies saved).
PLACE_MIN_PIECE = 2048
#: The most bytes one read places (its targets are allocated from the sizes the registry
#: gives, before the server answers): what one server string holds by default
#: (proto-max-bulk-len). A larger read goes unplaced, its replies checked against the
#: strings' sizes before any tensor is made, so a damaged registry (an entry claiming
#: terabytes) costs a read no more than this.
PLACE_MAX = 512 * 1024 * 1024

_RECV = 256 * 1024  # (bytes asked of the socket at a time for what is not placed)
#: an array's items that are all integers (BITFIELD's replies) are parsed in one pass when
#: there are at least this many (256 of them: 69 us against 175 us item by item)
_INTS_MIN = 16
#: integer items, whole (an int64 has at most 20 characters), and what may start them
_INT_ITEMS = re.compile(rb"(?::-?[0-9]{1,20}\r\n)*")
_INT_START = re.compile(rb":-?[0-9]{0,20}\r?\Z")


def usable(client: SyncClient) -> bool:
    """Whether the blocking ``client``'s connections can take a placed read."""
    pool = getattr(client, "connection_pool", None)
    cls = getattr(pool, "connection_class", None)
    if cls is None or not cls.__module__.startswith("redis."):
        return False
    kwargs = getattr(pool, "connection_kwargs", {})
    return not kwargs.get("decode_responses")


class _Replies:
    """The RESP replies of one connection, parsed from its socket, through a buffer of
    :data:`_RECV` bytes received into (``recv_into``: no copy per receive)."""

    def __init__(self, sock: socket.socket, parse_error: Callable[[str], Exception]) -> None:
        self.sock = sock
        self.buf = bytearray(_RECV)
        self.mv = memoryview(self.buf)
        self.pos = 0  # (the first byte not parsed yet)
        self.end = 0  # (past the last byte received)
        self.parse_error = parse_error

    def _fill(self) -> None:
        """Receives more bytes after what is buffered (moving that to the front first)."""
        if self.pos == self.end:
            self.pos = self.end = 0
        elif self.end == len(self.buf):
            if self.pos == 0:
                raise redis.exceptions.InvalidResponse(f"a reply line longer than {_RECV} bytes")
            n = self.end - self.pos
            self.buf[:n] = self.buf[self.pos : self.end]
            self.pos, self.end = 0, n
        got = self.sock.recv_into(self.mv[self.end :])
        if not got:
            raise redis.exceptions.ConnectionError("the server closed the connection")
        self.end += got

    def _line(self) -> bytearray:
        while True:
            at = self.buf.find(b"\r\n", self.pos, self.end)
            if at >= 0:
                line = self.buf[self.pos : at]
                self.pos = at + 2
                return line
            self._fill()

    def skip(self, expected: bytes) -> bool:
        """Whether the next bytes are ``expected`` (then parsed past), compared as they arrive:
        the MULTI's OK and QUEUEDs, which come back whole unless a command was refused."""
        matched = 0
        while matched < len(expected):
            if self.pos + matched >= self.end:
                if self.end == len(self.buf) and self.pos == 0:
                    return False  # (longer than the buffer: parsed one by one)
                self._fill()
                continue
            n = min(self.end - self.pos - matched, len(expected) - matched)
            if self.mv[self.pos + matched : self.pos + matched + n] != expected[matched : matched + n]:
                return False
            matched += n
        self.pos += matched
        return True

    def _into(self, view: memoryview) -> None:
        """Fills ``view``: first from what is buffered, then straight from the socket."""
        have = min(len(view), self.end - self.pos)
        if have:
            view[:have] = self.mv[self.pos : self.pos + have]
            self.pos += have
        while have < len(view):
            got = self.sock.recv_into(view[have:])
            if not got:
                raise redis.exceptions.ConnectionError("the server closed the connection")
            have += got

    def _bytes(self, size: int) -> bytes:
        if size + 2 <= len(self.buf):
            while self.end - self.pos < size + 2:
                self._fill()
            at = self.pos + size
            if self.buf[at : at + 2] != b"\r\n":
                raise redis.exceptions.InvalidResponse("a bulk reply does not end with CRLF")
            out = bytes(self.mv[self.pos : at])
            self.pos = at + 2
            return out
        # (grown as the bytes arrive, not allocated at the size the server declares: a
        # hostile size costs what the server really sends)
        raw = bytearray(self.mv[self.pos : self.end])
        self.pos = self.end
        while len(raw) < size + 2:
            data = self.sock.recv(min(_RECV * 4, size + 2 - len(raw)))
            if not data:
                raise redis.exceptions.ConnectionError("the server closed the connection")
            raw += data
        if raw[size:] != b"\r\n":
            raise redis.exceptions.InvalidResponse("a bulk reply does not end with CRLF")
        return bytes(raw[:size])

    def _crlf(self) -> None:
        while self.end - self.pos < 2:
            self._fill()
        if self.buf[self.pos : self.pos + 2] != b"\r\n":
            raise redis.exceptions.InvalidResponse("a bulk reply does not end with CRLF")
        self.pos += 2

    def _ints(self, count: int) -> list[int] | None:
        """The ``count`` items of an array when they are all integers, parsed in one pass as
        they arrive; None (nothing parsed) when one is not, or they do not fit the buffer."""
        while True:
            whole = _INT_ITEMS.match(self.buf, self.pos, self.end)
            assert whole is not None  # (the pattern matches the empty string)
            done = self.buf.count(b"\r\n", self.pos, whole.end())
            if done >= count:
                break
            # not all there yet: wait for more only if what follows the whole items may
            # still become one, and the buffer can take the rest
            rest = self.buf[whole.end() : self.end]
            if (rest and not _INT_START.match(rest)) or (self.pos == 0 and self.end == len(self.buf)):
                return None
            self._fill()
        if count == 0:
            return []
        at, lines = self.pos, self.buf[self.pos + 1 : whole.end() - 2].split(b"\r\n:", count)
        if len(lines) > count:  # (more integer replies follow the array: they stay unparsed)
            lines.pop()
        self.pos = at + sum(len(line) for line in lines) + 3 * count
        return [int(line) for line in lines]

    def reply(self, target: memoryview | None = None, targets: Mapping[int, memoryview] | None = None) -> object:
        """The next reply, as hiredis gives it (errors as values); a bulk reply of exactly
        ``target``'s size is received into it (:data:`PLACED`). ``targets``: for the items
        of an array reply (EXEC's), by position."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$" or kind == b"=":
            size = int(rest)
            if size < 0:
                return None
            if target is not None and size == len(target):
                self._into(target)
                self._crlf()
                return PLACED
            data = self._bytes(size)
            return data[4:] if kind == b"=" else data
        if kind == b":":
            return int(rest)
        if kind == b"+":
            return bytes(rest)
        if kind == b"-":
            return self.parse_error(rest.decode(errors="replace"))
        if kind == b"*" or kind == b"~":
            count = int(rest)
            if count < 0:
                return None
            if targets:
                return [self.reply(targets.get(i)) for i in range(count)]
            if count >= _INTS_MIN:
                ints = self._ints(count)
                if ints is not None:
                    return ints
            return [self.reply() for _ in range(count)]
        if kind == b"%":
            count = int(rest)
            out: list[object] = []
            for _ in range(count):
                out.append(self.reply())
                out.append(self.reply())
            return out
        if kind == b"_":
            return None
        if kind == b",":
            return float(rest)
        if kind == b"#":
            return int(rest == b"t")
        raise redis.exceptions.InvalidResponse(f"unexpected reply {line[:40]!r} to a placed read")


def exchange(
    client: SyncClient, commands: Sequence[Command], targets: Mapping[int, memoryview], *, transaction: bool,
    split: tuple[int, int] | None = None,
) -> list[object]:
    """``commands`` in one packet (in a MULTI/EXEC with ``transaction``) on a connection of
    the blocking ``client``; their replies, errors as values, the ones received into
    ``targets[i]`` (by command index) replaced by :data:`PLACED`. What
    :func:`tdstore._backend.blocking.exchange` / ``transaction`` return otherwise, and
    raises the same.

    ``split`` ``(head, tail)``, with ``transaction``: the first ``head`` commands in one
    MULTI, the last ``tail`` in another, and those between them plain, all in the same
    packet; the replies come back as one MULTI's would. (Those between are not a snapshot:
    see ``ReadStep.split``.)"""
    connection = take_spare(client)
    try:
        if _durability.of(connection) is not None:  # (the ordinary exchange adds its WAIT)
            raise redis.exceptions.ConnectionError("a placed read on a connection with a durability option")
        if _wire.socket_of(connection) is None:
            connection.connect()
        sock = _wire.socket_of(connection)
        if sock is None:
            raise redis.exceptions.ConnectionError("no socket to read a placed read from")
        parse_error = _wire.error_parser(connection)
        if transaction and split is not None:
            head, tail = split
            mid = len(commands) - head - tail
            sent = [("MULTI",), *commands[:head], ("EXEC",), *commands[head : head + mid], ("MULTI",), *commands[head + mid :], ("EXEC",)]
            _wire.send_sync(connection, _wire.packed(sent))
            replies = _Replies(sock, parse_error)
            out = _exec_reply(replies, head, {})
            out += [replies.reply(targets.get(head + i)) for i in range(mid)]
            out += _exec_reply(replies, tail, {})
        elif transaction:
            _wire.send_sync(connection, _wire.packed([("MULTI",), *commands, ("EXEC",)]))
            replies = _Replies(sock, parse_error)
            out = _exec_reply(replies, len(commands), targets)
        else:
            _wire.send_sync(connection, _wire.packed(list(commands)))
            replies = _Replies(sock, parse_error)
            out = [replies.reply(targets.get(i)) for i in range(len(commands))]
        if replies.pos != replies.end:
            raise redis.exceptions.InvalidResponse("the server sent more than the replies of a placed read")
    except TimeoutError:
        discard(client, connection)
        raise redis.exceptions.TimeoutError("Timeout reading from socket") from None
    except OSError as err:
        discard(client, connection)
        raise redis.exceptions.ConnectionError(f"error while reading a placed read: {err}") from err
    except BaseException:
        discard(client, connection)  # replies may be left unread on it
        raise
    keep_spare(client, connection)
    return out


def _exec_reply(replies: _Replies, count: int, targets: Mapping[int, memoryview]) -> list[object]:
    """The replies of a MULTI of ``count`` commands (its OK, QUEUEDs, then EXEC's array), as
    EXEC's items; a command refused at queueing (or an aborted EXEC) raises."""
    if replies.skip(b"+OK\r\n" + b"+QUEUED\r\n" * count):
        head = []
    else:
        head = [replies.reply() for _ in range(count + 1)]
    result = replies.reply(targets=targets)
    for reply in head:
        if isinstance(reply, Exception):
            raise reply
    if not isinstance(result, list) or len(result) != count:
        raise redis.exceptions.ResponseError(f"EXEC answered {result!r:.100} to a MULTI of {count} commands")
    return result
