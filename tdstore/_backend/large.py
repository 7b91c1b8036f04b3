"""Large entries: writes streamed from the tensor's memory, reads in pieces into a preallocated tensor.

Both work on one redis-py connection of the client's pool, below the pipeline API, and only
for connections that talk to a socket (redis-py's own classes; an in-process server such
as fakeredis takes the ordinary path).

* **Writes** (:func:`streamed`): redis-py 8.1 on Python 3.11 sends a command with
  ``StreamWriter.writelines``, which joins every argument into one ``bytes`` (a copy of the
  whole payload), and asyncio copies what the socket does not take at once twice more
  (``data[n:]`` of that ``bytes``, then into the transport's buffer): three copies of a
  1 GiB tensor in the client. While :func:`streamed` is active, the pipeline's connection
  instead writes every large ``memoryview`` argument in :data:`WRITE_PIECE` slices,
  waiting for the socket to drain after each one, so the client holds at most one slice
  besides the tensor. The commands, their order and the MULTI/EXEC around them are the
  pipeline's, unchanged: atomicity is the server's, as before.
* **Reads** (:func:`read_pieces`): a GET reply is parsed whole by hiredis into its own
  buffer and then copied into a ``bytes`` object (2x the entry at the peak). Large
  entries are read instead as GETRANGE pieces of :data:`READ_PIECE` bytes, pipelined on
  one connection (at most two windows of :data:`READ_WINDOW` pieces in flight), each piece copied into a preallocated tensor (pinned when the store's
  device is CUDA) as it arrives and dropped. The pieces are followed, on the same
  connection, by the store's write and layout versions: every write bumps one of them,
  so if both are still those of the snapshot the entry sizes were read in, no write came
  in between, and the pieces belong to that snapshot. Otherwise the caller reads again.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import AsyncIterator, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis.asyncio.connection
import redis.exceptions

from tdstore._backend import wire as _wire
from tdstore._backend.protocols import AsyncClient, AsyncPipeline, SyncClient
from tdstore._core.keys import StoreKeys
from tdstore._core.layout import Command

if TYPE_CHECKING:  # torch is imported where it is used: `tdstore ls` and `info` run without it
    import socket

    import torch

__all__ = ["READ_MIN", "READ_PIECE", "READ_WINDOW", "WRITE_MIN", "WRITE_PIECE", "streams", "streamed", "PieceRead", "read_pieces", "read_pieces_direct", "empty_buffer"]

#: Entries at least this large (bytes) are read in pieces (:func:`read_pieces`).
READ_MIN = 32 * 1024 * 1024
#: Bytes per GETRANGE piece: the client's peak is the entry plus about two windows. With the
#: buffer mapped ahead (:class:`_Mapper`), pieces of 2 MiB, 2 per window, read 64-256 MiB
#: entries as fast as or faster than 1 MiB x 4 and 2 MiB x 4 (same-run A/B, Redis and
#: Valkey, unix and TCP).
READ_PIECE = 2 * 1024 * 1024
#: GETRANGE commands sent at a time; two windows are in flight at most. The server runs a
#: client's pipelined commands back to back, so a window is also how long other clients
#: wait: 8 pieces of 4 MiB stalled them 29-42 ms, 2 pieces 4-7 ms, and the read did not
#: get slower (benchmarks/bench_read_stall.py); a window is 4 MiB.
READ_WINDOW = 2
#: ``memoryview`` arguments at least this large are written piece by piece (:func:`streamed`).
WRITE_MIN = 1024 * 1024
#: Bytes handed to the socket's transport at a time.
WRITE_PIECE = 4 * 1024 * 1024


def streams(client: object) -> bool:
    """Whether the client talks to a socket through redis-py's own connection classes."""
    pool = getattr(client, "connection_pool", None)
    cls = getattr(pool, "connection_class", None)
    return cls is not None and cls.__module__.startswith("redis.")


def empty_buffer(nbytes: int, device: torch.device | None) -> torch.Tensor:
    """A flat uint8 tensor to read ``nbytes`` into; pinned when ``device`` is CUDA (and CUDA works here)."""
    import torch

    pin = device is not None and device.type == "cuda" and torch.cuda.is_available()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


# --------------------------------------------------------------------------- #
# writes
# --------------------------------------------------------------------------- #


