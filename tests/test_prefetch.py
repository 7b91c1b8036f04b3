"""tdstore.replay.Prefetcher: store.sample batches drawn ahead by threads of its own, on real
servers; each batch checked against the rows it says it holds, priorities updated while
batches are in flight, errors, close and garbage collection."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore.replay import Prefetcher
from tdstore.replay import priorities as _priorities

N = 500


def reference(n: int = N) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    return TensorDict(
        obs=torch.randint(0, 256, (n, 16, 16, 3), dtype=torch.uint8, generator=g),
        r=torch.arange(n, dtype=torch.float32),
        batch_size=[n],
    )


@pytest.fixture
def ring(real_server):
    store = TensorDictStore.from_schema(
        {"obs": ([16, 16, 3], torch.uint8), "r": ([], torch.float32)}, batch_size=[N], **real_server.connection_kwargs()
    )
    ref = reference()
    store.extend(ref)
    yield store, ref
    store.clear_redis()
    store.close()


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tdstore-prefetch-")]


def wait_gone(timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    return not prefetch_threads()


@pytest.mark.parametrize("in_flight", [1, 2, 4])
def test_uniform_batches_hold_the_rows_they_name(ring, in_flight):
    store, ref = ring
    with Prefetcher(store, 64, return_info=True, in_flight=in_flight) as it:
        seen = torch.zeros(N, dtype=torch.bool)
        for _ in range(25):
            batch, info = next(it)
            assert batch.batch_size == torch.Size([64])
            assert torch.equal(batch["obs"], ref["obs"][info["index"]]) and torch.equal(batch["r"], ref["r"][info["index"]])
            seen[info["index"]] = True
        assert len(prefetch_threads()) == in_flight
    assert wait_gone()
    assert int(seen.sum()) > 0.9 * N  # (25 x 64 draws over 500 rows: about 96% of them, uniform)


def test_batches_without_info_and_a_seeded_single_thread_repeat(ring):
    store, ref = ring
    runs = []
    for _ in range(2):
        with Prefetcher(store, 32, in_flight=1, generator=torch.Generator().manual_seed(7)) as it:
            runs.append([next(it)["r"].clone() for _ in range(5)])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)  # (one thread, one seeded generator: the same draws)
    assert all(bool((x >= 0).all() and (x < N).all()) for x in runs[0])


def test_prioritized_rounds_update_while_batches_are_in_flight(ring):
    store, ref = ring
    store.enable_priorities(alpha=0.6, beta=0.4)
    g = torch.Generator().manual_seed(1)
    applied = 0
    with Prefetcher(store, 64, prioritized=True, in_flight=2) as it:
        for _ in range(30):
            batch, info = next(it)
            assert set(info) >= {"index", "_weight", "generation"}
            assert torch.equal(batch["r"], ref["r"][info["index"]])
            assert bool((info["_weight"] > 0).all() and (info["_weight"] <= 1 + 1e-6).all())
            ok = store.update_priority(info["index"], torch.rand(64, generator=g) * 5, generation=info["generation"])
            applied += int(ok.sum())
    assert applied == 30 * 64  # (no append in between: no generation moved)
    report = _priorities.tree_report(store)
    assert report is not None and report["problems"] == []


def test_an_error_of_a_sample_is_raised_by_next_and_closes(real_server):
    empty = TensorDictStore.from_schema({"x": ([], torch.float32)}, batch_size=[10], **real_server.connection_kwargs())
    try:
        it = Prefetcher(empty, 4, prioritized=True)
        with pytest.raises(ValueError, match="priorities are off"):
            next(it)
        with pytest.raises(StopIteration):
            next(it)
        assert wait_gone()
    finally:
        empty.clear_redis()
        empty.close()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_size": 0}, "batch_size must be an int >= 1"),
        ({"batch_size": 2.5}, "batch_size must be an int >= 1"),
        ({"batch_size": 8, "in_flight": 0}, "in_flight must be an int from 1 to 16"),
        ({"batch_size": 8, "in_flight": 17}, "in_flight must be an int from 1 to 16"),
        ({"batch_size": 8, "in_flight": True}, "in_flight must be an int from 1 to 16"),
    ],
)
def test_bad_arguments_start_nothing(ring, kwargs, match):
    store, _ = ring
    before = len(prefetch_threads())
    with pytest.raises(ValueError, match=match) as err:
        Prefetcher(store, **kwargs)
    assert store.td_id in str(err.value)
    assert len(prefetch_threads()) == before


def test_close_and_garbage_collection_stop_the_threads(ring):
    store, _ = ring
    it = Prefetcher(store, 16, in_flight=3)
    next(it)
    it.close()
    assert wait_gone()
    with pytest.raises(StopIteration):
        next(it)
    it = Prefetcher(store, 16, in_flight=2)
    next(it)
    del it
    gc.collect()
    assert wait_gone()  # (the threads hold the store, not the Prefetcher: its finalizer stops them)


def test_a_sharded_ring_prefetches_samples_of_the_union(real_server):
    from tdstore import ShardedStore

    buf = ShardedStore.from_schema({"r": ([], torch.float32)}, batch_size=[40], block_rows=10, **real_server.connection_kwargs())
    try:
        for shard in range(4):  # (rows r = 10 * shard + i hold r: each batch row names its own index)
            buf.extend(TensorDict(r=torch.arange(10 * shard, 10 * shard + 10, dtype=torch.float32), batch_size=[10]), shard=shard)
        counts = torch.zeros(4)
        with Prefetcher(buf, 50, return_info=True, in_flight=2) as it:
            for _ in range(20):
                batch, info = next(it)
                assert torch.equal(batch["r"], info["index"].float())
                counts += torch.bincount(info["index"] // 10, minlength=4)
        assert bool((counts > 150).all())  # (1,000 draws over 4 equal shards: 250 each expected)
    finally:
        buf.clear_redis()
        buf.close()
    assert wait_gone()
