"""Multi-process guarantees (docs/guarantees.md), each proven by counting violations.

Every test runs 4+ spawned processes against a real server, with loops bounded in count
and time, and records its counts (printed at the end of the run). Every count must be 0.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import _race_workers as w
import pytest
import torch
from fixtures import PoolSpec
from tensordict import NonTensorStack, TensorDict

from tdstore import TensorDictStore
from tdstore.testing.counts import record as _record

pytestmark = pytest.mark.multiprocess

NPROC = 4
DURATION = 1.5


# The tests run on ``race_server`` (tests/fixtures.py): redis-server 7 and valkey-server 8, and,
# for the tests marked ``ALSO_ON_CLUSTER``, a local 3-master Redis Cluster too (the workers
# reconnect with ``cluster_nodes=``).
ALSO_ON_CLUSTER = pytest.mark.parametrize("race_server", ["redis", "valkey", "cluster"], indirect=True)

#: the module's ``pool`` (tests/fixtures.py), its workers warmed up (imports) once for the module
POOL = PoolSpec(workers=NPROC + 1, warm_up=w.warm_up, warm_up_arg=0.5)


@ALSO_ON_CLUSTER
@pytest.mark.parametrize("mode", ["int", "slice", "list", "mask"])
def test_disjoint_rows_never_revert(race_server, pool, request, mode):
    conn = race_server.connection_kwargs()
    store = TensorDictStore.from_schema({"x": ([3], torch.float32), "y": ([], torch.int64)}, batch_size=[16], **conn)
    rounds = 40 if mode == "int" else 200
    reader = pool.submit(w.monotonic_reader, conn, store.td_id, DURATION)
    writers = [pool.submit(w.disjoint_writer, conn, store.td_id, p, NPROC, rounds, mode, 20.0) for p in range(NPROC)]
    written = sum(f.result(60) for f in writers)
    checked, reverts, torn = reader.result(60)
    final = store.to_tensordict()
    lost = int((final["y"] != rounds).sum())
    _record(request, rows_written=written, reverted_reads=f"{reverts}/{checked}", torn_rows=f"{torn}/{checked}", lost_rows=f"{lost}/16")
    assert (reverts, torn, lost) == (0, 0, 0)
    store.clear_redis()
    store.close()


@ALSO_ON_CLUSTER
def test_overlapping_rows_never_torn(race_server, pool, request):
    conn = race_server.connection_kwargs()
    # 8 KB obs rows take the WATCH-guarded MULTI path, 32 B act rows the Lua path, in one step
    store = TensorDictStore.from_schema({"obs": ([1024], torch.float64), "act": ([4], torch.int64)}, batch_size=[64], **conn)
    store["tag"] = NonTensorStack(*["w0"] * 64)  # rows start as obs=0, act=0, tag="w0"
    readers = [pool.submit(w.row_reader, conn, store.td_id, DURATION, s) for s in range(1)]
    writers = [pool.submit(w.const_writer, conn, store.td_id, p, 10_000, DURATION) for p in range(NPROC)]
    writes = sum(f.result(60) for f in writers)
    checked = torn = 0
    for f in readers:
        c, t = f.result(60)
        checked, torn = checked + c, torn + t
    _record(request, writes=writes, torn_reads=f"{torn}/{checked}")
    assert torn == 0 and checked > 0 and writes > 0
    store.clear_redis()
    store.close()


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "nocache"])
def test_replaced_entry_never_misread(race_server, pool, request, cache):
    conn = race_server.connection_kwargs()
    store = TensorDictStore(batch_size=[8], **conn)
    store["x"] = torch.full((8, 1), 1, dtype=w.DTYPES[1])
    readers = [pool.submit(w.shape_reader, conn, store.td_id, DURATION, cache) for _ in range(2)]
    writers = [pool.submit(w.replacer, conn, store.td_id, 100_000, DURATION) for _ in range(NPROC - 1)]
    replaced = sum(f.result(60) for f in writers)
    checked = wrong = 0
    for f in readers:
        c, x = f.result(60)
        checked, wrong = checked + c, wrong + x
    _record(request, replacements=replaced, misread=f"{wrong}/{checked}")
    assert wrong == 0 and checked > 0 and replaced > 0
    store.clear_redis()
    store.close()


def test_concurrent_new_keys_all_visible(race_server, pool, request):
    conn = race_server.connection_kwargs()
    store = TensorDictStore(batch_size=[3], **conn)
    store["seed"] = torch.zeros(3)
    already_open = TensorDictStore.from_store(td_id=store.td_id, **conn)
    assert list(already_open.keys()) == ["seed"]  # its cache is filled before the writes
    count = 25
    list(pool.map(w.key_creator, [conn] * NPROC, [store.td_id] * NPROC, range(NPROC), [count] * NPROC))
    expected = {f"p{p}_{j}": p * 1000 + j for p in range(NPROC) for j in range(count)} | {"seed": 0}
    missing = 0
    for handle in (TensorDictStore.from_store(td_id=store.td_id, **conn), already_open):
        keys = set(handle.keys())
        missing += len(set(expected) - keys)
        local = handle.to_tensordict()
        missing += sum(int(not torch.equal(local[k], torch.full((3,), v, dtype=local[k].dtype))) for k, v in expected.items() if k in keys)
    _record(request, keys_created=NPROC * count, missing_or_wrong=missing)
    assert missing == 0
    store.clear_redis()
    store.close()


@ALSO_ON_CLUSTER
def test_read_modify_write_loses_no_update(race_server, pool, request):
    conn = race_server.connection_kwargs()
    store = TensorDictStore(batch_size=[4], **conn)
    store["n", "a"] = torch.zeros(4)
    store["n", "b"] = torch.zeros(4, 2, dtype=torch.int64)
    store["z", "v"] = torch.zeros(4)
    count = 15
    incrementers = NPROC - 1
    blind = pool.submit(w.blind_writer, conn, store.td_id, 0, 3 * count)
    list(pool.map(w.rmw_worker, [conn] * incrementers, [store.td_id] * incrementers, range(incrementers), [count] * incrementers))
    blind.result(120)
    total = incrementers * count
    lost = int((store["n", "a"] != total).sum()) + int((store["n", "b"] != total).sum())
    _record(request, increments=total, blind_writes=3 * count, lost_updates=lost, final=int(store["n", "a"][0]))
    assert lost == 0
    store.clear_redis()
    store.close()


def test_lock_stops_every_process(race_server, pool, request):
    conn = race_server.connection_kwargs()
    store = TensorDictStore(batch_size=[2], **conn)
    store["a"] = torch.zeros(2)
    store.lock_()
    through = sum(pool.map(w.locked_writer, [conn] * NPROC, [store.td_id] * NPROC, range(NPROC), [5] * NPROC))
    store.unlock_()
    after = sum(pool.map(w.locked_writer, [conn] * NPROC, [store.td_id] * NPROC, range(NPROC), [2] * NPROC))
    _record(request, writes_through_lock=f"{through}/{NPROC * 5}", writes_after_unlock=f"{after}/{NPROC * 2}")
    assert through == 0 and after == NPROC * 2
    store.clear_redis()
    store.close()


@ALSO_ON_CLUSTER
def test_concurrent_appends_get_disjoint_rows(race_server, pool, request):
    conn = race_server.connection_kwargs()
    count, rows = 20, 3
    capacity = NPROC * count * rows
    store = TensorDictStore.from_schema({"tag": ([3], torch.int64), "obs": ([8], torch.float32)}, batch_size=[capacity], **conn)
    results = list(pool.map(w.appender, [conn] * NPROC, [store.td_id] * NPROC, range(NPROC), [count] * NPROC, [rows] * NPROC))
    indices = [i for r in results for i in r]
    duplicates = len(indices) - len(set(indices))
    final = store.to_tensordict()
    tags = {tuple(t) for t in final["tag"].tolist()}
    expected = {(p, s, i) for p in range(NPROC) for s in range(count) for i in range(rows)}
    gaps = len(expected - tags)
    torn = int(((final["obs"] != final["obs"][:, :1]).any(dim=1) | (final["obs"][:, 0] != (final["tag"][:, 0] * 1000 + final["tag"][:, 1]).float())).sum())
    state = store.ring_state()
    _record(request, rows_appended=len(indices), duplicate_rows=duplicates, gaps=gaps, torn_rows=torn, valid=state.valid)
    assert (duplicates, gaps, torn) == (0, 0, 0)
    assert state.valid == capacity and state.total == capacity
    store.clear_redis()
    store.close()


def test_sigkill_mid_write_leaves_all_or_nothing(race_server, request):
    conn = race_server.connection_kwargs()
    size = 2 * 1024 * 1024  # 8 MB per entry: the kill lands mid-transfer
    store = TensorDictStore(batch_size=[], **conn)
    store.update({"a": torch.zeros(size, dtype=torch.int32), "b": torch.zeros(size, dtype=torch.int32)})
    ctx = multiprocessing.get_context("spawn")
    rng = random.Random(0)
    mixed = orphans = 0
    kills = 4
    seen: list[int] = []  # the counter each kill left
    for _ in range(kills):
        started = ctx.Event()
        proc = ctx.Process(target=w.killed_writer, args=(conn, store.td_id, size, started))
        proc.start()
        assert started.wait(60), "the writer did not start"
        time.sleep(rng.uniform(0.05, 1.0))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        a, b = store["a"], store["b"]
        if not (bool((a == a[0]).all()) and bool((b == a[0]).all())):
            mixed += 1
        seen.append(int(a[0]))
        orphans += len(race_server.sync_client().keys(f"*{store.td_id}*:tmp:*"))
    _record(request, kills=kills, mixed_states=mixed, orphan_tmp_keys=orphans, counters_left=seen)
    assert mixed == 0 and orphans == 0
    # the writers kept writing after they signalled (at 2): the kills landed mid-run. (Any
    # kill, not the last: with 4096-byte chunks, one write of 2 x 8 MB can outlast the
    # shortest wait on a loaded 2-core machine.)
    assert max(seen) > 2
    store.clear_redis()
    store.close()


@ALSO_ON_CLUSTER
def test_fork_dataloader_workers(race_server, request):
    from torch.utils.data import DataLoader, Dataset

    conn = race_server.connection_kwargs()
    store = TensorDictStore(batch_size=[32], **conn)
    store["x"] = torch.arange(32)

    class Rows(Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            return store[i]["x"]

    loader = DataLoader(Rows(), batch_size=4, num_workers=2, multiprocessing_context="fork")
    got = torch.cat(list(loader))
    wrong = int((got != torch.arange(32)).sum())
    _record(request, rows_read=32, wrong=wrong)
    assert wrong == 0
    store["after"] = torch.ones(32)  # the parent's connection still works after the workers
    assert torch.equal(store["after"], torch.ones(32))
    store.clear_redis()
    store.close()


def test_lock_blocks_in_place_free_layout_changes_only(race_server):
    """Documents the lock semantics: layout changes refused, in-place writes allowed."""
    conn = race_server.connection_kwargs()
    store = TensorDictStore(batch_size=[2], **conn)
    store["a"] = torch.zeros(2)
    store.lock_()
    other = TensorDictStore.from_store(td_id=store.td_id, **conn)
    with pytest.raises(RuntimeError, match="locked"):
        other.del_("a")
    other[0] = TensorDict(a=torch.tensor(5.0), batch_size=[])
    assert torch.equal(store["a"], torch.tensor([5.0, 0.0]))
    store.unlock_()
    store.clear_redis()
    store.close()
