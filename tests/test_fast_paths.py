"""The indexed hot paths keep every guarantee: direct reads (a blocking client, no IO-loop hop)
and armed row writes (a connection left WATCHing the store between writes, one round trip),
sent by either driver: the direct client's from the calling thread, or the IO loop's.

See tdstore/_backend/connection.py (``Connection.read``) and tdstore/_backend/armed_write.py.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest
import torch
from tensordict import TensorDict

import tdstore
from tdstore import TensorDictStore
from tdstore._core.indexing import RowSpans, contiguous_rows, select_rows
from tdstore.server import start_server
from tdstore.testing.counts import record

ROW = (32, 32)  # 4096 bytes of float32 per row: runs large enough for the armed (SETRANGE) path


@pytest.fixture(params=["direct", "loop"])
def driver(request, monkeypatch):
    """Which client sends armed writes: "loop" takes the direct client away (as for TLS)."""
    if request.param == "loop":
        monkeypatch.setattr(tdstore._backend.connection.Connection, "direct_client", lambda self: None)
    return request.param


def _is_connected(connection):
    """``is_connected`` of an asyncio connection (a blocking one has it from redis-py 7 on)."""
    from tdstore._backend import wire

    return connection.is_connected if hasattr(connection, "is_connected") else wire.connected(connection)


def _slot(store, driver):
    return store._conn.direct_slot if driver == "direct" else store._conn.armed_slot


def _big(server, n: int = 64, **kw):
    store = TensorDictStore(batch_size=[n], **server.connection_kwargs(), **kw)
    store["x"] = torch.arange(n * 32 * 32, dtype=torch.float32).reshape(n, *ROW)
    return store


# --------------------------------------------------------------------------- pure index math
@pytest.mark.parametrize("shape", [(10,), (10, 3), (4, 2, 5), (1,), (0,), (3, 0)])
def test_contiguous_rows_matches_select_rows(shape):
    """The int / step-1 slice fast path gives the same rows and shape as torch's indexing."""
    indices = [0, 1, -1, 3, -4, 9, -10, slice(None), slice(2, 5), slice(-3, None), slice(5, 2), slice(None, None, 1),
               slice(1, 100), slice(-100, 2), slice(2, 4, 2), True, torch.tensor(1), (1, 0), Ellipsis]
    checked = 0
    for index in indices:
        got = contiguous_rows(index, shape)
        try:
            rows = select_rows(index, torch.Size(shape))
        except (IndexError, TypeError, ValueError):
            assert got is None, f"{index!r} on {shape}: fast path accepted an index torch refuses"
            continue
        if got is None:
            continue
        first, count, out_shape = got
        assert tuple(rows.shape) == out_shape, (index, shape)
        assert rows.reshape(-1).tolist() == list(range(first, first + count)), (index, shape)
        spans = RowSpans.block(first, count)
        assert spans.runs(8) == RowSpans(rows).runs(8)
        checked += 1
    assert checked >= 5 or 0 in shape


def test_packed_commands_match_redis_py_and_keep_large_buffers_uncopied():
    """The direct driver's RESP encoding is byte for byte redis-py's; large buffers travel as themselves."""
    import random

    import redis.connection

    from tdstore._backend.wire import ZERO_COPY_MIN as _ZERO_COPY_MIN
    from tdstore._backend.wire import packed as _packed

    encoder = redis.connection.Encoder("utf-8", "strict", False)
    packer = redis.connection.PythonRespSerializer(6000, encoder.encode)
    rng = random.Random(3)
    payload = memoryview(torch.randint(0, 256, (3 * _ZERO_COPY_MIN,), dtype=torch.uint8).numpy()).cast("B")
    for _ in range(200):
        commands = [("MULTI",), ("INCR", "p:{id}:wv")]
        for _ in range(rng.randint(0, 5)):
            lo = rng.randrange(len(payload))
            view = payload[lo : rng.randint(lo, len(payload))]
            commands.append(("SETRANGE", f"p:{{id}}:d:k{rng.randrange(9)}", rng.randrange(2**40), view))
        commands += [("PEXPIREAT", "p:{id}:wv", rng.randrange(2**45)), ("EXEC",), ("WATCH", "p:{id}:m", "k\u00e9y")]
        pieces = _packed(commands)
        assert b"".join(bytes(p) for p in pieces) == b"".join(bytes(p) for c in commands for p in packer.pack(*c))
        big = [c[3] for c in commands if c[0] == "SETRANGE" and c[3].nbytes >= _ZERO_COPY_MIN]
        sent = [p for p in pieces if isinstance(p, memoryview)]
        assert len(sent) == len(big) and all(a is b for a, b in zip(sent, big, strict=True))  # the tensor's own memory, not copies


