"""TorchRL buffers over a :class:`tdstore.ShardedStore` on a 3-master cluster (``tdstore.torchrl.sharded``).

``ShardedStoreStorage``, ``ShardedStoreWriter`` and ``ShardedStorePrioritizedSampler`` in
TorchRL's buffer classes, on a real local cluster (Valkey and Redis, one module-scoped
cluster each) whose td_id puts one shard on each master. What the shards hold is read back
through handles of their own (each block store, its priority tree) and plain clients of the
masters.

Like tests/test_torchrl.py, they need TorchRL and run in the tensordict 0.14.3 environment
of ``.ci/run`` (``-m torchrl``); the main run deselects them.
"""

from __future__ import annotations

import math
import pickle
import re
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _torchrl_workers as w
import pytest
import torch
from fixtures import PoolSpec
from tensordict import TensorDict
from test_priorities import chi_square_p
from test_sharded_ring import _spread_td_id

from tdstore import ShardedStore, TensorDictStore
from tdstore.replay.priorities import tree_report
from tdstore.server import start_cluster

pytestmark = pytest.mark.torchrl

ALPHA, BETA, EPS = 0.7, 0.5, 1e-8
BLOCK = 10  # rows per shard: three shards of 10 rows
ROWS = 3 * BLOCK

#: the module's ``pool`` (tests/fixtures.py): one process that samples the pickled buffer
POOL = PoolSpec(workers=1, warm_up=w.warm_up, warm_up_arg=0.3)


