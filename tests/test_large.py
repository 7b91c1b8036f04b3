"""Large entries (issue 6, item 3): streamed writes, reads in pieces into a preallocated tensor.

The piece sizes of :mod:`tdstore._backend.large` are lowered in most tests (``small_pieces``) so that
small entries take the large-entry paths; two tests use the real sizes and check the
client's peak memory in a fresh process. Reads in pieces must keep the snapshot guarantee:
a write between the snapshot and the last piece makes the read start again, and a
concurrent writer never produces a torn read (violation count 0).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest
import torch

from tdstore import TensorDictStore
from tdstore._backend import large as _large
from tdstore._backend import ops as _backend
from tdstore._core.codec import DTYPE_BY_NAME
from tdstore.testing.counts import record


@pytest.fixture
def small_pieces(monkeypatch):
    """Entries of 100 bytes and more take the large-entry paths, in pieces of 48 / 40 bytes, 3 in a window."""
    monkeypatch.setattr(_large, "READ_MIN", 100)
    monkeypatch.setattr(_large, "READ_PIECE", 48)
    monkeypatch.setattr(_large, "READ_WINDOW", 3)
    monkeypatch.setattr(_large, "WRITE_MIN", 100)
    monkeypatch.setattr(_large, "WRITE_PIECE", 40)


def _count_calls(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    async def wrapper(*args, **kwargs):
        calls.append(1)
        return await real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def _count_piece_reads(monkeypatch):
    """Counts reads in pieces, on the IO loop (``"loop"``) and on the direct client (``"direct"``)."""
    calls: list[str] = []
    real_loop, real_direct = _large.read_pieces, _large.read_pieces_direct

    async def on_loop(*args, **kwargs):
        calls.append("loop")
        return await real_loop(*args, **kwargs)

    def direct(*args, **kwargs):
        calls.append("direct")
        return real_direct(*args, **kwargs)

    monkeypatch.setattr(_large, "read_pieces", on_loop)
    monkeypatch.setattr(_large, "read_pieces_direct", direct)
    return calls


@pytest.mark.parametrize("dtype", ["float32", "uint8", "int64", "bool", "bfloat16", "complex64"])
def test_round_trip_in_pieces(server, stores, small_pieces, monkeypatch, dtype):
    gen = torch.Generator().manual_seed(1)
    torch_dtype = DTYPE_BY_NAME[dtype]
    value = (torch.randn(8, 33, generator=gen) * 50).to(torch_dtype)
    if torch_dtype == torch.bool:
        value = torch.randint(0, 2, (8, 33), generator=gen).bool()
    reads = _count_piece_reads(monkeypatch)
    store = stores(server, batch_size=[8])
    store["x"] = value  # new entry: commit (SET of a tmp key) streamed
    store["small"] = torch.arange(3 * 8).reshape(8, 3)  # under READ_MIN: read whole
    store["nested", "y"] = value[:, :5].clone()
    assert torch.equal(store["x"], value)
    store["x"] = value.flip(0)  # same shape: SETRANGE in place, streamed
    got = store["x"]
    assert got.dtype == torch_dtype and torch.equal(got, value.flip(0))
    local = store.to_tensordict()
    assert torch.equal(local["x"], value.flip(0)) and torch.equal(local["small"], store["small"])
    assert torch.equal(local["nested", "y"], value[:, :5])
    # the connection used for a streamed write goes back to the pool as an ordinary one
    store["z"] = torch.zeros(8, 100)
    assert torch.equal(store["z"], torch.zeros(8, 100))
    if server.kind == "fakeredis":
        assert reads == []  # an in-process server: the ordinary read
    else:
        assert len(reads) >= 3 and set(reads) == {"direct"}  # received straight into the tensors
    raw = server.sync_client()
    assert raw.get(f"{store._conn.keys.data(('x',))}") == value.flip(0).contiguous().view(torch.uint8).numpy().tobytes()


def test_write_between_snapshot_and_pieces_reads_again(real_server, stores, small_pieces, monkeypatch):
    """A write that lands after the snapshot but before the pieces: the read starts again."""
    store = stores(real_server, batch_size=[4])
    first = torch.full((4, 64), 1.0)
    second = torch.full((4, 64), 2.0)
    store["x"] = first
    keys = store._conn.keys
    raw = real_server.sync_client()
    real_loop, real_direct = _large.read_pieces, _large.read_pieces_direct
    tries = []

    def race():
        tries.append(1)
        if len(tries) == 1:
            # the effect of a concurrent writer: new bytes and a new write version
            raw.set(keys.data(("x",)), second.numpy().tobytes())
            raw.incr(keys.wv)

    async def racing(client, read):
        race()
        return await real_loop(client, read)

    def racing_direct(client, read):
        race()
        return real_direct(client, read)

    monkeypatch.setattr(_large, "read_pieces", racing)
    monkeypatch.setattr(_large, "read_pieces_direct", racing_direct)
    got = store["x"]
    assert len(tries) == 2
    assert torch.equal(got, second)
    tries.clear()
    raw.set(keys.data(("x",)), first.numpy().tobytes())
    raw.incr(keys.wv)
    assert torch.equal(store.to_tensordict()["x"], second)  # the same for a whole-store read
    assert len(tries) == 2


def test_pieces_never_torn_under_writer(real_server, request, small_pieces):
    """Readers in pieces while another process rewrites the entry: every read is one write's value."""
    kwargs = real_server.connection_kwargs()
    store = TensorDictStore(batch_size=[16], **kwargs)
    try:
        store["x"] = torch.zeros(16, 64)
        ctx = mp.get_context("spawn")
        stop, ready = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_writer, args=(kwargs, store.td_id, stop, ready), daemon=True)
        proc.start()
        reads = torn = 0
        try:
            assert ready.wait(60), "the writer process did not start"
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline and reads < 3000:
                value = store["x"] if reads % 2 else store.to_tensordict()["x"]
                reads += 1
                if not bool((value == value.reshape(-1)[0]).all()):
                    torn += 1
        finally:
            stop.set()
            proc.join(20)
        writes = int(float(store["x"].reshape(-1)[0]))
        record(request, reads=reads, writes=writes, torn=torn)
        assert proc.exitcode == 0
        assert reads > 20 and writes > 20
        assert torn == 0
    finally:
        store.clear_redis()
        store.close()