@pytest.mark.parametrize("batch", [512, 3])
def test_gathered_send_delivers_every_byte_in_order_through_partial_sends(batch, monkeypatch):
    """One ``sendmsg`` per batch of pieces: a socket that takes part of the data (small
    buffer, a timeout, a slow reader) still gets every byte, in order, once."""
    import random
    import socket

    from tdstore._backend import wire

    monkeypatch.setattr(wire, "_IOV_BATCH", batch)
    rng = random.Random(5)
    pieces: list = []
    for _ in range(40):
        size = rng.choice([0, 1, 7, 1000, 70_000, 300_000])
        data = bytes(rng.getrandbits(8) for _ in range(min(size, 64))) * (size // 64 + 1)
        pieces.append(memoryview(data[:size]) if rng.random() < 0.5 else data[:size])
    want = b"".join(bytes(p) for p in pieces)
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    a.settimeout(30)  # (a socket with a timeout may send part of a sendmsg)
    got = bytearray()

    def reader() -> None:
        while len(got) < len(want):
            chunk = b.recv(rng.choice([1, 500, 65536]))
            if not chunk:
                return
            got.extend(chunk)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        wire._send_gathered(a, pieces)
        thread.join(60)
    finally:
        a.close()
        b.close()
    assert not thread.is_alive()
    assert bytes(got) == want


def test_direct_send_never_reconnects(real_server):
    """A connection closed under an armed write (say, by close() in another thread) fails the
    write: redis-py would reconnect it and send the MULTI without the WATCH."""
    import redis

    from tdstore._backend.wire import exchange_sync as _exchange_sync

    client = real_server.sync_client()
    key = "tdstest:{nore}:k"
    client.delete(key)
    conn = client.connection_pool.get_connection()
    try:
        conn.disconnect()
        with pytest.raises(redis.exceptions.ConnectionError):
            _exchange_sync(conn, [("SET", key, "v")])
        assert conn._sock is None  # not reconnected
    finally:
        client.connection_pool.release(conn)
    assert client.exists(key) == 0


# --------------------------------------------------------------------------- direct reads
def test_direct_reads_match_the_io_loop_path(real_server):
    store = _big(real_server)
    store["y"] = torch.arange(64)
    store["n", "z"] = torch.ones(64, 3)
    local = store.to_tensordict()
    for index in (0, 5, -1, slice(3, 9), slice(60, 100), torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])):
        got = store[index]
        want = local[index]
        assert got.batch_size == want.batch_size
        assert (got == want).all(), index
        assert store.get_at("x", index).shape == want["x"].shape
    assert store._conn.direct_client() is not None  # the fast path was in use
    store.clear_redis()
    store.close()


def test_direct_read_sees_other_clients_layout_changes(real_server):
    """A one-row read never decodes bytes with stale metadata: the version comes back with them."""
    store = _big(real_server)
    assert store[1]["x"].shape == ROW
    other = TensorDictStore.from_store(td_id=store.td_id, **real_server.connection_kwargs())
    other["x"] = torch.full((64, 2), 7, dtype=torch.int16)  # new shape and dtype
    got = store[1]["x"]
    assert got.dtype == torch.int16 and torch.equal(got, torch.full((2,), 7, dtype=torch.int16))
    other.close()
    store.clear_redis()
    store.close()


def test_direct_read_after_script_flush_and_closed_store(real_server):
    store = _big(real_server)
    want = store[3]["x"].clone()
    real_server.sync_client().script_flush()
    assert torch.equal(store[3]["x"], want)  # NOSCRIPT: read again through the IO loop, which reloads
    assert torch.equal(store[3]["x"], want)
    store.close()
    with pytest.raises(tdstore.StoreClosedError):
        store[3]
    again = TensorDictStore.from_store(td_id=store.td_id, **real_server.connection_kwargs())
    again.clear_redis()
    again.close()


@pytest.mark.usefixtures("unchunked")  # the one-string layout
def test_direct_read_of_a_deleted_store_and_lost_bytes(real_server, wire):
    store = _big(real_server)
    store[0]
    real_server.sync_client().delete(f"tensordict:{{{store.td_id}}}:d:x")
    before = wire(real_server)
    for read in (lambda: store[2], lambda: store[2:4]):
        with pytest.raises(tdstore.DataLostError, match="gone from the server"):
            read()
    assert wire(real_server) == before
    store.clear_redis()
    with pytest.raises(tdstore.StoreNotFoundError):
        store[2]
    store.close()