@contextlib.asynccontextmanager
async def streamed(pipe: AsyncPipeline, nbytes: int) -> AsyncIterator[None]:
    """While active, ``pipe`` sends its large memoryview arguments in slices (see module doc).

    ``nbytes``: the payload the pipeline carries; below :data:`WRITE_MIN` nothing changes.
    The pipeline keeps its connection (``pipe.connection``), and releases it as usual.
    """
    if nbytes < WRITE_MIN or not streams(pipe):
        yield
        return
    conn: redis.asyncio.connection.AbstractConnection | None = pipe.connection
    if conn is None:
        conn = await pipe.connection_pool.get_connection()
        # (redis-py types Pipeline.connection as its Connection class, though the pool's
        # connection_class may be any AbstractConnection, e.g. UnixDomainSocketConnection)
        pipe.connection = conn  # type: ignore[assignment]  # the pipeline's reset() gives it back to the pool
    if not _wire.streamed_sends(conn, WRITE_MIN, WRITE_PIECE):
        yield
        return
    try:
        yield
    finally:
        _wire.unstreamed(conn)


# --------------------------------------------------------------------------- #
# reads
# --------------------------------------------------------------------------- #


@dataclass
class PieceRead:
    """A read of large entries in GETRANGE pieces, checked against the snapshot it belongs to.

    ``entries``: ``(path, flat uint8 buffer, chunking)``, ``chunking`` the entry's
    :class:`~tdstore._core.chunks.Chunking` or None for one string. ``wv``, ``lv``: the write
    and layout versions (raw replies) of the snapshot the entry sizes come from.
    """

    keys: StoreKeys
    entries: Sequence[tuple[tuple[str, ...], torch.Tensor, Any]]
    wv: Any
    lv: Any

    def commands(self) -> tuple[list[Command], list[tuple[torch.Tensor, int, int]]]:
        """The GETRANGE of every piece, then the two versions; and where each piece goes."""
        keys = self.keys
        commands: list[Command] = []
        targets: list[tuple[torch.Tensor, int, int]] = []
        for path, buf, chunking in self.entries:
            size = buf.numel()
            if chunking is None:
                segments = [(keys.plain(path), 0, size)]
            else:
                segments = [(keys.chunk(path, k), k * chunking.size, chunking.length(k)) for k in range(chunking.count)]
            for key, base, length in segments:
                for offset in range(0, length, READ_PIECE):
                    end = min(offset + READ_PIECE, length)
                    commands.append(("GETRANGE", key, offset, end - 1))
                    targets.append((buf, base + offset, base + end))
        commands.append(("GET", keys.wv))
        commands.append(("HGET", keys.meta, "lv"))
        return commands, targets

    def schedule(self, commands: list[tuple[Any, ...]], pieces: int) -> Iterator[tuple[str, Any]]:
        """The order in which either driver sends and receives: ``("send", window of
        commands)``, then ``("piece", n)`` for the reply to piece ``n`` or ``("version", None)``
        for the two versions after the last piece. A window of pieces is in flight ahead of the
        one being received: the server never waits for the client, and never buffers more than
        two windows of replies the client has not taken yet."""
        windows = [commands[i : i + READ_WINDOW] for i in range(0, len(commands), READ_WINDOW)]
        yield "send", windows[0]
        n = 0
        for w in range(len(windows)):
            if w + 1 < len(windows):
                yield "send", windows[w + 1]
            for _ in windows[w]:
                yield ("piece", n) if n < pieces else ("version", None)
                n += 1

    def settled(self, complete: bool, versions: list[Any]) -> bool:
        """Whether every piece came back whole and both versions are still the snapshot's."""
        wv_now, lv_now = versions
        return complete and wv_now == self.wv and lv_now is not None and _same(lv_now, self.lv)


@dataclass
class _Send:
    """Effect of :func:`_pieces_op`: send these commands (one window). ``targets``: where
    every piece of the read goes (the blocking driver maps their pages ahead)."""

    commands: list[tuple[Any, ...]]
    targets: list[tuple[torch.Tensor, int, int]]


@dataclass
class _Receive:
    """Effect of :func:`_pieces_op`: receive the next reply. ``target`` (piece ``n``'s
    buffer, offset and end) when it is a piece whose bytes are wanted: the driver puts them
    there and answers True if the reply had exactly that size, False if not (short: the
    entry changed or is gone), or the error the server replied; None for a piece not wanted
    (one came back short before). Without a target (the two versions, and the pieces not
    wanted) the driver answers the reply itself, or the error the server replied."""

    n: int
    target: tuple[torch.Tensor, int, int] | None


#: What :func:`_pieces_op` ends with: whether the read settled, and the first error replied.
_PiecesOutcome = tuple[bool, BaseException | None]