def _writer(kwargs, td_id, stop, ready):
    from tdstore._backend import large

    large.READ_MIN, large.READ_PIECE, large.READ_WINDOW, large.WRITE_MIN, large.WRITE_PIECE = 100, 48, 3, 100, 40
    store = TensorDictStore.from_store(td_id=td_id, **kwargs)
    deadline = time.monotonic() + 30
    i = 0
    while not stop.is_set() and time.monotonic() < deadline and i < 100_000:
        i += 1
        store["x"] = torch.full((16, 64), float(i))
        ready.set()
    store.close()


def test_shape_change_after_layout_cached_reads_whole(real_server, stores, small_pieces):
    """The cached layout says one size, the server another: the read falls back, and is right."""
    store = stores(real_server, batch_size=[4])
    store["x"] = torch.ones(4, 64)
    other = TensorDictStore.from_store(td_id=store.td_id, **real_server.connection_kwargs())
    try:
        other["x"] = torch.full((4, 80), 3.0)  # new shape: the first handle's cache is stale
    finally:
        other.close()
    assert torch.equal(store["x"], torch.full((4, 80), 3.0))
    assert torch.equal(store.to_tensordict()["x"], torch.full((4, 80), 3.0))


def test_missing_bytes_still_data_lost(real_server, stores, small_pieces):
    """Bytes deleted by hand (as if evicted): DataLostError naming the entry, not a short tensor."""
    from tdstore.errors import DataLostError

    store = stores(real_server, batch_size=[4])
    store["x"] = torch.ones(4, 64)
    real_server.sync_client().delete(store._conn.keys.data(("x",)))
    with pytest.raises(DataLostError, match="'x'"):
        store["x"]


def test_bad_write_leaves_entry_and_connection_usable(real_server, stores, small_pieces):
    """A value refused before sending leaves the stored entry unchanged; streaming left nothing behind."""
    store = stores(real_server, batch_size=[4])
    store["x"] = torch.ones(4, 64)
    with pytest.raises(RuntimeError, match="batch dimension mismatch"):
        store["y"] = torch.ones(5, 64)
    with pytest.raises(TypeError, match="'x'"):
        store["x"] = torch.ones(4, 64).to_sparse()
    assert torch.equal(store["x"], torch.ones(4, 64))
    assert "y" not in store.keys()
    conns = list(store._conn._client.connection_pool._available_connections)
    assert conns and all("send_packed_command" not in vars(c) for c in conns)


