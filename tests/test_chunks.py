"""Chunked entries (``chunk_bytes=``): row-block strings under the store's hash tag.

The pure chunk arithmetic is tested exhaustively without a server; then every backend runs
a differential suite (the same operations on an in-memory TensorDict and on a chunked
store, over seeded random shapes, dtypes, chunk sizes and indices), the key layout is read
back from the server, entries past the server's string limit are written and read, the
zero-fill of ``from_schema`` is shown to go chunk by chunk (SLOWLOG of a real server), and
spawned processes count torn and stale reads of entries whose rows straddle chunks.
The conformance suite also runs whole with ``TDSTORE_CHUNK_BYTES`` set (see .ci/run).
"""

from __future__ import annotations

import random

import _race_workers as w
import pytest
import redis
import torch
from fixtures import PoolSpec
from tensordict import NonTensorStack, TensorDict

import tdstore
from tdstore import TensorDictStore
from tdstore._core import chunks as _chunks
from tdstore._core.chunks import Chunking, chunk_size, pieces
from tdstore.server import start_server
from tdstore.testing.counts import record as _record
from tdstore.testing.strategies import rand_tensor

DTYPES = [torch.bool, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64, torch.complex64]


# --------------------------------------------------------------------------- pure arithmetic


class TestChunkSize:
    def test_small_entries_stay_one_string(self):
        assert chunk_size([10, 4], 4, 160) is None  # exactly chunk_bytes
        assert chunk_size([10, 4], 4, None) is None
        assert chunk_size([0, 4], 4, 16) is None

    def test_row_blocks_when_a_row_fits(self):
        assert chunk_size([10, 4], 4, 100) == 96  # 6 rows of 16 bytes
        assert chunk_size([10, 4], 4, 16) == 16

    def test_whole_elements_when_a_row_does_not_fit(self):
        assert chunk_size([3, 10], 8, 50) == 48
        assert chunk_size([100], 16, 17) == 16  # rows of one complex128 element
        assert chunk_size([3, 30], 1, 17) == 17
        assert chunk_size([3, 10], 1, 17) == 10  # a row of 10 bytes fits: one row per chunk

    @pytest.mark.parametrize("seed", range(20))
    def test_every_chunk_fits_and_rows_align(self, seed):
        rng = random.Random(seed)
        for _ in range(200):
            shape = [rng.randint(1, 40) for _ in range(rng.randint(1, 3))]
            itemsize = rng.choice([1, 2, 4, 8, 16])
            cb = rng.randint(16, 600)
            size = chunk_size(shape, itemsize, cb)
            nbytes = itemsize
            for d in shape:
                nbytes *= d
            if nbytes <= cb:
                assert size is None
                continue
            assert size is not None and 0 < size <= cb and size % itemsize == 0
            row = nbytes // shape[0]
            if row <= cb:
                assert size % row == 0 and size + row > cb  # as many whole rows as fit


class TestPieces:
    @pytest.mark.parametrize("seed", range(20))
    def test_pieces_cover_the_run_in_order(self, seed):
        rng = random.Random(seed)
        for _ in range(300):
            size = rng.randint(1, 50)
            nbytes = rng.randint(1, 400)
            ch = Chunking(size, nbytes)
            offset = rng.randint(0, nbytes - 1)
            length = rng.randint(0, nbytes - offset)
            got = list(pieces(ch, offset, length))
            assert sum(n for _, _, n in got) == length
            at = offset
            for k, local, n in got:
                assert k * size + local == at and 0 < n and local + n <= size and k < ch.count
                at += n

    def test_count_and_lengths(self):
        ch = Chunking(16, 40)
        assert (ch.count, [ch.length(k) for k in range(ch.count)]) == (3, [16, 16, 8])
        assert Chunking(16, 0).count == 1

    @pytest.mark.parametrize("value", [0, 15, -1, 1.5, "64", True])
    def test_bad_chunk_bytes(self, value):
        with pytest.raises(ValueError, match="chunk_bytes of the store X must be an int of at least 16"):
            _chunks.check_chunk_bytes(value, "the store X")

    @pytest.mark.parametrize("raw,message", [("x", "is not a number of bytes"), ("8", "below the smallest chunk size")])
    def test_bad_environment_variable(self, monkeypatch, raw, message):
        monkeypatch.setenv("TDSTORE_CHUNK_BYTES", raw)
        with pytest.raises(ValueError, match=message):
            _chunks.env_chunk_bytes()