def _pieces_op(read: PieceRead) -> Generator[_Send | _Receive, object, _PiecesOutcome]:
    """The read in pieces, once, for either driver: the windows of :meth:`PieceRead.schedule`,
    every reply received (so the connection stays usable), each piece's bytes put in its
    buffer, then :meth:`PieceRead.settled`. The drivers, :func:`read_pieces` (asyncio) and
    :func:`read_pieces_direct` (blocking socket, into the buffers with no copy), only send
    and receive."""
    commands, targets = read.commands()
    complete = True
    error: BaseException | None = None
    versions: list[object] = []
    for what, arg in read.schedule(commands, len(targets)):
        if what == "send":
            yield _Send(arg, targets)
            continue
        if what == "version":
            got = yield _Receive(-1, None)
            versions.append(got)
        else:
            got = yield _Receive(arg, targets[arg] if complete else None)
            if complete and got is not True:
                complete = False  # short (or gone, or refused): the entry changed
        if isinstance(got, BaseException):
            error = error or got  # read every reply before raising: the connection stays usable
    return read.settled(complete, versions), error


def _outcome(result: _PiecesOutcome) -> bool:
    settled, error = result
    if error is not None:
        raise error
    return settled


async def read_pieces(client: AsyncClient, read: PieceRead) -> bool:
    """Reads each entry of ``read`` into its buffer, in GETRANGE pieces (:func:`_pieces_op`
    on a connection of the asyncio pool).

    Returns True when the versions are unchanged after the last piece (the buffers then
    hold that snapshot's bytes), False when a write came in between or a piece came back
    short (the entry changed or is gone): the caller reads again.
    """
    import torch

    op = _pieces_op(read)
    pool = client.connection_pool
    conn = await pool.get_connection()
    clean = False
    try:
        answer: object = None
        while True:
            try:
                effect = op.send(answer)
            except StopIteration as stop:
                result: _PiecesOutcome = stop.value
                break
            if isinstance(effect, _Send):
                await conn.send_packed_command(conn.pack_commands(effect.commands))
                answer = None
                continue
            try:
                reply = await conn.read_response()
            except redis.exceptions.ResponseError as err:
                answer = err
                continue
            if effect.target is None:
                answer = reply
            else:
                buf, offset, end = effect.target
                answer = reply is not None and len(reply) == end - offset
                if answer:
                    buf[offset:end] = torch.frombuffer(reply, dtype=torch.uint8)
            del reply
        clean = True
    finally:
        if not clean:
            await conn.disconnect()  # replies may be left unread on it
        await pool.release(conn)
    return _outcome(result)


def read_pieces_direct(client: SyncClient, read: PieceRead) -> bool:
    """:func:`read_pieces` on a blocking ``redis.Redis``, from the calling thread, with no copy.

    The same operation (:func:`_pieces_op`); but the replies are parsed here, from the
    connection's socket, and each piece's bytes are received straight into its place in
    the buffer (``socket.recv_into``): one copy from the kernel, where ``read_pieces``
    makes hiredis's buffer, a ``bytes`` object and then the buffer (and no hop to the IO loop).
    """
    op = _pieces_op(read)
    views: dict[int, memoryview] = {}
    pool = client.connection_pool
    conn = pool.get_connection()
    clean = False
    ahead = None
    try:
        if _wire.socket_of(conn) is None:
            conn.connect()
        replies = _RawReplies(_wire.socket_of(conn))
        answer: object = None
        while True:
            try:
                effect = op.send(answer)
            except StopIteration as stop:
                result: _PiecesOutcome = stop.value
                break
            if isinstance(effect, _Send):
                replies.send(conn.pack_commands(effect.commands))
                if ahead is None:
                    ahead = _Mapper(effect.targets)  # maps the buffers' pages beside the receive
                answer = None
                continue
            if effect.n < 0:
                answer = replies.bulk()
                continue
            assert ahead is not None  # (made at the first send)
            ahead.ready(effect.n)
            if effect.target is None:
                answer = replies.bulk_into(None)
                if not isinstance(answer, BaseException):
                    answer = None
                continue
            buf, offset, end = effect.target
            view = views.get(id(buf))
            if view is None:
                view = views[id(buf)] = buf.numpy().data
            answer = replies.bulk_into(view[offset:end])
        clean = True
    except TimeoutError:
        raise redis.exceptions.TimeoutError("Timeout reading from socket") from None
    except OSError as err:
        raise redis.exceptions.ConnectionError(f"error while reading a large entry: {err}") from err
    finally:
        if ahead is not None:
            ahead.stop()
        if not clean:
            conn.disconnect()  # replies may be left unread on it
        pool.release(conn)
    return _outcome(result)


