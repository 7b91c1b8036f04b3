"""Threads sharing one handle, and handles whose cached layout is stale.

* threads of one process may share a handle: the cached layout never goes back to an older
  version (a thread reads its own writes), and is never seen half-updated;
* a stale cache never refuses an operation: a missing key or a shape that does not fit is
  checked against the server's layout version first.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore.errors import EntryNotFoundError

# --------------------------------------------------------------------------- #
# 1. one handle, many threads
# --------------------------------------------------------------------------- #


def _run_threads(targets, seconds):
    errors: list[BaseException] = []
    stop = threading.Event()

    def wrap(fn):
        def body():
            try:
                fn(stop)
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)
                stop.set()

        return body

    threads = [threading.Thread(target=wrap(fn), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return errors


def test_shared_handle_read_your_writes(server):
    """Thread W writes then deletes its own keys while threads R read through the same handle:
    W's delete never finds its key missing (a concurrent read cached an older layout), and
    keys()/len()/batch_size never see the cache as None mid-update."""
    store = TensorDictStore(batch_size=[2], **server.connection_kwargs())
    store["base"] = torch.zeros(2)
    done = {"w": 0, "r": 0}

    def writer(stop, name):
        for i in range(400):
            if stop.is_set():
                return
            key = f"{name}{i}"
            store[key] = torch.ones(2)
            assert key in store.keys()
            store.del_(key)
            done["w"] += 1

    def reader(stop):
        for _ in range(4000):
            if stop.is_set():
                return
            store.keys()
            list(store.keys())
            assert len(store) == 2
            assert store.batch_size == torch.Size([2])
            assert "base" in store.keys()
            assert (store["base"] == 0).all()
            done["r"] += 1

    errors = _run_threads(
        [lambda s: writer(s, "a"), lambda s: writer(s, "b"), reader, reader, reader], seconds=4
    )
    assert not errors, errors[:3]
    assert done["w"] > 20 and done["r"] > 20, done
    assert sorted(store.keys()) == ["base"]
    store.clear_redis()


def test_cache_never_goes_back(server):
    """The cache refuses a layout read before a write of another thread (deterministic)."""
    from tdstore._backend import ops as _backend

    store = TensorDictStore(batch_size=[], **server.connection_kwargs())
    store["a"] = torch.zeros(())
    conn = store._conn
    old = store._layout(refresh=True)
    epoch = conn.layout_epoch
    store["b"] = torch.zeros(())  # another thread's write: drops the cache
    new = store._layout()
    assert new.lv > old.lv and ("b",) in new.entries
    assert not conn.cache_layout(old, epoch)  # the slow reader's layout comes too late
    assert conn.layout is new
    conn.layout = old  # a direct set of an older layout is refused too
    assert conn.layout is new
    store.del_("b")  # planned from the cache: finds "b"
    assert list(store.keys()) == ["a"]
    assert _backend.FORMAT_VERSION
    store.clear_redis()


# --------------------------------------------------------------------------- #
# 2. a stale cache does not refuse
# --------------------------------------------------------------------------- #


@pytest.fixture(params=["dense", "lazy"])
def kind(request):
    return request.param


def _pair(kind, server, **kw):
    if kind == "dense":
        a = TensorDictStore(batch_size=[4, 3], **server.connection_kwargs(), **kw)
        a["x"] = torch.zeros(4, 3)
        b = TensorDictStore.from_store(td_id=a.td_id, **server.connection_kwargs())
    else:
        from tensordict import LazyStackedTensorDict, TensorDict

        a = LazyStackedTensorDictStore.from_lazy_stack(
            LazyStackedTensorDict(*[TensorDict({"x": torch.zeros(3)}, [3]) for _ in range(4)]),
            **server.connection_kwargs(),
        )
        b = LazyStackedTensorDictStore.from_store(td_id=a.td_id, **server.connection_kwargs())
    a.keys()  # fills a's cache
    list(a.keys())
    return a, b


@pytest.mark.parametrize("op", ["del_", "rename_key_", "update_", "set_", "getitem"])
def test_stale_cache_does_not_refuse_a_missing_key(server, kind, op):
    a, b = _pair(kind, server)
    b["k"] = b["x"].clone() + 1
    if op == "del_":
        a.del_("k")
        assert "k" not in b.keys()
    elif op == "rename_key_":
        a.rename_key_("k", "k2")
        assert "k2" in b.keys() and "k" not in b.keys()
    elif op == "update_" and kind == "lazy":
        from tdstore.errors import UnsupportedOperationError

        with pytest.raises(UnsupportedOperationError):  # not a lazy store method at all
            a.update_({"k": torch.full_like(b["x"], 5.0)})
    elif op == "update_":
        a.update_({"k": torch.full_like(b["x"], 5.0)})
        assert (b["k"] == 5).all()
    elif op == "set_":
        a.set_("k", torch.full_like(b["x"], 6.0))
        assert (b["k"] == 6).all()
    else:
        assert (a["k"] == 1).all()
    a.clear_redis()


def test_missing_key_still_refused(server, kind, wire):
    a, _ = _pair(kind, server)
    before = wire(server)
    with pytest.raises(EntryNotFoundError, match="nope"):
        a.del_("nope")
    with pytest.raises(KeyError, match="nope"):
        a.rename_key_("nope", "other")
    assert wire(server) == before
    a.clear_redis()


def test_stale_batch_size_does_not_refuse(server):
    a, b = _pair("dense", server)
    b.batch_size = [4]
    a["y"] = torch.ones(4)
    assert b["y"].shape == (4,)
    assert a.batch_size == torch.Size([4])
    with pytest.raises(RuntimeError, match="batch"):
        a["z"] = torch.ones(5)  # the fresh layout agrees: refused
    a.clear_redis()


# --------------------------------------------------------------------------- #
# 3. an indexed write of a non-tensor entry races a whole write of it
# --------------------------------------------------------------------------- #


def test_nontensor_index_write_races_whole_writes(server):
    """Metadata and bytes of a non-tensor entry are read in two commands before a row write:
    a whole write in between pairs them wrongly; that is a stale read, retried, never a raw
    IndexError."""
    from tensordict import NonTensorData, NonTensorStack

    store = TensorDictStore(batch_size=[3], **server.connection_kwargs())
    store["nt"] = NonTensorData("a", batch_size=[3])
    other = TensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs())
    counts = {"whole": 0, "rows": 0}

    def whole(stop):
        for i in range(600):
            if stop.is_set():
                return
            if i % 2:
                other["nt"] = NonTensorStack.from_list([f"s{i}", f"t{i}", f"u{i}"])  # one value per row
            else:
                other["nt"] = NonTensorData("w", batch_size=[3])  # a str: iterable, one char
            counts["whole"] += 1

    def rows(stop):
        for i in range(600):
            if stop.is_set():
                return
            store[i % 3] = TensorDict({"nt": NonTensorData(f"r{i}", batch_size=[])}, [])
            counts["rows"] += 1

    errors = _run_threads([whole, rows], seconds=4)
    assert not errors, [f"{type(e).__name__}: {e}" for e in errors[:3]]
    assert counts["rows"] > 10 and counts["whole"] > 10, counts
    store.clear_redis()


# --------------------------------------------------------------------------- #
# 4. readers under layout churn
# --------------------------------------------------------------------------- #


def test_one_step_read_matches(server, monkeypatch):
    """The one-step fallback of to_tensordict() reads what the optimistic read reads."""
    from tensordict import NonTensorData

    import tdstore.store.reads as reads
    from tdstore._backend import ops as _ops

    store = TensorDictStore(batch_size=[3], **server.connection_kwargs())
    store["x"] = torch.arange(6.0).reshape(3, 2)
    store["n", "y"] = torch.ones(3, dtype=torch.int64)
    store["s"] = NonTensorData("hi", batch_size=[3])
    expected = store.to_tensordict()
    got, snap = store._snapshot_one_step()
    assert (got == expected).all() and got["s"] == "hi" and snap.lv == store._layout().lv
    assert (store["n"]._snapshot_one_step()[0]["y"] == 1).all()  # a nested handle: its part only
    monkeypatch.setattr(reads, "ONE_STEP_AFTER", 0)
    assert (store.to_tensordict() == expected).all()
    for index in (1, slice(0, 2), [2, 0], -1):  # indexed reads: read whole, indexed in memory
        assert (store[index] == expected[index]).all(), index
    assert store[1]["s"] == "hi"
    monkeypatch.setattr(_ops, "READ_ALL_MAX_BYTES", 8)  # the store holds more: optimistic reads only
    assert store._snapshot_one_step() is None
    assert (store.to_tensordict() == expected).all() and (store[1] == expected[1]).all()
    store.clear_redis()
    with pytest.raises(KeyError):
        store._snapshot_one_step()


def _count_data_reads(monkeypatch) -> list[int]:
    """Counts the data reads (a MULTI of the entries, or one read_all script call) of this
    process: instrumented, not replaced. Only the reader thread reads entries here."""
    import tdstore._backend.ops as _ops

    count = [0]
    for name in ("read_entries", "read_entries_direct", "read_all"):
        real = getattr(_ops, name, None)
        if real is None:
            continue
        if asyncio.iscoroutinefunction(real):

            async def counted(*args, _real=real, **kwargs):
                count[0] += 1
                return await _real(*args, **kwargs)

        else:

            def counted(*args, _real=real, **kwargs):
                count[0] += 1
                return _real(*args, **kwargs)

        monkeypatch.setattr(_ops, name, counted)
    return count


def test_reads_are_not_starved_by_layout_churn(server, monkeypatch):
    """Writers add and delete keys as fast as they can; whole-store reads still finish
    (after a few optimistic tries they read in one step) and never give up: each needs at
    most ONE_STEP_AFTER + 1 data reads."""
    store = TensorDictStore(batch_size=[2], **server.connection_kwargs())
    store["base"] = torch.zeros(2)
    writers = [TensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs()) for _ in range(2)]
    latencies: list[float] = []
    count = _count_data_reads(monkeypatch)
    most = [0]

    def churn(handle, name):
        def body(stop):
            for i in range(5000):
                if stop.is_set():
                    return
                handle[f"{name}{i}"] = torch.ones(2)
                handle.del_(f"{name}{i}")

        return body

    def reader(stop):
        for _ in range(2000):
            if stop.is_set():
                return
            t0 = time.perf_counter()
            before = count[0]
            td = store.to_tensordict()
            most[0] = max(most[0], count[0] - before)
            latencies.append(time.perf_counter() - t0)
            assert (td["base"] == 0).all() and td.batch_size == torch.Size([2])

    errors = _run_threads([churn(writers[0], "a"), churn(writers[1], "b"), reader], seconds=4)
    assert not errors, [f"{type(e).__name__}: {e}" for e in errors[:3]]
    assert len(latencies) > 5 and max(latencies) < 5.0, (len(latencies), max(latencies))
    assert 1 <= most[0] <= 4, f"a read made {most[0]} data reads (3 optimistic tries, then one step)"
    store.clear_redis()


def test_lazy_one_step_read_matches(server, monkeypatch):
    from tensordict import LazyStackedTensorDict

    import tdstore.lazy.reads as lazy_reads

    elems = [TensorDict({"x": torch.arange(i + 1.0), "s": f"e{i}", "n": {"y": torch.full((2,), i)}}, []) for i in range(3)]
    store = LazyStackedTensorDictStore.from_lazy_stack(LazyStackedTensorDict(*elems), **server.connection_kwargs())
    expected = store.to_tensordict()
    monkeypatch.setattr(lazy_reads, "ONE_STEP_AFTER", 0)
    got = store.to_tensordict()
    for i in range(3):
        assert (got[i]["x"] == expected[i]["x"]).all() and got[i]["s"] == f"e{i}"
        assert (got[i]["n", "y"] == i).all()
    store.clear_redis()


def test_threads_making_the_direct_client_at_once_share_one(real_server, monkeypatch):
    """Threads that first use a handle at the same moment get one direct client: two made at
    once left the loser's client in use by the thread that got it, with a connection armed in
    the store's slot from a pool the store no longer holds (test_fast_paths then counted two
    connections held). Making a pool is slowed down (2 ms) so that the threads overlap."""
    import redis

    store = TensorDictStore(batch_size=[4], **real_server.connection_kwargs())
    store["x"] = torch.zeros(4)
    conn = store._conn

    class SlowPool(redis.ConnectionPool):
        def __init__(self, *args, **kwargs):
            time.sleep(0.002)  # releases the GIL, as a real first connect would
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(redis, "ConnectionPool", SlowPool)
    clients = []
    for _ in range(20):  # bounded: 20 rounds of 8 threads
        conn._direct = None  # as on a handle's first direct call
        barrier = threading.Barrier(8)
        got: list = []

        def first_use(barrier=barrier, got=got):
            barrier.wait(10)
            got.append(conn.direct_client())

        threads = [threading.Thread(target=first_use) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        clients.append(len({id(c) for c in got}))
    assert clients == [1] * 20, clients
    assert conn.direct_client() is got[0]
    store.clear_redis()
    store.close()
