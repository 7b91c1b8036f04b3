"""Placed reads (tdstore/_backend/placed.py): large row runs of an indexed read or a sample
received straight into their tensor, on real servers, checked against the in-memory
TensorDict; the fallbacks (a run of another length, a reply the parser does not know, a
server that lies about a size) and threads sharing a handle."""

from __future__ import annotations

import random
import socket
import threading

import pytest
import redis
import torch
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore._backend import placed as _placed
from tdstore.errors import CorruptMetadataError, DataLostError

ROW = [32, 32, 3]  # 3 KiB rows of uint8 (>= PLACE_MIN_PIECE): placed in a read of 64 KiB or more


def reference(n: int, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        obs=torch.randint(0, 256, (n, *ROW), dtype=torch.uint8, generator=g),
        big=torch.randn(n, 1024, generator=g),  # 4 KiB rows of float32
        r=torch.randn(n, generator=g),
        batch_size=[n],
    )


def schema() -> dict:
    return {"obs": (ROW, torch.uint8), "big": ([1024], torch.float32), "r": ([], torch.float32)}


@pytest.fixture
def placed_count(monkeypatch) -> list[int]:
    """How many replies each placed exchange received into their tensor (a counting wrapper
    around the real exchange: the server answers every call)."""
    counts: list[int] = []
    real = _placed.exchange

    def counted(*args, **kwargs):
        out = real(*args, **kwargs)
        counts.append(sum(1 for r in out if r is _placed.PLACED))
        return out

    monkeypatch.setattr(_placed, "exchange", counted)
    return counts


def fill(store: TensorDictStore, ref: TensorDict) -> None:
    for i in range(0, ref.shape[0], 97):
        store.extend(ref[i : i + 97])


@pytest.mark.parametrize("chunk_bytes", [None, 100_000])  # (100,000 B chunks: rows straddle them)
def test_indexed_reads_and_samples_are_placed_and_equal_the_reference(real_server, placed_count, chunk_bytes):
    n = 400
    ref = reference(n)
    kw = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    store = TensorDictStore.from_schema(schema(), batch_size=[n], **kw, **real_server.connection_kwargs())
    try:
        fill(store, ref)
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            idx = torch.randint(0, n, (64,), generator=g)
            got = store[idx]
            assert torch.equal(got["obs"], ref["obs"][idx]) and torch.equal(got["big"], ref["big"][idx])
            assert torch.equal(got["r"], ref["r"][idx])
        batch, info = store.sample(100, return_info=True)
        assert torch.equal(batch["obs"], ref["obs"][info["index"]]) and torch.equal(batch["big"], ref["big"][info["index"]])
        store.enable_priorities(alpha=0.6, beta=0.4)
        batch, info = store.sample(100, prioritized=True, return_info=True)
        assert torch.equal(batch["obs"], ref["obs"][info["index"]]) and torch.equal(batch["r"], ref["r"][info["index"]])
        # every read above placed the runs of its two large entries (rows next to each other
        # are one run; a row across two chunks is two pieces)
        assert len(placed_count) >= 7 and min(placed_count) > 64
        # the tensors are writable and own their memory (no view of a buffer reused later)
        again = store[idx]
        again["obs"].zero_()
        assert torch.equal(store[idx]["obs"], ref["obs"][idx])
    finally:
        store.clear_redis()
        store.close()


def test_small_rows_are_not_placed(real_server, placed_count):
    store = TensorDictStore.from_schema({"x": ([4], torch.float32)}, batch_size=[1000], **real_server.connection_kwargs())
    try:
        ref = torch.randn(1000, 4)
        store.extend(TensorDict(x=ref, batch_size=[1000]))
        idx = torch.randint(0, 1000, (300,))
        assert torch.equal(store[idx]["x"], ref[idx])
        assert placed_count == []  # (16 B runs: hiredis parses them faster than Python would)
    finally:
        store.clear_redis()
        store.close()


def test_a_read_past_place_max_goes_unplaced_and_equal(real_server, placed_count, monkeypatch):
    """A read whose targets would add up to more than PLACE_MAX is not placed (its tensors are
    allocated from the registry's sizes before the server answers: a damaged registry must not
    make a read allocate without bound); it reads the same rows the unplaced way."""
    n = 200
    ref = reference(n)
    store = TensorDictStore.from_schema(schema(), batch_size=[n], **real_server.connection_kwargs())
    try:
        fill(store, ref)
        idx = torch.randint(0, n, (64,), generator=torch.Generator().manual_seed(3))
        assert torch.equal(store[idx]["obs"], ref["obs"][idx])
        assert placed_count  # (placed under the default PLACE_MAX)
        monkeypatch.setattr(_placed, "PLACE_MAX", 64 * 1024)
        placed_count.clear()
        got = store[idx]
        assert torch.equal(got["obs"], ref["obs"][idx]) and torch.equal(got["big"], ref["big"][idx])
        assert placed_count == []
    finally:
        store.clear_redis()
        store.close()