# --------------------------------------------------------------------------- on every backend


def _strings(server, store):
    """``{key suffix: length}`` of every data string of ``store``."""
    client = server.sync_client()
    base = f"{store.prefix}:{{{store.td_id}}}:".encode()
    out = {}
    for key in client.scan_iter(match=base + b"*"):
        suffix = key[len(base):].decode()
        if suffix.startswith(("c:", "d:")):
            out[suffix] = client.strlen(key)
    client.close()
    return out


def _equal(store, ref):
    local = store.to_tensordict()
    assert set(local.keys(True, True)) == set(ref.keys(True, True))
    for key, value in ref.items(True, True):
        assert local[key].dtype == value.dtype and torch.equal(local[key], value), key
        assert torch.equal(store[key], value), key


def _rand_td(rng, n):
    td = TensorDict(batch_size=[n])
    for i in range(rng.randint(1, 4)):
        feat = tuple(rng.randint(1, 6) for _ in range(rng.randint(0, 2)))
        td[f"k{i}"] = rand_tensor(rng, (n, *feat), rng.choice(DTYPES))
    if rng.random() < 0.5:
        td["nest", "leaf"] = rand_tensor(rng, (n, rng.randint(1, 9)), rng.choice(DTYPES))
    return td


def _rand_index(rng, n, unique=False):
    """A random index of the first dim; ``unique``: no row twice (a write's result is then defined)."""
    kind = rng.choice(["int", "slice", "step", "list", "mask", "tensor"])
    if unique and kind in ("list", "tensor"):
        return torch.tensor(rng.sample(range(n), rng.randint(1, n))) if kind == "tensor" else rng.sample(range(n), rng.randint(1, min(n, 12)))
    if kind == "int":
        return rng.randrange(-n, n)
    if kind == "slice":
        a = rng.randint(0, n - 1)
        return slice(a, rng.randint(a + 1, n))
    if kind == "step":
        return slice(rng.randint(0, n - 1), None, rng.randint(2, 4))
    if kind == "list":
        return [rng.randrange(n) for _ in range(rng.randint(1, 12))]
    if kind == "mask":
        mask = torch.tensor([rng.random() < 0.5 for _ in range(n)])
        mask[rng.randrange(n)] = True
        return mask
    return torch.randint(0, n, (rng.randint(8, 40),), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))


@pytest.mark.parametrize("seed", range(6))
def test_differential_on_chunked_entries(make, server, seed, request):
    """Reads, indexed writes, whole writes, reshapes, renames and deletes, compared with a TensorDict."""
    rng = random.Random(seed)
    n = rng.randint(6, 40)
    ref = _rand_td(rng, n)
    cb = rng.randint(16, 120)
    store = make("from_tensordict", ref.clone(), chunk_bytes=cb)
    assert store.chunk_bytes == cb
    _equal(store, ref)
    cases = 0
    for _ in range(14):
        op = rng.choice(["read", "read", "write", "write", "whole", "rename", "delete", "add"])
        idx = _rand_index(rng, n)
        if op == "read":
            got, want = store[idx], ref[idx]
            for key, value in want.items(True, True):
                assert torch.equal(got[key], value), (key, idx)
        elif op == "write":
            idx = _rand_index(rng, n, unique=True)
            sub = ref[idx]
            value = TensorDict(
                {k: rand_tensor(rng, tuple(v.shape), v.dtype) for k, v in sub.items(True, True)}, batch_size=sub.batch_size
            )
            store[idx] = value
            ref[idx] = value
        elif op == "whole":
            key = rng.choice(list(ref.keys(True, True)))
            feat = tuple(rng.randint(1, 7) for _ in range(rng.randint(0, 2)))
            value = rand_tensor(rng, (n, *feat), rng.choice(DTYPES))  # may change the chunking
            store[key] = value
            ref[key] = value
        elif op == "rename":
            key = rng.choice([k for k in ref.keys() if not isinstance(ref[k], TensorDict)] or ["__none__"])
            if key != "__none__":
                store.rename_key_(key, key + "r")
                ref.rename_key_(key, key + "r")
        elif op == "delete" and len(list(ref.keys())) > 1:
            key = rng.choice(list(ref.keys()))
            del store[key]
            del ref[key]
        elif op == "add":
            value = rand_tensor(rng, (n, rng.randint(1, 30)), rng.choice(DTYPES))
            store[f"new{cases}"] = value
            ref[f"new{cases}"] = value
        cases += 1
        _equal(store, ref)
    # every string is within the chunk size, or is an entry of at most chunk_bytes
    for suffix, length in _strings(server, store).items():
        assert length <= cb, (suffix, length)
    again = TensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs())
    assert again.chunk_bytes == cb
    _equal(again, ref)
    again.close()
    _record(request, chunked_cases=cases)
    store.clear_redis()
    assert _strings(server, store) == {}