def test_direct_reads_keep_one_connection_and_drop_it_when_killed(real_server):
    """Direct reads reuse the connection kept after the last one (no pool checkout); one the
    server closed meanwhile is dropped before anything is sent on it, and the read goes on
    a fresh one."""
    from tdstore._backend.blocking import _SPARE

    store = TensorDictStore.from_tensordict(TensorDict(x=torch.arange(40.0).reshape(10, 4), batch_size=[10]),
                                            **real_server.connection_kwargs())
    admin = real_server.sync_client()
    try:
        assert store[3]["x"].tolist() == [12.0, 13.0, 14.0, 15.0]
        direct = store._conn.direct_client()
        _pid, kept = direct.__dict__[_SPARE]
        for i in range(5):
            assert store[i]["x"].tolist() == [4.0 * i + k for k in range(4)]
            assert direct.__dict__[_SPARE][1] is kept, "a read took another connection"
        host, port = kept._sock.getsockname()[:2]
        admin.client_kill(f"{host}:{port}")  # the server closes it (as on an idle timeout)
        time.sleep(0.1)
        assert store[7]["x"].tolist() == [28.0, 29.0, 30.0, 31.0]
        now = direct.__dict__[_SPARE][1]
        assert now._sock.getsockname()[:2] != (host, port), "the closed connection was kept"
    finally:
        admin.close()
        store.clear_redis()
        store.close()


def test_direct_reads_survive_a_crash_restart(request):
    with start_server("redis", config={"appendonly": "yes", "appendfsync": "always"}) as srv:
        store = _big(srv, n=8)
        want = store[2]["x"].clone()
        store[4:6] = TensorDict(x=torch.full((2, *ROW), 5.0), batch_size=[2])  # arms a connection too
        srv.restart()  # (stop + start: every socket is dead)
        assert torch.equal(store[2]["x"], want)
        store[4:6] = TensorDict(x=torch.full((2, *ROW), 6.0), batch_size=[2])
        assert torch.equal(store[4:6]["x"], torch.full((2, *ROW), 6.0))
        record(request, restarts=1)
        store.close()