def test_streamed_send_with_and_without_timeout(real_server, small_pieces):
    """The streamed send works with socket_timeout set (tdstore's default) and unset."""
    import asyncio

    import redis.asyncio

    path = real_server.unix_socket_path
    payload = torch.arange(1000, dtype=torch.int32)
    view = memoryview(payload.numpy()).cast("B")

    async def go(timeout):
        client = redis.asyncio.Redis(unix_socket_path=path, socket_timeout=timeout)
        try:
            async with client.pipeline(transaction=True) as pipe:
                pipe.set("tdstore-test:large:raw", view)
                pipe.strlen("tdstore-test:large:raw")
                async with _large.streamed(pipe, view.nbytes):
                    assert "send_packed_command" in vars(pipe.connection)
                    replies = await pipe.execute()
            back = await client.get("tdstore-test:large:raw")
            await client.delete("tdstore-test:large:raw")
            conns = list(client.connection_pool._available_connections)
            return replies, back, conns
        finally:
            await client.aclose()

    for timeout in (5.0, None):
        replies, back, conns = asyncio.run(go(timeout))
        assert replies == [True, 4000]
        assert back == view.tobytes()
        assert all("send_packed_command" not in vars(c) for c in conns)


def test_pinned_buffer_only_with_cuda():
    buf = _large.empty_buffer(64, torch.device("cpu"))
    assert buf.dtype == torch.uint8 and buf.numel() == 64 and not buf.is_pinned()
    cuda = _large.empty_buffer(64, torch.device("cuda"))
    assert cuda.is_pinned() == torch.cuda.is_available()


_CHILD = r"""
import json, sys, torch
from tdstore import TensorDictStore

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

spec = json.loads(sys.argv[1])
torch.set_num_threads(1)
store = TensorDictStore.from_store(td_id=spec["td_id"], **spec["kwargs"])
store.keys()
if spec["op"] == "write":
    value = torch.full(spec["shape"], 7.0)
    base = hwm()
    store["x"] = value
else:
    base = hwm()
    value = store["x"] if spec["op"] == "read" else store.to_tensordict()["x"]
peak = hwm()  # before the check below, which allocates a bool tensor
assert value.shape == tuple(spec["shape"]) and bool((value == 7.0).all())
print(json.dumps({"extra": peak - base}))
"""


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_peak_memory_of_a_64mib_entry(real_server, stores, transport):
    """With the real piece sizes: a 64 MiB entry is written with < 0.5x and read with < 1.5x extra memory."""
    shape = [16, 1024 * 1024]  # 64 MiB of float32
    nbytes = 16 * 1024 * 1024 * 4
    store = stores(real_server, batch_size=[16])
    store["x"] = torch.full(shape, 7.0)
    kwargs = real_server.connection_kwargs(unix=transport == "unix")
    results = {}
    for op in ("write", "read", "to_tensordict"):
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps({"td_id": store.td_id, "kwargs": kwargs, "shape": shape, "op": op})],
            capture_output=True, text=True, timeout=100, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert out.returncode == 0, out.stderr[-2000:]
        results[op] = json.loads(out.stdout.strip().splitlines()[-1])["extra"] / nbytes
    print(results)
    assert results["write"] < 0.5, results
    assert results["read"] < 1.5 and results["to_tensordict"] < 1.5, results
    assert torch.equal(store["x"], torch.full(shape, 7.0))


@pytest.mark.parametrize("protocol", [2, 3])
def test_raw_reply_reader(real_server, protocol):
    """The direct reader's RESP parsing: bulk strings received into a view (exact size only),
    nulls, errors and empty strings, on RESP2 and RESP3; the connection stays in step."""
    import redis

    kw = real_server.connection_kwargs()
    client = redis.Redis(**{k: v for k, v in kw.items() if k in ("host", "port", "unix_socket_path")}, protocol=protocol)
    try:
        client.set("tdstore-test:raw", bytes(range(256)) * 4)
        client.hset("tdstore-test:hash", "f", "v")
        conn = client.connection_pool.get_connection()
        try:
            if conn._sock is None:
                conn.connect()
            replies = _large._RawReplies(conn._sock)
            replies.send(conn.pack_commands([
                ("GETRANGE", "tdstore-test:raw", 0, 1023),
                ("GETRANGE", "tdstore-test:raw", 10, 19),
                ("GET", "tdstore-test:missing"),
                ("GETRANGE", "tdstore-test:hash", 0, 3),
                ("GETRANGE", "tdstore-test:raw", 5000, 6000),
                ("GET", "tdstore-test:raw"),
            ]))
            whole = bytearray(1024)
            assert replies.bulk_into(memoryview(whole)) is True and bytes(whole) == bytes(range(256)) * 4
            assert replies.bulk_into(memoryview(bytearray(11))) is False  # 10 bytes: not the size asked
            assert replies.bulk() is None
            err = replies.bulk_into(memoryview(bytearray(4)))
            assert isinstance(err, redis.exceptions.ResponseError) and "WRONGTYPE" in str(err)
            assert replies.bulk() == b""
            assert replies.bulk() == bytes(range(256)) * 4
            client.connection_pool.release(conn)
            conn = None
            assert client.ping()  # nothing was left unread on the connection
        finally:
            if conn is not None:
                client.connection_pool.release(conn)
    finally:
        client.delete("tdstore-test:raw", "tdstore-test:hash")
        client.close()