def test_key_layout(make, server):
    store = make("from_tensordict", TensorDict(big=torch.arange(40, dtype=torch.int64).reshape(10, 4), small=torch.ones(10, 1), batch_size=[10]), chunk_bytes=96)
    strings = _strings(server, store)
    # big: 320 bytes in rows of 32 -> chunks of 3 rows (96 bytes); small: 40 bytes, one string
    assert strings == {"c:0:big": 96, "c:1:big": 96, "c:2:big": 96, "c:3:big": 32, "d:small": 40}
    client = server.sync_client()
    slots = {redis.crc.key_slot(key) for key in client.scan_iter(match=f"*{{{store.td_id}}}*".encode())}
    client.close()
    assert len(slots) == 1  # every chunk in the store's slot
    # a larger value of the same key grows the chunks; a smaller one goes back to one string
    store["big"] = torch.zeros(10, 8, dtype=torch.int64)
    # rows of 64 bytes: one row per chunk of at most 96
    assert _strings(server, store) == {**{f"c:{k}:big": 64 for k in range(10)}, "d:small": 40}
    store["big"] = torch.zeros(10, 1, dtype=torch.int64)
    assert _strings(server, store) == {"d:big": 80, "d:small": 40}
    store["small"] = torch.ones(10, 30)  # rows of 120 bytes > 96: chunks of 24 whole elements
    small = {k: v for k, v in _strings(server, store).items() if k.endswith(":small")}
    assert small == {**{f"c:{k}:small": 96 for k in range(12)}, "c:12:small": 48}
    assert torch.equal(store["small"], torch.ones(10, 30))


def test_from_schema_zero_fill_and_extend(make):
    buf = make("from_schema", {"x": ([5], torch.float32), "y": ([], torch.int64)}, batch_size=[20], chunk_bytes=64)
    assert torch.equal(buf["x"], torch.zeros(20, 5)) and torch.equal(buf["y"], torch.zeros(20, dtype=torch.int64))
    model = torch.zeros(20, dtype=torch.int64)
    cursor = 0
    for i in range(1, 9):
        rows = buf.extend(TensorDict(x=torch.full((3, 5), float(i)), y=torch.full((3,), i), batch_size=[3]))
        assert rows.tolist() == [(cursor + j) % 20 for j in range(3)]
        model[rows] = i
        cursor += 3
    assert torch.equal(buf["y"], model)
    assert torch.equal(buf["x"], model.to(torch.float32)[:, None].expand(20, 5))


def test_other_connection_reads_the_chunking(make, server):
    store = make(batch_size=[12], chunk_bytes=32)
    store["x"] = torch.arange(48.0).reshape(12, 4)
    other = TensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs())
    assert other.chunk_bytes == 32
    other["y"] = torch.ones(12, 3)  # the new entry is chunked by the store's setting
    assert any(s.startswith("c:") and s.endswith(":y") for s in _strings(server, store))
    assert torch.equal(store["y"], torch.ones(12, 3))
    other.close()