def test_tls_reads_go_the_io_loop_way_unplaced_and_equal(tls_server, placed_count):
    # (a TLS store has no blocking direct client: its reads run on the IO loop, parsed by hiredis)
    n = 150
    ref = reference(n, seed=7)
    store = TensorDictStore.from_schema(schema(), batch_size=[n], **tls_server.connection_kwargs())
    try:
        fill(store, ref)
        idx = torch.randint(0, n, (50,))
        got = store[idx]
        assert torch.equal(got["obs"], ref["obs"][idx]) and torch.equal(got["big"], ref["big"][idx])
        assert placed_count == []
    finally:
        store.clear_redis()
        store.close()


def test_a_unix_socket_and_resp3_are_placed_too(real_server, placed_count):
    n = 200
    ref = reference(n, seed=3)
    kwargs = real_server.connection_kwargs(unix=True)
    try:
        store = TensorDictStore.from_schema(schema(), batch_size=[n], protocol=3, **kwargs)
    except TypeError:
        store = TensorDictStore.from_schema(schema(), batch_size=[n], **kwargs)
    try:
        fill(store, ref)
        idx = torch.randint(0, n, (50,))
        got = store[idx]
        assert torch.equal(got["obs"], ref["obs"][idx]) and torch.equal(got["big"], ref["big"][idx])
        assert placed_count and placed_count[-1] > 50  # (two entries' runs; rows next to each other are one)
    finally:
        store.clear_redis()
        store.close()


def test_a_shortened_entry_gives_the_same_error_and_leaves_the_handle_working(real_server, placed_count):
    n = 100
    ref = reference(n, seed=4)
    store = TensorDictStore.from_schema(schema(), batch_size=[n], **real_server.connection_kwargs())
    raw = real_server.sync_client()
    try:
        fill(store, ref)
        key = store._conn.keys.data(("obs",))
        whole = raw.get(key)
        raw.set(key, whole[: len(whole) - 5000])  # the last rows' runs come back short
        with pytest.raises((DataLostError, CorruptMetadataError), match="obs"):
            store[torch.tensor([0, 99, 98, 1] * 8)]
        raw.set(key, whole)
        idx = torch.tensor([99, 0, 50] * 10)
        assert torch.equal(store[idx]["obs"], ref["obs"][idx])  # the connection was left clean
        assert placed_count[-1] == 60
    finally:
        raw.close()
        store.clear_redis()
        store.close()