def test_direct_piece_read_of_a_shrunk_entry_reads_again(real_server, stores, small_pieces, monkeypatch):
    """An entry that shrinks between the snapshot and its pieces: the direct reader reads
    the short replies past, and the read starts again (and is right)."""
    store = stores(real_server, batch_size=[4])
    store["x"] = torch.arange(4 * 64, dtype=torch.float32).reshape(4, 64)
    raw = real_server.sync_client()
    keys = store._conn.keys
    real_direct = _large.read_pieces_direct
    results = []

    def shrinking(client, read):
        if not results:
            raw.setrange(keys.data(("x",)), 0, b"")  # no-op write, then cut the string short
            raw.set(keys.data(("x",)), b"\0" * 100)
        got = real_direct(client, read)
        results.append(got)
        if len(results) == 1:
            raw.set(keys.data(("x",)), torch.full((4, 64), 5.0).numpy().tobytes())
        return got

    monkeypatch.setattr(_large, "read_pieces_direct", shrinking)
    assert torch.equal(store["x"], torch.full((4, 64), 5.0))
    assert results[0] is False
    assert store._conn.direct_client().ping()


def test_thresholds_are_sane():
    assert _large.READ_PIECE < _large.READ_MIN
    assert _large.WRITE_PIECE >= _large.WRITE_MIN
    assert _backend._LARGE_TRIES >= 1


def test_tls_large_round_trip(tls_server, small_pieces):
    """Over TLS (an SSL transport under the streamed writes and the pieces), a large entry round-trips."""
    store = TensorDictStore(batch_size=[4], **tls_server.connection_kwargs())
    try:
        assert store._conn._connection_class.__name__ == "SSLConnection"
        value = torch.randn(4, 3000)  # 48 KB: 1200 write slices, 1000 read pieces
        store["x"] = value
        store["x"] = value * 2  # in place
        assert torch.equal(store["x"], value * 2)
        assert torch.equal(store.to_tensordict()["x"], value * 2)
    finally:
        store.clear_redis()
        store.close()


@pytest.mark.parametrize("seed", range(5))
def test_mapper_never_writes_a_piece_the_reader_took(seed):
    """The helper that maps the buffer ahead of the socket zeroes only pieces the reader has
    not reached: every piece written after ``ready(i)`` keeps its bytes, whichever side took
    it, while the two race (random pauses on the reader's side)."""
    import random

    rng = random.Random(seed)
    size, n = 64 * 1024, 256
    buf = torch.full((size * n,), 0xEE, dtype=torch.uint8)
    targets = [(buf, i * size, (i + 1) * size) for i in range(n)]
    mapper = _large._Mapper(targets)
    try:
        for i in range(n):
            mapper.ready(i)
            buf[i * size : (i + 1) * size] = i % 251  # "received"
            if rng.random() < 0.05:
                time.sleep(rng.random() / 1000)  # (mostly the reader runs ahead of the helper)
    finally:
        mapper.stop()
    assert not mapper.thread.is_alive()
    expected = (torch.arange(n) % 251).to(torch.uint8).repeat_interleave(size)
    assert torch.equal(buf, expected)
    assert mapper.next == n


def test_mapper_with_a_slow_helper_waits_for_its_piece(monkeypatch):
    """A helper slower than the socket (each piece's zeros take 2 ms): the reader waits for
    the piece the helper is writing before it receives into it, and no piece received
    loses its bytes."""
    import ctypes
    import types

    def slow_memset(address: int, value: int, length: int) -> None:
        time.sleep(0.002)
        ctypes.memset(address, value, length)

    monkeypatch.setattr(_large, "ctypes", types.SimpleNamespace(memset=slow_memset))
    size, n = 4096, 50
    buf = torch.full((size * n,), 0xEE, dtype=torch.uint8)
    mapper = _large._Mapper([(buf, i * size, (i + 1) * size) for i in range(n)])
    try:
        for i in range(n):
            mapper.ready(i)
            buf[i * size : (i + 1) * size] = i + 1
    finally:
        mapper.stop()
    assert torch.equal(buf, torch.arange(1, n + 1, dtype=torch.uint8).repeat_interleave(size))