def test_reconnecting_with_another_chunk_size_is_refused(make, server):
    store = make(batch_size=[4], chunk_bytes=32)
    store["x"] = torch.ones(4, 8)
    before = _strings(server, store)
    with pytest.raises(tdstore.SchemaError, match=r"already holds a store with chunk_bytes=32, not 64"):
        TensorDictStore(td_id=store.td_id, chunk_bytes=64, **server.connection_kwargs())
    assert _strings(server, store) == before and torch.equal(store["x"], torch.ones(4, 8))


def test_environment_default(make, server, monkeypatch):
    monkeypatch.setenv("TDSTORE_CHUNK_BYTES", "40")
    store = make(batch_size=[10])
    store["x"] = torch.ones(10, 2)
    assert store.chunk_bytes == 40 and "c:0:x" in _strings(server, store)
    monkeypatch.setenv("TDSTORE_CHUNK_BYTES", "")
    assert make(batch_size=[2]).chunk_bytes is None


def test_clear_and_recreate_keeps_the_chunking(make, server):
    store = make(batch_size=[8], chunk_bytes=16)
    store["x"] = torch.ones(8, 4)
    store.clear_redis()
    assert _strings(server, store) == {}
    store["x"] = torch.full((8, 4), 2.0)  # the cleared store is recreated with its settings
    assert store.chunk_bytes == 16 and torch.equal(store["x"], torch.full((8, 4), 2.0))
    assert "c:0:x" in _strings(server, store)


def test_clone_keeps_the_chunking(make, server):
    """clone() makes a store with the source's chunk_bytes (its handle's setting or the
    environment's play no part): the same strings, chunk for chunk, under the new td_id."""
    store = make(batch_size=[12], chunk_bytes=32)
    store["x"] = torch.arange(48.0).reshape(12, 4)
    store["sub", "y"] = torch.arange(36, dtype=torch.int16).reshape(12, 3)
    source = _strings(server, store)
    for copy, of in ((store.clone(), store), (store["sub"].clone(), store["sub"])):
        try:
            assert copy.td_id != store.td_id and copy.chunk_bytes == 32
            strings = _strings(server, copy)
            # (the sub-store's copy holds its entries at the top: "c:0:y" for the source's "c:0:sub.y")
            want = source if of is store else {s.replace("sub.", ""): n for s, n in source.items() if ":sub." in s}
            assert strings == want and all(s.startswith("c:") for s in strings)
            assert (copy == of).all()
        finally:
            copy.clear_redis()
            copy.close()
    assert _strings(server, store) == source


def test_lost_chunk_is_reported(make, server):
    store = make(batch_size=[8], chunk_bytes=16)
    store["x"] = torch.ones(8, 4)
    client = server.sync_client()
    client.delete(f"{store.prefix}:{{{store.td_id}}}:c:1:x")
    client.close()
    for read in (lambda: store["x"], lambda: store[1], lambda: store[0:3], lambda: store[[0, 1]]):  # row 1 is chunk 1
        with pytest.raises(tdstore.DataLostError):
            read()
    assert torch.equal(store[0]["x"], torch.ones(4))  # rows in the other chunks are still there
    with pytest.raises(tdstore.DataLostError):
        store[torch.tensor([0, 1, 2, 3, 4])] = TensorDict(x=torch.zeros(5, 4), batch_size=[5])


# --------------------------------------------------------------------------- past the string limit


@pytest.fixture(scope="module", params=["redis", "valkey"])
def limited(request):
    """A private server whose strings are at most 1 MiB (the smallest proto-max-bulk-len)."""
    try:
        handle = start_server(request.param, config={"proto-max-bulk-len": "1mb"})
    except Exception as exc:  # noqa: BLE001 - a missing server fails, never skips
        pytest.fail(f"cannot start {request.param}: {exc}", pytrace=False)
    yield handle
    handle.stop()