def test_threads_sharing_a_handle_read_their_own_rows(real_server):
    n = 300
    ref = reference(n, seed=5)
    store = TensorDictStore.from_schema(schema(), batch_size=[n], **real_server.connection_kwargs())
    errors: list[str] = []
    try:
        fill(store, ref)

        def reader(seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            for _ in range(20):
                idx = torch.randint(0, n, (40,), generator=g)
                got = store[idx]
                if not (torch.equal(got["obs"], ref["obs"][idx]) and torch.equal(got["big"], ref["big"][idx])):
                    errors.append(f"thread {seed}: rows {idx.tolist()[:5]}... differ")
                batch, info = store.sample(40, return_info=True)
                if not torch.equal(batch["obs"], ref["obs"][info["index"]]):
                    errors.append(f"thread {seed}: a sample's rows differ")

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
    finally:
        store.clear_redis()
        store.close()


# --------------------------------------------------------------------------- #
# the parser, on a socket pair: what a server may send
# --------------------------------------------------------------------------- #


def replies_of(data: bytes, close: bool = True) -> _placed._Replies:
    a, b = socket.socketpair()
    a.settimeout(5)
    b.sendall(data)
    if close:
        b.close()
    replies = _placed._Replies(a, redis.exceptions.ResponseError)
    replies._peer = b  # type: ignore[attr-defined]  # (kept open while the test runs)
    return replies


def test_the_parser_gives_what_hiredis_gives():
    target = memoryview(bytearray(5))
    r = replies_of(b"+OK\r\n:42\r\n$-1\r\n_\r\n$5\r\nhello\r\n$3\r\nabc\r\n*2\r\n$1\r\nx\r\n:7\r\n-ERR no\r\n,1.5\r\n#t\r\n"
                   b"%1\r\n$1\r\nk\r\n$1\r\nv\r\n=8\r\ntxt:four\r\n")
    assert r.reply() == b"OK" and r.reply() == 42 and r.reply() is None and r.reply() is None
    assert r.reply(target) is _placed.PLACED and bytes(target) == b"hello"
    assert r.reply(target) == b"abc"  # (another length: not placed, its bytes returned)
    assert r.reply() == [b"x", 7]
    err = r.reply()
    assert isinstance(err, redis.exceptions.ResponseError) and "no" in str(err)
    assert r.reply() == 1.5 and r.reply() == 1 and r.reply() == [b"k", b"v"] and r.reply() == b"four"


def test_an_exec_array_places_its_items_by_position():
    t0, t2 = memoryview(bytearray(3)), memoryview(bytearray(4))
    r = replies_of(b"*3\r\n$3\r\nabc\r\n$2\r\nzz\r\n$4\r\nwxyz\r\n")
    assert r.reply(targets={0: t0, 2: t2}) == [_placed.PLACED, b"zz", _placed.PLACED]
    assert bytes(t0) == b"abc" and bytes(t2) == b"wxyz"


@pytest.mark.parametrize("buffer", [None, 64, 1000])
@pytest.mark.parametrize("seed", range(4))
def test_integer_arrays_give_what_hiredis_gives(seed, buffer):
    """Arrays of integers (BITFIELD's replies), parsed in one pass: extremes, arrays cut
    anywhere by the receives (``buffer``: a small receive buffer, 64 bytes too small for
    the array, so it goes item by item), an item that is not an integer, replies after."""
    import hiredis

    rng = random.Random(seed)
    data = b""
    for _ in range(6):
        count = rng.choice([0, 1, 15, 16, 17, 40, 300])
        items = []
        for i in range(count):
            if seed % 2 and i == count // 2:
                items.append(rng.choice([b"$1\r\nx\r\n", b"$-1\r\n", b"-ERR no\r\n", b"*2\r\n:1\r\n:2\r\n"]))
            else:
                items.append(b":%d\r\n" % rng.choice([0, -1, 2**63 - 1, -(2**63), rng.randrange(-(2**63), 2**63)]))
        data += b"*%d\r\n" % count + b"".join(items) + rng.choice([b"", b":7\r\n", b"+OK\r\n"])
    reader = hiredis.Reader()
    reader.feed(data)
    want = []
    while (one := reader.gets()) is not False:
        want.append(one)
    r = replies_of(data)
    if buffer is not None:
        r.buf = bytearray(buffer)
        r.mv = memoryview(r.buf)
    got = [r.reply() for _ in want]
    norm = lambda v: str(v) if isinstance(v, Exception) else [norm(x) for x in v] if isinstance(v, list) else v  # noqa: E731
    assert norm(got) == norm(want)


def test_an_integer_array_is_parsed_in_one_pass(monkeypatch):
    lines: list[int] = []
    line = _placed._Replies._line
    monkeypatch.setattr(_placed._Replies, "_line", lambda self: lines.append(1) or line(self))
    r = replies_of(b"*256\r\n" + b":-5\r\n" * 255 + b":9223372036854775807\r\n")
    assert r.reply() == [-5] * 255 + [2**63 - 1] and len(lines) == 1  # (the header's line only)


@pytest.mark.parametrize(
    "data, error",
    [
        (b"?what\r\n", redis.exceptions.InvalidResponse),  # a reply type reads never get
        (b">2\r\n$7\r\nmessage\r\n$1\r\nx\r\n", redis.exceptions.InvalidResponse),  # a RESP3 push
        (b"$3\r\nabcXY", redis.exceptions.InvalidResponse),  # no CRLF after the bytes
        (b"$1000000000000\r\nabc", redis.exceptions.ConnectionError),  # a size it never sends
        (b"$5\r\nab", redis.exceptions.ConnectionError),  # cut short
    ],
)
def test_hostile_replies_give_one_clear_error_in_bounded_memory(data, error):
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(error):
            replies_of(data).reply(memoryview(bytearray(4)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20  # (not the terabyte the size claims)


def test_fakeredis_reads_are_not_placed(fake_server, placed_count):
    store = TensorDictStore.from_schema(schema(), batch_size=[100], **fake_server.connection_kwargs())
    try:
        ref = reference(100, seed=6)
        fill(store, ref)
        idx = torch.randint(0, 100, (40,))
        assert torch.equal(store[idx]["obs"], ref["obs"][idx])
        assert placed_count == []
    finally:
        store.clear_redis()
        store.close()