def test_mapper_without_a_thread_leaves_every_piece_to_the_reader(monkeypatch):
    """Where no thread can start (at interpreter shutdown, say), the read goes on without
    the helper: the reader takes every piece, and none waits."""
    import threading

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    size, n = 1024, 8
    buf = torch.full((size * n,), 0xEE, dtype=torch.uint8)
    mapper = _large._Mapper([(buf, i * size, (i + 1) * size) for i in range(n)])
    assert mapper.thread is None
    for i in range(n):
        mapper.ready(i)  # (would wait for ever on a piece no helper took)
        buf[i * size : (i + 1) * size] = i
    mapper.stop()
    assert mapper.next == n and not any(event.is_set() for event in mapper.done)
    assert torch.equal(buf, torch.arange(n, dtype=torch.uint8).repeat_interleave(size))


def test_both_drivers_of_a_large_read_follow_one_schedule(monkeypatch):
    """``PieceRead.schedule``: the one order of sends and receives that the asyncio and the
    blocking reads of large entries follow (a window in flight ahead of the one received)."""
    from tdstore._backend import large as _large_mod

    monkeypatch.setattr(_large_mod, "READ_WINDOW", 2)
    read = _large_mod.PieceRead(keys=None, entries=[], wv=b"1", lv=b"1")  # type: ignore[arg-type]
    commands = [("GETRANGE", "k", 0, 9), ("GETRANGE", "k", 10, 19), ("GETRANGE", "k", 20, 29), ("GET", "wv"), ("HGET", "m", "lv")]
    got = [(what, arg if what != "send" else len(arg)) for what, arg in read.schedule(commands, 3)]
    assert got == [
        ("send", 2), ("send", 2), ("piece", 0), ("piece", 1), ("send", 1), ("piece", 2), ("version", None),
        ("version", None),
    ]


def test_a_large_read_is_one_operation_that_both_drivers_run():
    """Issue 25, item 1: the read in pieces is written once (``_pieces_op``: its commands,
    its schedule, where each piece goes and the settle check); ``read_pieces`` and
    ``read_pieces_direct`` only send and receive."""
    import ast
    import inspect

    def names(fn):
        return {n.attr for n in ast.walk(ast.parse(inspect.getsource(fn))) if isinstance(n, ast.Attribute)}

    plan = {"schedule", "settled"}
    assert plan <= names(_large._pieces_op) and "read.commands()" in inspect.getsource(_large._pieces_op)
    for driver in (_large.read_pieces, _large.read_pieces_direct):
        source = inspect.getsource(driver)
        assert not plan & names(driver) and "read.commands()" not in source, f"{driver.__name__} plans the read itself"
        assert "_pieces_op(read)" in source


def test_the_large_read_operation_settles_only_whole_unchanged_pieces():
    """``_pieces_op`` driven by hand: a piece of the wrong size, a refused reply and a moved
    version each stop the read from settling; a refused reply is raised after every reply
    was taken."""
    import redis.exceptions

    def drive(answers, versions):
        buf = torch.zeros(20, dtype=torch.uint8)
        read = _large.PieceRead(keys=_FakeKeys(), entries=[(("x",), buf, None)], wv=b"1", lv=b"1")
        op = _large._pieces_op(read)
        answer, pieces = None, iter(answers)
        taken = 0
        try:
            while True:
                effect = op.send(answer)
                if isinstance(effect, _large._Send):
                    answer = None
                elif effect.n < 0:
                    answer, taken = versions[taken - len(answers)], taken + 1
                else:
                    answer, taken = next(pieces), taken + 1
        except StopIteration as stop:
            return stop.value, taken

    monkey = _large.READ_PIECE
    try:
        _large.READ_PIECE = 10
        assert drive([True, True], [b"1", b"1"]) == ((True, None), 4)
        assert drive([True, False], [b"1", b"1"])[0] == (False, None)  # short
        assert drive([True, True], [b"2", b"1"])[0] == (False, None)  # a write came in between
        err = redis.exceptions.ResponseError("WRONGTYPE")
        (settled, error), taken = drive([err, None], [b"1", b"1"])
        assert (settled, error, taken) == (False, err, 4)  # (every reply taken before raising)
    finally:
        _large.READ_PIECE = monkey


class _FakeKeys:
    def plain(self, path):
        return "k:" + "/".join(path)

    wv, meta = "wv", "meta"