@pytest.fixture(scope="module", params=["valkey", "redis"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A local 3-master cluster (no replicas) for the whole module."""
    with start_cluster(masters=3, replicas=0, kind=request.param) as handle:
        yield handle


@pytest.fixture(autouse=True)
def _flushed(cluster: Any) -> Iterator[None]:
    yield
    cluster.flushall()


@pytest.fixture
def rl() -> dict[str, Any]:
    """The torchrl names the tests use (imported here: the main environment has no torchrl)."""
    import torchrl.data as data

    import tdstore.torchrl as tds

    return {
        "ReplayBuffer": data.ReplayBuffer,
        "TensorDictReplayBuffer": data.TensorDictReplayBuffer,
        "PrioritizedReplayBuffer": data.PrioritizedReplayBuffer,
        "TensorDictPrioritizedReplayBuffer": data.TensorDictPrioritizedReplayBuffer,
        "Storage": tds.ShardedStoreStorage,
        "Writer": tds.ShardedStoreWriter,
        "Sampler": tds.ShardedStorePrioritizedSampler,
        "StoreStorage": tds.TensorDictStoreStorage,
        "StoreSampler": tds.TensorDictStorePrioritizedSampler,
        "StoreWriter": tds.TensorDictStoreWriter,
        "StorePRB": tds.TensorDictStorePrioritizedReplayBuffer,
        "helper": tds.prioritized_replay_buffer,
    }


def _rows(start: int, n: int) -> TensorDict:
    """Rows whose payload is their serial number ``start + i`` (in every element)."""
    x = torch.arange(start, start + n, dtype=torch.float32)
    return TensorDict(obs=x[:, None].expand(n, 3).clone(), reward=x * 0.5, batch_size=[n])


def _storage(rl: dict[str, Any], cluster: Any, **kw: Any) -> Any:
    td_id = _spread_td_id(cluster, 3)  # one shard on each master
    return rl["Storage"](ROWS, block_rows=BLOCK, td_id=td_id, **cluster.connection_kwargs(), **kw)


def _fill(rb: Any, levels: list[int]) -> torch.Tensor:
    """Appends ``levels[s]`` rows to shard ``s`` (pinned writes); the payload of the row at
    each index, NaN where nothing was appended."""
    payload = torch.full((ROWS,), math.nan, dtype=torch.float64)
    serial = 0
    for shard, n in enumerate(levels):
        if n:
            rb._writer.pin_shard = shard
            index = rb.extend(_rows(serial, n))
            assert torch.div(index, BLOCK, rounding_mode="floor").tolist() == [shard] * n
            payload[index] = torch.arange(serial, serial + n, dtype=torch.float64)
            serial += n
    rb._writer.pin_shard = None
    return payload


def _block(cluster: Any, store: ShardedStore, shard: int) -> TensorDictStore:
    """A handle of its own on shard ``shard``'s store."""
    return TensorDictStore.from_store(td_id=f"{store.td_id}.b{shard}", **cluster.connection_kwargs())


def _leaves(cluster: Any, store: ShardedStore) -> torch.Tensor:
    """The values ``p`` every shard's tree holds, in the buffer's row order (own handles)."""
    parts = []
    for shard in range(store.num_blocks):
        block = _block(cluster, store, shard)
        try:
            report = tree_report(block)
        finally:
            block.close()
        assert report is not None and report["problems"] == []
        parts.append(torch.as_tensor(report["leaves"], dtype=torch.float64).reshape(-1)[:BLOCK])
    return torch.cat(parts)


def _wire(cluster: Any) -> dict[tuple[int, bytes], bytes]:
    """Every key of every master with its DUMP (the state of the servers, byte for byte)."""
    state = {}
    for node in range(cluster.masters):
        client = cluster.node_client(node)
        try:
            for key in client.scan_iter(count=1000):
                state[(node, key)] = client.dump(key)
        finally:
            client.close()
    return state


def _p(q: torch.Tensor) -> torch.Tensor:
    return (q.to(torch.float64) + EPS) ** ALPHA


# --------------------------------------------------------------------------- appends and reads
def test_extend_returns_global_indices_on_their_shards(cluster, rl):
    storage = _storage(rl, cluster)
    rb = rl["TensorDictReplayBuffer"](storage=storage, writer=rl["Writer"](), batch_size=64)
    store = None
    written = torch.full((ROWS,), math.nan, dtype=torch.float64)
    shards_seen = []
    for call in range(6):  # round robin: each shard twice
        index = rb.extend(_rows(100 * call, 4))
        store = rb.storage.store
        shard = int(index[0]) // BLOCK
        assert torch.div(index, BLOCK, rounding_mode="floor").tolist() == [shard] * 4
        shards_seen.append(shard)
        written[index] = torch.arange(100 * call, 100 * call + 4, dtype=torch.float64)
    assert isinstance(store, ShardedStore) and store.block_rows == BLOCK and store.num_blocks == 3
    assert sorted(shards_seen) == [0, 0, 1, 1, 2, 2] and shards_seen[:3] == shards_seen[3:]
    # the shards are on three different masters
    assert len({cluster.node_of_store(f"{store.td_id}.b{s}") for s in range(3)}) == 3
    # each row is on the shard of index // block_rows, at index % block_rows (own handles)
    for shard in range(3):
        block = _block(cluster, store, shard)
        try:
            got = block[:8]["obs"][:, 0].double()
        finally:
            block.close()
        assert torch.equal(got, written[shard * BLOCK : shard * BLOCK + 8])
    assert len(rb) == 24 == store.ring_state().valid
    # a pinned writer appends to its shard only
    pinned = rl["ReplayBuffer"](storage=storage, writer=rl["Writer"](pin_shard=2), batch_size=8)
    index = pinned.extend(_rows(900, 2))
    assert index.tolist() == [28, 29]
    written[index] = torch.tensor([900.0, 901.0], dtype=torch.float64)
    # samples: valid rows, each with the payload written at its index
    for _ in range(5):
        batch = rb.sample()
        index = batch["index"]
        assert batch.batch_size == torch.Size([64])
        assert not bool(torch.isnan(written[index]).any())  # only rows appended
        assert torch.equal(batch["obs"][:, 0].double(), written[index])
        assert torch.equal(batch["obs"][:, 1], batch["obs"][:, 0])  # rows read whole
    plain = rl["ReplayBuffer"](storage=storage, writer=rl["Writer"](), batch_size=32)
    data, info = plain.sample(return_info=True)
    assert torch.equal(data["obs"][:, 0].double(), written[info["index"]])
    assert storage.handoff_hits >= 6  # every sample read its rows once (the union sample), none again
    # get() by global index reads the same rows
    assert torch.equal(storage.get(torch.tensor([28, 0, 13]))["obs"][:, 0].double(), written[[28, 0, 13]])
    assert torch.equal(rb[28]["obs"], torch.full((3,), 900.0))
    store.clear_redis()


def test_uniform_sampler_is_uniform_over_the_union(cluster, rl, request):
    """Shards filled to 10, 6 and 3 rows: 25,000 draws through rb.sample(), chi-square against
    uniform over the 19 valid rows (p > 0.001); no other row is ever drawn."""
    storage = _storage(rl, cluster)
    rb = rl["ReplayBuffer"](storage=storage, writer=rl["Writer"](), batch_size=1000)
    payload = _fill(rb, [10, 6, 3])
    valid = ~torch.isnan(payload)
    assert len(rb) == 19
    rb.set_rng(torch.Generator().manual_seed(11))
    counts = torch.zeros(ROWS, dtype=torch.float64)
    for _ in range(25):
        batch, info = rb.sample(return_info=True)
        index = info["index"]
        assert torch.equal(batch["obs"][:, 0].double(), payload[index])
        counts += torch.bincount(index, minlength=ROWS).double()
    assert counts.sum() == 25_000 and counts[~valid].sum() == 0
    p = chi_square_p(counts[valid], torch.full((19,), 25_000 / 19, dtype=torch.float64))
    request.node.user_properties.append(("chi_square_p", p))
    print(f"uniform chi-square p = {p:.4f}")
    assert p > 0.001, counts.tolist()
    rb.storage.store.clear_redis()


# --------------------------------------------------------------------------- prioritized
def _prio_buffer(rl: dict[str, Any], kind: str, storage: Any, batch_size: int) -> Any:
    if kind == "ReplayBuffer":
        return rl["ReplayBuffer"](
            storage=storage, sampler=rl["Sampler"](ALPHA, BETA, EPS), writer=rl["Writer"](), batch_size=batch_size
        )
    if kind == "PrioritizedReplayBuffer":
        rb = rl["PrioritizedReplayBuffer"](
            alpha=ALPHA,
            beta=BETA,
            eps=EPS,
            storage=storage,
            sampler=rl["Sampler"](ALPHA, BETA, EPS),
            batch_size=batch_size,
        )
        rb.set_writer(rl["Writer"]())
        return rb
    if kind == "TensorDictPrioritizedReplayBuffer":
        return rl["StorePRB"](alpha=ALPHA, beta=BETA, eps=EPS, storage=storage, batch_size=batch_size)
    return rl["helper"](storage, ALPHA, BETA, EPS, tensordict=kind == "helper", batch_size=batch_size)


@pytest.mark.parametrize(
    "kind", ["ReplayBuffer", "PrioritizedReplayBuffer", "TensorDictPrioritizedReplayBuffer", "helper", "helper-plain"]
)
def test_prioritized_weights_and_updates_over_the_union(cluster, rl, kind):
    storage = _storage(rl, cluster)
    rb = _prio_buffer(rl, kind, storage, batch_size=200)
    if kind in ("TensorDictPrioritizedReplayBuffer", "helper"):
        assert isinstance(rb, rl["TensorDictPrioritizedReplayBuffer"])
    if kind in ("PrioritizedReplayBuffer", "helper-plain"):
        assert isinstance(rb, rl["PrioritizedReplayBuffer"])
    assert isinstance(rb._sampler, rl["Sampler"]) and isinstance(rb._writer, rl["Writer"])
    payload = _fill(rb, [10, 7, 4])
    store = rb.storage.store
    assert all(b.priority_settings() is not None for b in store.blocks)  # enabled before the first append
    valid = torch.nonzero(~torch.isnan(payload)).reshape(-1)
    g = torch.Generator().manual_seed(5)
    q = torch.rand(valid.numel(), generator=g, dtype=torch.float64) * 4 + 0.05
    rb.update_priority(valid, q)
    assert torch.allclose(_leaves(cluster, store)[valid], _p(q), rtol=1e-9, atol=0)  # each on its shard
    p = torch.full((ROWS,), math.nan, dtype=torch.float64)
    p[valid] = _p(q)
    reference = (p / p[valid].min()) ** -BETA  # TorchRL's (N P)^-beta / max_weight over the union
    counts = torch.zeros(ROWS)
    for _ in range(10):
        batch, info = rb.sample(return_info=True)
        index = info["index"]
        assert torch.equal(batch["obs"][:, 0].double(), payload[index])
        assert info["_weight"].dtype == torch.float32
        assert torch.allclose(info["_weight"].double(), reference[index], rtol=0, atol=1e-5)
        if kind in ("TensorDictPrioritizedReplayBuffer", "helper"):
            assert torch.equal(batch["_weight"], info["_weight"]) and torch.equal(batch["index"], index)
        counts += torch.bincount(index, minlength=ROWS).float()
    assert counts[torch.isnan(payload)].sum() == 0
    # an update from a sample reaches the rows' shards
    batch, info = rb.sample(return_info=True)
    index = info["index"]
    new = torch.linspace(0.5, 2.5, index.numel(), dtype=torch.float64)
    if kind in ("TensorDictPrioritizedReplayBuffer", "helper"):
        batch.set("td_error", new.float())
        rb.update_tensordict_priority(batch)
    else:
        rb.update_priority(index, new.float())
    leaves = _leaves(cluster, store)
    last = {}
    for row, value in zip(index.tolist(), new.float().double().tolist(), strict=True):
        last[row] = value  # (a row drawn twice keeps its last value)
    rows = torch.tensor(sorted(last))
    assert torch.allclose(leaves[rows], _p(torch.tensor([last[r] for r in sorted(last)])), rtol=1e-6, atol=0)
    # a stale generation is dropped: the rows of a sample, appended over since, keep their new priority
    _, info = rb.sample(return_info=True)
    index = info["index"]
    shard = int(index[0]) // BLOCK
    rb._writer.pin_shard = shard
    rb.extend(_rows(500, BLOCK))  # the whole shard again: every row of it has a new generation
    rb._writer.pin_shard = None
    before = _leaves(cluster, store)
    applied = rb._sampler.update_priority(index, torch.full((index.numel(),), 9.0), storage=rb.storage)
    on_shard = torch.div(index, BLOCK, rounding_mode="floor") == shard
    assert not bool(applied[on_shard].any()) and bool(applied[~on_shard].all())
    after = _leaves(cluster, store)
    shard_rows = slice(shard * BLOCK, (shard + 1) * BLOCK)
    assert torch.equal(after[shard_rows], before[shard_rows])  # stale: nothing changed there
    others = index[~on_shard]
    if others.numel():
        assert torch.allclose(after[others], _p(torch.tensor(9.0)).expand(others.numel()), rtol=1e-9, atol=0)
    store.clear_redis()


# --------------------------------------------------------------------------- processes
@pytest.mark.parametrize("prioritized", [False, True])
def test_pickled_storage_samples_the_same_buffer_in_another_process(cluster, rl, pool, prioritized):
    storage = _storage(rl, cluster)
    if prioritized:
        rb = rl["helper"](storage, ALPHA, BETA, EPS, batch_size=16)
    else:
        rb = rl["ReplayBuffer"](storage=storage, writer=rl["Writer"](), batch_size=16)
    payload = _fill(rb, [10, 5, 2])
    valid = torch.nonzero(~torch.isnan(payload)).reshape(-1)
    q = torch.linspace(0.1, 3.0, valid.numel(), dtype=torch.float64)
    if prioritized:
        rb.update_priority(valid, q)
    clone = pickle.loads(pickle.dumps(rb.storage))
    assert clone.store.td_id == rb.storage.store.td_id and len(clone) == 17  # by td_id, not a copy
    clone.store.close()
    got = pool.submit(w.sharded_sampler, rb.storage, prioritized, ALPHA, BETA, 5).result(timeout=120)
    assert got["td_id"] == [rb.storage.store.td_id] and got["len"] == [17]
    index = torch.tensor(got["index"])
    assert index.numel() == 5 * 64
    assert torch.equal(torch.tensor(got["obs"], dtype=torch.float64), payload[index])
    if prioritized:
        p = torch.full((ROWS,), math.nan, dtype=torch.float64)
        p[valid] = _p(q)
        reference = (p / p[valid].min()) ** -BETA  # the union's weights, the priorities set here
        assert torch.allclose(torch.tensor(got["weight"], dtype=torch.float64), reference[index], rtol=0, atol=1e-5)
    rb.storage.store.clear_redis()


# --------------------------------------------------------------------------- bad input
def test_bad_input_raises_clearly_and_changes_nothing(cluster, rl):
    storage = _storage(rl, cluster)
    rb = rl["ReplayBuffer"](storage=storage, writer=rl["Writer"](), batch_size=4)
    _fill(rb, [3, 2, 0])
    store = rb.storage.store
    where = re.escape(store._where())
    before = _wire(cluster)
    with pytest.raises(TypeError, match=r"store= takes a ShardedStore, got TensorDictStore"):
        rl["Storage"](store=store.blocks[0])
    with pytest.raises(ValueError, match=r"max_size=99 does not match ShardedStore\(td_id="):
        rl["Storage"](99, store=store)
    with pytest.raises(ValueError, match=r"give block_rows= \(rows per shard\) or shards="):
        rl["Storage"](30)
    with pytest.raises(ValueError, match=r"block_rows=0|block_rows must be an int >= 1"):
        rl["Storage"](30, block_rows=0)
    with pytest.raises(IndexError, match=rf"row 30 is out of range for {where}: rows are 0 to 29"):
        storage.get(torch.tensor([0, 30]))
    with pytest.raises(IndexError, match=rf"row 5 of {where} holds no appended data yet: shard 0 has 3 rows"):
        storage.get([5])
    with pytest.raises(TypeError, match=rf"get\(\) of {where} takes rows of the whole buffer.*float32"):
        storage.get(torch.tensor([0.5]))
    with pytest.raises(ValueError, match=rf"shard of {where} must be a shard number from 0 to 2, got 3"):
        rl["ReplayBuffer"](storage=storage, writer=rl["Writer"](pin_shard=3)).extend(_rows(0, 2))
    with pytest.raises(ValueError, match=r"ShardedStoreWriter: pin_shard must be a shard number"):
        rl["Writer"](pin_shard=-1)
    with pytest.raises(NotImplementedError, match=rf"ShardedStoreStorage of {where} is written by appends only"):
        rb[0] = _rows(0, 1)[0]
    with pytest.raises(TypeError, match=r"ShardedStoreWriter needs a ShardedStoreStorage, got TensorDictStoreStorage"):
        rl["ReplayBuffer"](storage=rl["StoreStorage"](8), writer=rl["Writer"]())
    with pytest.raises(TypeError, match=r"TensorDictStorePrioritizedSampler needs a TensorDictStoreStorage, got Sha"):
        rl["ReplayBuffer"](storage=storage, sampler=rl["StoreSampler"](ALPHA, BETA), batch_size=4).sample()
    with pytest.raises(TypeError, match=r"ShardedStorePrioritizedSampler needs a ShardedStoreStorage, got TensorDictS"):
        rl["Sampler"](ALPHA, BETA).sample(rl["StoreStorage"](8), 4)
    with pytest.raises(TypeError, match=r"prioritized_replay_buffer\(\) needs a TensorDictStoreStorage, a Sharded"):
        rl["helper"](store.blocks[0], ALPHA, BETA)
    # a given ShardedStore without priorities: the prioritized sampler refuses it, enabling nothing
    given = rl["Storage"](store=ShardedStore.from_store(td_id=store.td_id, **cluster.connection_kwargs()))
    prio = rl["helper"](given, ALPHA, BETA, EPS, batch_size=4)
    with pytest.raises(ValueError, match=r"has priorities off on shard\(s\) \[0, 1, 2\].*store.enable_priorities"):
        prio.sample()
    with pytest.raises(ValueError, match=r"priorities off on shard"):
        prio.update_priority(torch.tensor([0]), torch.tensor([1.0]))
    assert all(b.priority_settings() is None for b in store.blocks)
    with pytest.raises(ValueError, match=r"row 30 is out of the buffer's range 0 to 29; nothing was changed"):
        store.update_priority(torch.tensor([0, 30]), 1.0)
    assert _wire(cluster) == before  # nothing changed on any master
    given.store.close()
    store.clear_redis()


def test_priorities_enabled_on_a_given_store_are_used(cluster, rl):
    td_id = _spread_td_id(cluster, 3)
    store = ShardedStore.from_schema(
        {"obs": ([3], torch.float32), "reward": ([], torch.float32)},
        batch_size=[ROWS],
        block_rows=BLOCK,
        td_id=td_id,
        **cluster.connection_kwargs(),
    )
    store.enable_priorities(ALPHA, BETA, EPS)
    rb = rl["helper"](store, ALPHA, BETA, EPS, batch_size=8)  # a ShardedStore, wrapped in a ShardedStoreStorage
    assert isinstance(rb.storage, rl["Storage"]) and rb.storage.store is store
    index = rb.extend(_rows(0, 5))
    batch = rb.sample()
    assert set(batch["index"].tolist()) <= set(index.tolist())
    state = rb.storage.state_dict()
    assert state["totals"] == [5 if s == int(index[0]) // BLOCK else 0 for s in range(3)]
    store.clear_redis()


def test_state_dict_round_trip_into_another_sharded_buffer(cluster, rl):
    """rb.state_dict() of a prioritized buffer loaded into a buffer of another td_id: the rows,
    every shard's row count, and every row's priority come back."""
    rb = _prio_buffer(rl, "helper", _storage(rl, cluster), batch_size=8)
    payload = _fill(rb, [10, 4, 7])
    valid = torch.nonzero(~torch.isnan(payload)).reshape(-1)
    q = torch.linspace(0.2, 4.0, valid.numel(), dtype=torch.float64)
    rb.update_priority(valid, q)
    state = rb.state_dict()
    other = _prio_buffer(rl, "helper", _storage(rl, cluster), batch_size=8)
    other.load_state_dict(state)
    a, b = rb.storage.store, other.storage.store
    assert a.td_id != b.td_id
    assert [s.total for s in b.ring_state().shards] == [10, 4, 7] and len(other) == 21
    assert torch.equal(b.to_tensordict()["obs"], a.to_tensordict()["obs"])
    assert torch.allclose(_leaves(cluster, b)[valid], _p(q), rtol=1e-9, atol=0)
    batch = other.sample()
    assert torch.equal(batch["obs"][:, 0].double(), payload[batch["index"]])
    a.clear_redis()
    b.clear_redis()


# --------------------------------------------------------------------------- clearing
def test_clear_through_the_storage_cleans_every_master(cluster, rl):
    storage = _storage(rl, cluster)
    rb = _prio_buffer(rl, "helper", storage, batch_size=4)
    _fill(rb, [4, 4, 4])
    store = rb.storage.store
    nodes = {cluster.node_of_store(f"{store.td_id}.b{s}") for s in range(3)}
    assert nodes == {0, 1, 2} and all(keys for keys in _keys_per_master(cluster).values())
    rb.empty()  # every shard's ring is empty again, for every process
    assert len(rb) == 0 and [s.total for s in store.ring_state().shards] == [0, 0, 0]
    rb.extend(_rows(0, 2))
    assert len(rb) == 2
    rb.storage.store.clear_redis()
    assert _keys_per_master(cluster) == {0: [], 1: [], 2: []}


def _keys_per_master(cluster: Any) -> dict[int, list[bytes]]:
    out = {}
    for node in range(cluster.masters):
        client = cluster.node_client(node)
        try:
            out[node] = sorted(client.scan_iter(count=1000))
        finally:
            client.close()
    return out


# --------------------------------------------------------------------------- overhead
def test_buffer_sample_costs_at_most_1_2x_the_sharded_sample(cluster, rl, request):
    """Median of rb.sample() (TensorDictPrioritizedReplayBuffer) against the ShardedStore's own
    sample(n, prioritized=True) of the same rows, interleaved; at most 1.2x."""
    n, reps = 256, 31
    storage = _storage(rl, cluster)
    rb = _prio_buffer(rl, "helper", storage, batch_size=n)
    _fill(rb, [10, 10, 10])
    store = rb.storage.store
    for _ in range(5):  # warm both paths
        rb.sample()
        store.sample(n, prioritized=True)
    ours, theirs = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        store.sample(n, prioritized=True)
        t1 = time.perf_counter()
        rb.sample()
        t2 = time.perf_counter()
        theirs.append(t1 - t0)
        ours.append(t2 - t1)
    ratio = statistics.median(ours) / statistics.median(theirs)
    request.node.user_properties.append(("sample_ratio", ratio))
    print(
        f"rb.sample {statistics.median(ours) * 1e3:.2f} ms, ShardedStore.sample {statistics.median(theirs) * 1e3:.2f} ms, ratio {ratio:.3f}"
    )
    assert ratio <= 1.2, (ours, theirs)
    store.clear_redis()


# --------------------------------------------------------------------------- the docs
def test_docs_sharded_example_runs(cluster):
    """The ShardedStore example of docs/torchrl.md (its one ```py3 block), on this cluster."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "torchrl.md").read_text()
    blocks = re.findall(r"```py3\n(.*?)```", text, re.S)
    assert len(blocks) == 1
    code = blocks[0].replace('[("localhost", 7000)]', repr(cluster.connection_kwargs()["cluster_nodes"]))
    assert code != blocks[0]
    exec(compile(code, "docs/torchrl.md", "exec"), {})
    assert _keys_per_master(cluster) == {0: [], 1: [], 2: []}  # the example cleans up after itself