def test_entries_past_the_string_limit(limited):
    """A 3 MiB entry is refused as one string and works chunked: every operation, every string under 1 MiB."""
    conn = limited.connection_kwargs()
    value = torch.randn(64, 12_288)  # 3 MiB of float32, rows of 48 KiB
    with pytest.raises(tdstore.EntryTooLargeError, match="chunk_bytes="):
        TensorDictStore.from_tensordict(TensorDict(x=value, batch_size=[64]), **conn)
    store = TensorDictStore.from_tensordict(TensorDict(x=value, batch_size=[64]), chunk_bytes=512 * 1024, **conn)
    try:
        assert torch.equal(store["x"], value)
        idx = torch.tensor([63, 0, 17, 18, 40])  # distinct: torch mixes duplicate rows of large tensors
        assert torch.equal(store[idx]["x"], value[idx])
        new = torch.randn(5, 12_288)
        store[idx] = TensorDict(x=new, batch_size=[5])
        value[idx] = new
        assert torch.equal(store["x"], value)
        copy = store.clone()  # the copy is chunked as its source, so it fits the limit too
        try:
            assert copy.chunk_bytes == 512 * 1024 and torch.equal(copy["x"], value)
        finally:
            copy.clear_redis()
            copy.close()
        schema = TensorDictStore.from_schema({"obs": ([65_536], torch.uint8)}, batch_size=[40], chunk_bytes=1024 * 1024, **conn)
        assert int(schema["obs"].sum()) == 0 and schema["obs"].shape == (40, 65_536)
        schema.clear_redis()
        schema.close()
        client = limited.sync_client()
        lengths = [client.strlen(k) for k in client.scan_iter() if client.type(k) == b"string"]
        # 7 chunks of at most 512 KiB (10 rows of 48 KiB each, 4 in the last), and the write counter
        assert sorted(lengths) == [1, 196_608] + [491_520] * 6
        client.close()
    finally:
        store.clear_redis()
        store.close()


def test_from_schema_fills_chunk_by_chunk(limited):
    """No server step zero-fills more than one chunk: every SETRANGE the allocation sends ends within a chunk."""
    conn = limited.connection_kwargs()
    client = limited.sync_client()
    client.config_set("slowlog-log-slower-than", 0)
    client.config_set("slowlog-max-len", 10_000)
    client.slowlog_reset()
    try:
        store = TensorDictStore.from_schema({"obs": ([1024], torch.uint8)}, batch_size=[4096], chunk_bytes=256 * 1024, **conn)
        log = client.slowlog_get(10_000)
    finally:
        client.config_set("slowlog-log-slower-than", 10_000)
    fills = [entry for entry in log if entry["command"].split()[0].upper() == b"SETRANGE"]
    assert len(fills) == 16  # 4 MiB in 16 chunks of 256 KiB
    assert all(int(entry["command"].split()[2]) < 256 * 1024 for entry in fills)
    assert torch.equal(store[4095]["obs"], torch.zeros(1024, dtype=torch.uint8))
    # clear_redis(): the store goes in one step, its chunks are renamed to trash keys there and
    # freed afterwards one DEL (one chunk) per command
    client.config_set("slowlog-log-slower-than", 0)
    client.slowlog_reset()
    try:
        store.clear_redis()
        log = client.slowlog_get(10_000)
    finally:
        client.config_set("slowlog-log-slower-than", 10_000)
    words = [entry["command"].split() for entry in log]
    renames = [w for w in words if w[0].upper() == b"RENAME"]
    frees = [w for w in words if w[0].upper() == b"DEL" and b":tmp:" in w[1]]
    assert len(renames) == 16 and len(frees) == 16 and all(len(w) == 2 for w in frees)
    assert [k for k in client.scan_iter() if store.td_id.encode() in k] == []
    store.close()
    client.close()


# --------------------------------------------------------------------------- many processes


#: the module's ``pool`` (tests/fixtures.py); the tests below run on ``race_server`` (redis, valkey)
POOL = PoolSpec(workers=5, warm_up=w.warm_up, warm_up_arg=0.5)


@pytest.mark.multiprocess
def test_rows_across_chunks_never_torn(race_server, pool, request):
    """Rows of 8 KiB in chunks of 1000 bytes: a row spans 9 strings, and is still read whole or not at all."""
    conn = race_server.connection_kwargs()
    store = TensorDictStore.from_schema(
        {"obs": ([1024], torch.float64), "act": ([4], torch.int64)}, batch_size=[64], chunk_bytes=1000, **conn
    )
    store["tag"] = NonTensorStack(*["w0"] * 64)
    reader = pool.submit(w.row_reader, conn, store.td_id, 1.5, 0)
    writers = [pool.submit(w.const_writer, conn, store.td_id, p, 10_000, 1.5) for p in range(4)]
    writes = sum(f.result(60) for f in writers)
    checked, torn = reader.result(60)
    _record(request, writes=writes, torn_reads=f"{torn}/{checked}")
    assert torn == 0 and checked > 0 and writes > 0
    store.clear_redis()
    store.close()