class _Mapper:
    """Maps a new buffer's pages ahead of the socket: a helper thread writes zeros over each
    piece's bytes, in the order the pieces are received, while the calling thread receives
    the ones before.

    Fresh memory is mapped on first write, one page fault per 4 KiB. A 64 MiB read takes
    21-24 ms into a buffer already mapped and 50-96 ms into a fresh one (Valkey, unix). Taken
    inside ``recv_into`` (the kernel's copy, while the server waits for the socket to drain),
    the faults cost the most; taken first in one ``zero_()``, they still add up before the
    first byte is read; taken here, beside the receive, the read took 0.32-0.36x raw
    ``GET``'s time, against 0.38-0.56x for zeroing first and 0.40-0.59x for neither
    (same-run A/B, 2 MiB pieces, Redis and Valkey, unix, 64 and 256 MiB; over TCP 0.30x
    against 0.39x and 0.32x).

    A piece the helper has not reached when its bytes are due is taken from it (received
    with its faults); the helper never writes a piece the receiving thread has started.
    The zeros are written with ``memset`` (no torch thread pool in the helper; the GIL is
    released). Pinned memory is mapped already and is left out (it exists only once CUDA
    is initialized).
    """

    def __init__(self, targets: Sequence[tuple[torch.Tensor, int, int]]) -> None:
        import threading

        import torch

        buffers = {id(buf): buf for buf, _, _ in targets}
        pinned = {key for key, buf in buffers.items() if buf.is_pinned()} if torch.cuda.is_initialized() else set()
        #: (address, length) of each piece, None for a piece of pinned memory
        self.spans = [
            None if id(buf) in pinned else (buf.data_ptr() + offset, end - offset) for buf, offset, end in targets
        ]
        self.lock = threading.Lock()
        self.next = 0  #: the first piece neither side has taken yet
        self.done = [threading.Event() for _ in targets]
        self.thread: threading.Thread | None = None
        if any(span is not None for span in self.spans):  # (else nothing to map: the reader takes every piece)
            thread = threading.Thread(target=self._run, name="tdstore-map-ahead", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # no new thread (e.g. at interpreter shutdown): the reader takes every piece
                return
            self.thread = thread

    def _run(self) -> None:
        while True:
            with self.lock:
                i = self.next
                if i >= len(self.spans):
                    return
                self.next = i + 1
            try:
                span = self.spans[i]
                if span is not None:
                    ctypes.memset(span[0], 0, span[1])
            finally:
                self.done[i].set()

    def ready(self, i: int) -> None:
        """Before piece ``i`` is received: waits for the helper if it took it, else takes it."""
        with self.lock:
            if self.next <= i:
                self.next = i + 1
                return
        self.done[i].wait()

    def stop(self) -> None:
        with self.lock:
            self.next = len(self.spans)
        if self.thread is not None:
            self.thread.join()


class _RawReplies:
    """The RESP replies of one blocking connection, read from its socket (bulk strings,
    nulls and errors: what GETRANGE, GET and HGET answer)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.pos = 0

    def send(self, packed: list[bytes]) -> None:
        for piece in packed:
            self.sock.sendall(piece)

    def _line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n", self.pos)
            if end >= 0:
                line = bytes(self.buf[self.pos : end])
                self.pos = end + 2
                return line
            self._fill()

    def _fill(self) -> None:
        if self.pos:
            del self.buf[: self.pos]
            self.pos = 0
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buf += data

    def _into(self, view: memoryview) -> None:
        """Fills ``view``: first from what is buffered, then straight from the socket."""
        have = min(len(view), len(self.buf) - self.pos)
        view[:have] = self.buf[self.pos : self.pos + have]
        self.pos += have
        while have < len(view):
            got = self.sock.recv_into(view[have:])
            if not got:
                raise ConnectionError("the server closed the connection")
            have += got

    def _header(self) -> int | BaseException | None:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            size = int(rest)
            return None if size < 0 else size
        if kind == b"_":
            return None  # RESP3 null
        if kind == b"-":
            return redis.exceptions.ResponseError(rest.decode(errors="replace"))
        raise redis.exceptions.InvalidResponse(f"unexpected reply {line[:40]!r} to a GETRANGE")

    def bulk(self) -> bytes | BaseException | None:
        size = self._header()
        if not isinstance(size, int):
            return size
        out = bytearray(size + 2)
        self._into(memoryview(out))
        return bytes(out[:size])

    def bulk_into(self, view: memoryview | None) -> bool | BaseException | None:
        """Receives a bulk reply into ``view`` if it has exactly its size (True); else reads
        it past (False; None for a null reply)."""
        size = self._header()
        if not isinstance(size, int):
            return size
        if view is not None and size == len(view):
            self._into(view)
            self._into(memoryview(bytearray(2)))
            return True
        scratch = memoryview(bytearray(min(size + 2, READ_PIECE + 2)))
        left = size + 2
        while left:
            step = min(left, len(scratch))
            self._into(scratch[:step])
            left -= step
        return False


def _same(a: Any, b: Any) -> bool:
    def norm(x: Any) -> bytes:
        return x if isinstance(x, bytes) else str(x).encode()

    return norm(a) == norm(b)