def test_inherited_store_reads_and_writes_after_fork(real_server, request, driver):
    """A store used (direct client and armed connection alive) before fork works in the child and the parent."""
    if real_server.kind == "fakeredis":
        pytest.skip("fork needs a real server")  # real_server is never fakeredis; kept for clarity
    store = _big(real_server, n=16)
    store[5]
    store[0:2] = TensorDict(x=torch.zeros(2, *ROW), batch_size=[2])
    assert _slot(store, driver).armed is not None
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child():
        try:
            v = float(store[5]["x"][0, 0])
            store[2:4] = TensorDict(x=torch.full((2, *ROW), 3.0), batch_size=[2])
            q.put(("ok", v))
        except Exception as err:  # noqa: BLE001
            q.put(("err", repr(err)))

    procs = [ctx.Process(target=child) for _ in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    assert all(kind == "ok" for kind, _ in results), results
    # the parent's sockets and WATCH were not disturbed
    store[6:8] = TensorDict(x=torch.full((2, *ROW), 4.0), batch_size=[2])
    assert torch.equal(store[2:4]["x"], torch.full((2, *ROW), 3.0))
    assert torch.equal(store[6:8]["x"], torch.full((2, *ROW), 4.0))
    assert float(store[5]["x"][0, 0]) == results[0][1]
    record(request, children=len(procs))
    store.clear_redis()
    store.close()


# --------------------------------------------------------------------------- armed writes
def test_armed_writes_land_and_bump_the_write_version(real_server, driver):
    store = _big(real_server)
    wv_key = f"tensordict:{{{store.td_id}}}:wv"
    client = real_server.sync_client()
    local = store.to_tensordict()
    for i in range(6):
        value = torch.full((8, *ROW), float(i))
        before = int(client.get(wv_key) or 0)
        store[8 * i : 8 * i + 8] = TensorDict(x=value, batch_size=[8])
        local["x"][8 * i : 8 * i + 8] = value
        assert int(client.get(wv_key)) == before + 1
    assert _slot(store, driver).armed is not None
    assert torch.equal(store["x"], local["x"])
    store.clear_redis()
    store.close()


@pytest.mark.usefixtures("unchunked")  # the one-string layout
def test_armed_write_refuses_a_deleted_data_key(real_server, wire, driver):
    """The data key is WATCHed: deleted after the connection armed, the write is refused, never recreated."""
    store = _big(real_server)
    store[0:4] = TensorDict(x=torch.zeros(4, *ROW), batch_size=[4])
    assert _slot(store, driver).armed is not None
    real_server.sync_client().delete(f"tensordict:{{{store.td_id}}}:d:x")
    before = wire(real_server)
    for _ in range(2):  # armed, then the plain two-round-trip path
        with pytest.raises(tdstore.DataLostError):
            store[4:8] = TensorDict(x=torch.ones(4, *ROW), batch_size=[4])
    assert wire(real_server) == before
    store.clear_redis()
    store.close()


@pytest.mark.usefixtures("unchunked")  # the one-string layout
@pytest.mark.parametrize("armed", [True, False])
def test_armed_write_refuses_a_data_key_of_another_type(real_server, wire, driver, armed):
    """Issue 24 (N7): a data key replaced by a list, met by an armed write (on the armed
    connection, or arming afresh on another handle). The MULTI's SETRANGE was refused at the
    list after the write version's INCR had run; now the arming reads see the key's type and
    the write raises CorruptMetadataError naming the key, with no key changed."""
    store = _big(real_server)
    store[0:4] = TensorDict(x=torch.zeros(4, *ROW), batch_size=[4])
    assert _slot(store, driver).armed is not None
    if not armed:
        store.close()
        store = TensorDictStore.from_store(td_id=store.td_id, **real_server.connection_kwargs())
    key = f"tensordict:{{{store.td_id}}}:d:x"
    client = real_server.sync_client()
    client.delete(key)
    client.rpush(key, b"junk")
    before = wire(real_server)
    for _ in range(2):  # armed (or arming), then the plain WATCHed path
        with pytest.raises(tdstore.CorruptMetadataError, match=f"{key}.*another type"):
            store[4:8] = TensorDict(x=torch.ones(4, *ROW), batch_size=[4])
    assert wire(real_server) == before
    store.clear_redis()
    store.close()


def test_armed_write_after_another_client_changes_the_layout(real_server, driver):
    """A layout change between two writes aborts the armed EXEC; the write is re-planned on the new layout."""
    store = _big(real_server)
    store[0:4] = TensorDict(x=torch.zeros(4, *ROW), batch_size=[4])
    other = TensorDictStore.from_store(td_id=store.td_id, **real_server.connection_kwargs())
    other["x"] = torch.zeros(64, 2048, dtype=torch.float64)  # same row bytes (16 KiB), other dtype and shape
    store[4:8] = 1.0  # planned against the cached (stale) layout: float32 rows of 4 KiB

    got = other["x"]
    assert got.dtype == torch.float64 and got.shape == (64, 2048)
    assert bool((got[4:8] == 1).all()) and bool((got[:4] == 0).all()) and bool((got[8:] == 0).all())
    other["y"] = torch.zeros(64)  # a new key: the layout version moves again
    store[8:12] = 2.0
    assert bool((other["x"][8:12] == 2).all())
    other.close()
    store.clear_redis()
    store.close()


def test_armed_writers_of_one_entry_do_not_lose_writes(real_server, request, driver):
    """Writers on separate connections abort each other's armed EXECs; every write still lands once."""
    stores = [_big(real_server, n=32)]
    stores += [TensorDictStore.from_store(td_id=stores[0].td_id, **real_server.connection_kwargs()) for _ in range(2)]
    rounds = 40
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        try:
            deadline = time.monotonic() + 60
            for i in range(rounds):
                assert time.monotonic() < deadline
                row = (k * rounds + i) % 32
                stores[k][row : row + 1] = TensorDict(x=torch.full((1, *ROW), float(k * 1000 + i)), batch_size=[1])
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    final = stores[0]["x"]
    torn = sum(int(len(torch.unique(final[r])) != 1) for r in range(32))
    cooled = sum(int(_slot(s, driver).cool > 0) for s in stores)
    record(request, writes=3 * rounds, torn_rows=torn, writers_cooled=cooled)
    assert torn == 0
    for s in stores[1:]:
        s.close()
    stores[0].clear_redis()
    stores[0].close()


def test_threads_sharing_a_store_leave_one_connection_armed(real_server, driver, request):
    """Threads writing through one store each arm a connection; the slot keeps one, and the
    others go back to the pool (none is left out of it, still WATCHing)."""
    store = _big(real_server, n=32)
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        try:
            deadline = time.monotonic() + 60
            for i in range(25):
                assert time.monotonic() < deadline
                store[8 * k : 8 * k + 8] = TensorDict(x=torch.full((8, *ROW), float(100 * k + i)), batch_size=[8])
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    final = store["x"]
    wrong = sum(int(not bool((final[8 * k : 8 * k + 8] == 100 * k + 24).all())) for k in range(4))
    client = store._conn.direct_client() if driver == "direct" else store._conn._client
    pool = client.connection_pool
    # (the idle connection the direct client keeps between its exchanges, not WATCHing: the read
    # of "x" above left it there)
    spare = client.__dict__.get("_tdstore_spare")
    held = len(pool._in_use_connections) - (spare is not None and spare[1] in pool._in_use_connections)
    record(request, writes=100, wrong_blocks=wrong, connections_held=held)
    assert wrong == 0
    assert held <= 1  # the armed one
    store.clear_redis()
    store.close()


def test_armed_write_keeps_the_store_expiry(real_server, driver):
    store = _big(real_server, expire=60)
    client = real_server.sync_client()
    wv_key = f"tensordict:{{{store.td_id}}}:wv"
    client.delete(wv_key)  # the counter is created again by the next write: it must get the TTL
    store[0:2] = TensorDict(x=torch.zeros(2, *ROW), batch_size=[2])
    store[2:4] = TensorDict(x=torch.zeros(2, *ROW), batch_size=[2])
    assert 0 < client.pttl(wv_key) <= 60_000
    store.clear_redis()
    store.close()


def test_close_releases_the_armed_connection(real_server, driver):
    store = _big(real_server)
    store[0:2] = TensorDict(x=torch.zeros(2, *ROW), batch_size=[2])
    armed = _slot(store, driver).armed
    assert armed is not None and _is_connected(armed.connection)
    store.clear_redis()
    store.close()
    assert _slot(store, driver).armed is None
    assert not _is_connected(armed.connection)  # disconnected: its WATCH is gone with it


def test_blocking_pool_is_never_parked(real_server):
    """A client with a blocking pool: no connection is kept out of it (others would wait for it)."""
    import redis.asyncio

    kw = real_server.connection_kwargs()
    if "unix_socket_path" in kw:
        pool = redis.asyncio.BlockingConnectionPool(
            connection_class=redis.asyncio.UnixDomainSocketConnection, path=kw["unix_socket_path"], max_connections=2
        )
    else:
        pool = redis.asyncio.BlockingConnectionPool(host=kw.get("host", "127.0.0.1"), port=kw["port"], max_connections=2)
    store = TensorDictStore(client=redis.asyncio.Redis(connection_pool=pool), batch_size=[8])
    store["x"] = torch.zeros(8, *ROW)
    for i in range(4):
        store[0:2] = TensorDict(x=torch.full((2, *ROW), float(i)), batch_size=[2])
        assert store._conn.armed_slot.armed is None
        assert float(store[1]["x"][0, 0]) == float(i)
    store.clear_redis()
    store.close()


def test_gather_script_row_bounds_small_and_huge(server):
    """gather passes bounds below 1e15 as numbers, larger ones as "%d" strings: both read exactly."""
    from tdstore._backend.scripts import ScriptRunner, get_script

    client = server.sync_client()
    text = get_script("gather").text(False)
    key = "tdstest:{g}:d:rows"
    client.set(key, bytes(range(256)) * 4)  # 1 KiB: rows of 16 bytes
    try:
        rows = [0, 63, 5, 5, 17]
        got = client.eval(text, 1, key, "16", " ".join(map(str, rows)))
        data = bytes(range(256)) * 4
        assert got == b"".join(data[r * 16 : r * 16 + 16] for r in rows)
        # a row far past the end: off >= 1e15 takes the string path; GETRANGE past the end is empty
        assert client.eval(text, 1, key, "16", "62500000000000 3") == data[48:64]
        assert client.eval(text, 1, key, "16", "62499999999999") == b""
    finally:
        client.delete(key)
    assert ScriptRunner(False).sha("gather") == get_script("gather").sha(False)


@pytest.mark.usefixtures("unchunked")  # the one-string layout
def test_armed_connection_dropped_by_a_pool_reset_is_not_reused(real_server, wire, driver):
    """A pool reset (as after a refused write) disconnects the armed connection: the next write must
    not go out on a silently reconnected socket without its WATCH."""
    store = _big(real_server)
    store[0:4] = TensorDict(x=torch.zeros(4, *ROW), batch_size=[4])
    armed = _slot(store, driver).armed
    assert armed is not None

    async def reset(client):
        await client.connection_pool.disconnect()

    if driver == "direct":
        store._conn.direct_client().connection_pool.disconnect()
    else:
        store._conn.run(reset)
    assert not _is_connected(armed.connection)
    real_server.sync_client().delete(f"tensordict:{{{store.td_id}}}:d:x")
    before = wire(real_server)
    with pytest.raises(tdstore.DataLostError):
        store[4:8] = TensorDict(x=torch.ones(4, *ROW), batch_size=[4])
    assert wire(real_server) == before
    store.clear_redis()
    store.close()


def test_indexed_read_from_inside_the_io_loop_is_a_clear_error(real_server):
    """The direct path does not turn a call from the IO loop's thread into a blocking socket read."""
    import asyncio

    from tdstore._backend import loop as _io

    store = _big(real_server, n=4)
    store[1]  # the direct client exists
    errors = []

    async def inside():
        try:
            store[2]
        except tdstore.EventLoopError as err:
            errors.append(err)

    asyncio.run_coroutine_threadsafe(inside(), _io.get_loop()).result(10)
    assert errors and "IO loop" in str(errors[0])
    store.clear_redis()
    store.close()


def _race_writer(kwargs, td_id, proc, rounds, q):
    try:
        store = TensorDictStore.from_store(td_id=td_id, **kwargs)
        deadline = time.monotonic() + 30
        done = 0
        for k in range(1, rounds + 1):
            if time.monotonic() > deadline:
                break
            lo = (proc * 7 + k) % 24  # overlapping windows of 8 rows; both entries in one step
            value = float(proc * 10_000 + k)
            store[lo : lo + 8] = TensorDict(
                x=torch.full((8, *ROW), value), y=torch.full((8, 2048), value, dtype=torch.float64), batch_size=[8]
            )
            store[proc + 32] = TensorDict(x=torch.full(ROW, float(k)), y=torch.full((2048,), float(k), dtype=torch.float64))
            done += 1
        store.close()
        q.put(("ok", done))
    except Exception as err:  # noqa: BLE001 - reported to the parent
        q.put(("err", repr(err)))


def _race_reader(kwargs, td_id, seconds, q):
    try:
        store = TensorDictStore.from_store(td_id=td_id, **kwargs)
        deadline = time.monotonic() + seconds
        checked = torn = 0
        while time.monotonic() < deadline and checked < 20_000:
            r = checked % 32
            row = store[r : r + 1] if checked % 2 else store[r]
            x, y = row["x"].reshape(-1), row["y"].reshape(-1)
            torn += int(not (bool((x == x[0]).all()) and bool((y == float(x[0])).all())))
            checked += 1
        store.close()
        q.put(("ok", (checked, torn)))
    except Exception as err:  # noqa: BLE001
        q.put(("err", repr(err)))


def test_armed_writes_across_processes_never_torn_nor_lost(real_server, request, driver):
    """Forked writers of overlapping row windows (two large entries per write) and a reader:
    every row read is one write's (both entries alike), and each writer's own row ends at its last write."""
    n = 40
    store = TensorDictStore.from_schema(
        {"x": (list(ROW), torch.float32), "y": ([2048], torch.float64)}, batch_size=[n], **real_server.connection_kwargs()
    )
    kwargs = real_server.connection_kwargs()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    rounds = 60
    procs = [ctx.Process(target=_race_writer, args=(kwargs, store.td_id, p, rounds, q)) for p in range(3)]
    procs.append(ctx.Process(target=_race_reader, args=(kwargs, store.td_id, 4.0, q)))
    for p in procs:
        p.start()
    results = [q.get(timeout=90) for _ in procs]
    for p in procs:
        p.join(30)
    assert all(kind == "ok" for kind, _ in results), results
    writes = sum(v for _, v in results if isinstance(v, int))
    checked, torn = next(v for _, v in results if isinstance(v, tuple))
    own = store[32:35]
    lost = sum(int(not bool((own["x"][p] == float(rounds)).all())) for p in range(3))
    record(request, writes=writes, reads=checked, torn_reads=f"{torn}/{checked}", lost_last_writes=f"{lost}/3")
    assert torn == 0 and checked > 0 and writes == 3 * rounds and lost == 0
    store.clear_redis()
    store.close()