@pytest.mark.multiprocess
def test_rechunked_entry_never_misread(race_server, pool, request):
    """Writers replace an entry with other widths and dtypes (so other chunkings); readers never mix them."""
    conn = race_server.connection_kwargs()
    store = TensorDictStore(batch_size=[8], chunk_bytes=16, **conn)
    store["x"] = torch.full((8, 1), 1, dtype=w.DTYPES[1])
    readers = [pool.submit(w.shape_reader, conn, store.td_id, 1.5, cache) for cache in (True, False)]
    writers = [pool.submit(w.replacer, conn, store.td_id, 100_000, 1.5) for _ in range(3)]
    replaced = sum(f.result(60) for f in writers)
    checked = wrong = 0
    for f in readers:
        c, x = f.result(60)
        checked, wrong = checked + c, wrong + x
    _record(request, replacements=replaced, misread=f"{wrong}/{checked}")
    assert wrong == 0 and checked > 0 and replaced > 0
    store.clear_redis()
    store.close()


@pytest.mark.multiprocess
def test_chunked_appends_disjoint(race_server, pool, request):
    """Concurrent extend() into chunked entries (rows of 32 bytes in chunks of 40: rows straddle chunks)."""
    conn = race_server.connection_kwargs()
    count, rows = 20, 3
    capacity = 4 * count * rows
    store = TensorDictStore.from_schema(
        {"tag": ([3], torch.int64), "obs": ([8], torch.float32)}, batch_size=[capacity], chunk_bytes=40, **conn
    )
    assert store.chunk_bytes == 40
    results = list(pool.map(w.appender, [conn] * 4, [store.td_id] * 4, range(4), [count] * 4, [rows] * 4))
    indices = [i for r in results for i in r]
    final = store.to_tensordict()
    tags = {tuple(t) for t in final["tag"].tolist()}
    expected = {(p, s, i) for p in range(4) for s in range(count) for i in range(rows)}
    obs = final["obs"]
    torn = int(((obs != obs[:, :1]).any(dim=1) | (obs[:, 0] != (final["tag"][:, 0] * 1000 + final["tag"][:, 1]).float())).sum())
    dup, gaps = len(indices) - len(set(indices)), len(expected - tags)
    _record(request, rows_appended=len(indices), duplicate_rows=dup, gaps=gaps, torn_rows=torn)
    assert (dup, gaps, torn) == (0, 0, 0)
    store.clear_redis()
    store.close()


# --------------------------------------------------------------------------- Redis Cluster


def test_chunked_store_on_a_cluster(cluster_server, request):
    """Every chunk in the store's slot: scripts and transactions over many chunks stay legal on a cluster."""
    rng = random.Random(7)
    conn = cluster_server.connection_kwargs()
    ref = _rand_td(rng, 24)
    ref["big"] = torch.randn(24, 50)
    store = TensorDictStore.from_tensordict(ref.clone(), chunk_bytes=64, **conn)
    try:
        _equal(store, ref)
        for _ in range(10):
            idx = _rand_index(rng, 24, unique=True)
            sub = ref[idx]
            value = TensorDict({k: rand_tensor(rng, tuple(v.shape), v.dtype) for k, v in sub.items(True, True)}, batch_size=sub.batch_size)
            store[idx] = value
            ref[idx] = value
            got = store[_rand_index(rng, 24)]
            assert set(got.keys(True, True)) == set(ref.keys(True, True))
        _equal(store, ref)
        ring = TensorDictStore.from_schema({"x": ([6], torch.float32)}, batch_size=[10], chunk_bytes=48, **conn)
        ring.extend(TensorDict(x=torch.ones(7, 6), batch_size=[7]))
        rows = ring.extend(TensorDict(x=torch.full((7, 6), 2.0), batch_size=[7]))  # wraps: 7..9, 0..3
        assert rows.tolist() == [7, 8, 9, 0, 1, 2, 3]
        assert ring["x"][:, 0].tolist() == [2.0] * 4 + [1.0] * 3 + [2.0] * 3
        ring.clear_redis()
        ring.close()
    finally:
        store.clear_redis()
        store.close()


def test_sharded_blocks_take_the_chunking(real_server):
    """ShardedStore passes chunk_bytes to its blocks: row blocks over stores, chunks within each."""
    conn = real_server.connection_kwargs()
    buf = tdstore.ShardedStore.from_schema({"obs": ([16], torch.float32)}, batch_size=[100], block_rows=40, chunk_bytes=256, **conn)
    try:
        assert [b.chunk_bytes for b in buf.blocks] == [256, 256, 256]
        buf[30:50] = {"obs": torch.ones(20, 16)}
        assert int(buf[[29, 30, 49, 50]]["obs"].sum()) == 2 * 16
        client = real_server.sync_client()
        assert client.exists(f"tensordict:{{{buf.blocks[0].td_id}}}:c:2:obs") == 1  # 40 rows of 64 bytes in chunks of 4 rows
        client.close()
    finally:
        buf.clear_redis()
        buf.close()


def test_lazy_stack_refuses_chunk_bytes(server):
    from tensordict import LazyStackedTensorDict

    lazy = LazyStackedTensorDict(TensorDict(x=torch.ones(3)), TensorDict(x=torch.zeros(3)))
    with pytest.raises(tdstore.UnsupportedOperationError, match="takes no chunk_bytes"):
        TensorDictStore.from_tensordict(lazy, chunk_bytes=64, **server.connection_kwargs())


def test_cli_info_and_ls_count_every_chunk(real_server):
    """`tdstore info` shows the chunking, and an entry's bytes are the sum of its chunks (STRLEN each)."""
    import io
    import json

    from test_cli import conn_args

    from tdstore.cli import main

    store = TensorDictStore.from_tensordict(
        TensorDict(big=torch.ones(10, 8), small=torch.ones(10), batch_size=[10]), chunk_bytes=96, td_id="cli-chunked",
        **real_server.connection_kwargs(),
    )
    try:
        out = io.StringIO()
        assert main(["info", "cli-chunked", "--json", *conn_args(real_server)], out=out, stdin=io.StringIO("")) == 0
        info = json.loads(out.getvalue())
        assert info["chunking"] == {"chunk_bytes": 96, "chunked_entries": 1}
        assert {e["key"][0]: e["bytes"] for e in info["entries"]} == {"big": 320, "small": 40}
        out = io.StringIO()
        assert main(["ls", "--json", *conn_args(real_server)], out=out, stdin=io.StringIO("")) == 0
        listed = {s["td_id"]: s for s in json.loads(out.getvalue())["stores"]}
        assert listed["cli-chunked"]["bytes"] == 360
    finally:
        store.clear_redis()
        store.close()


def test_long_allocation_keeps_its_chunks_alive(server, monkeypatch):
    """The tmp keys of chunks grown early get their TTL again while later chunks grow: an
    allocation longer than the TTL still commits (here: a 1 s TTL, chunks grown 0.15 s apart)."""
    import asyncio

    from tdstore._backend import ops as _backend
    from tdstore._backend import transfer as _transfer

    grow = _transfer.grow_zeros

    async def slow_grow(*args, **kwargs):
        await asyncio.sleep(0.15)
        await grow(*args, **kwargs)

    monkeypatch.setattr(_backend, "TMP_TTL_MS", 1000)
    monkeypatch.setattr(_transfer, "REFRESH_S", 0.25)
    monkeypatch.setattr(_transfer, "grow_zeros", slow_grow)
    store = TensorDictStore.from_schema({"x": ([16], torch.uint8)}, batch_size=[160], chunk_bytes=256, **server.connection_kwargs())
    assert torch.equal(store["x"], torch.zeros(160, 16, dtype=torch.uint8))  # 10 chunks, 1.5 s
    store.clear_redis()
    store.close()
