"""The ring buffer of :class:`tdstore.ShardedStore` across its shards (tdstore/sharded_ring.py).

On one server and on the 3-master cluster: extend to one shard per call (indices in the whole
buffer's numbering), differential against an in-memory oracle; uniform and prioritized
samples that are samples of the union (chi-square over >= 200,000 draws, shards of unequal
valid counts) with the union's importance weights; priorities routed by shard; a master
killed (a clear error naming the shard, or ``skip_unavailable``); bad input that changes
nothing; several writer processes and a sampler at once.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import _shring_workers as w
import pytest
import torch
from fixtures import PoolSpec
from redis.exceptions import ConnectionError  # noqa: A004
from tensordict import TensorDict
from test_priorities import chi_square_p

from tdstore import RetryPolicy, SchemaError, ShardedStore, ShardUnavailableError
from tdstore.sharded_ring import ShardedRingState
from tdstore.testing.counts import record as _record

POOL = PoolSpec(workers=4, warm_up=w.warm_up, warm_up_arg=0.5)
ON_THREE = pytest.mark.parametrize("server", ["fakeredis", "redis", "cluster"], indirect=True)
_SCHEMA = {"v": ([w.WIDTH], torch.int64), "tag": ([], torch.int64)}


def _buf(server, rows=24, block_rows=8, **kw) -> ShardedStore:
    return ShardedStore.from_schema(
        _SCHEMA, batch_size=[rows], block_rows=block_rows, **server.connection_kwargs(), **kw
    )


class _Oracle:
    """The same ring in memory: one cursor per shard, rows wrapping inside their shard."""

    def __init__(self, rows: int, block_rows: int) -> None:
        self.block_rows = block_rows
        self.caps = [min(block_rows, rows - lo) for lo in range(0, rows, block_rows)]
        self.total = [0] * len(self.caps)
        self.data = TensorDict({k: torch.zeros(rows, *shape, dtype=dt) for k, (shape, dt) in _SCHEMA.items()}, [rows])

    def extend(self, shard: int, td: TensorDict) -> torch.Tensor:
        n = td.batch_size[0]
        local = (self.total[shard] + torch.arange(n)) % self.caps[shard]
        self.total[shard] += n
        index = local + shard * self.block_rows
        self.data[index] = td
        return index

    def valid(self) -> int:
        return sum(min(t, c) for t, c in zip(self.total, self.caps, strict=True))


@ON_THREE
def test_extend_matches_an_in_memory_ring(server):
    buf = _buf(server, rows=22, block_rows=8)  # shards of 8, 8 and 6 rows
    oracle = _Oracle(22, 8)
    g = torch.Generator().manual_seed(3)
    start = buf._ring._next  # (the handle's per-process starting shard)
    turn = start
    for call in range(40):
        n = int(torch.randint(1, 7, (), generator=g))
        td = w.tagged_rows(1, call, n)
        if call % 3 == 0:
            shard = int(torch.randint(0, 3, (), generator=g))
            got = buf.extend(td, shard=shard)
        else:
            shard, turn = turn, (turn + 1) % 3
            got = buf.extend(td)
        want = oracle.extend(shard, td)
        assert got.tolist() == want.tolist()
        assert bool((torch.div(got, 8, rounding_mode="floor") == shard).all())
    remote = buf.to_tensordict()
    assert torch.equal(remote["v"], oracle.data["v"]) and torch.equal(remote["tag"], oracle.data["tag"])
    state = buf.ring_state()
    assert isinstance(state, ShardedRingState)
    assert state.valid == oracle.valid() == 22 and state.total == sum(oracle.total) and state.capacity == 22
    assert [s.total for s in state.shards] == oracle.total
    # a batch of valid rows, each row as appended (its tag in every element)
    batch, info = buf.sample(64, return_info=True, generator=g)
    assert batch.batch_size == torch.Size([64])
    assert torch.equal(batch["v"], oracle.data["v"][info["index"]])
    # reconnect: the same ring (cursors on the shards)
    again = ShardedStore.from_store(td_id=buf.td_id, pin_shard=2, **server.connection_kwargs())
    got = again.extend(w.tagged_rows(2, 0, 3))
    assert got.tolist() == oracle.extend(2, w.tagged_rows(2, 0, 3)).tolist()
    assert again.ring_state().total == sum(oracle.total)
    assert torch.equal(again.to_tensordict()["tag"], oracle.data["tag"])
    again.close()
    buf.clear_redis()
    buf.close()
    assert server.sync_client().keys(f"*{buf.td_id}*") == []


@pytest.mark.parametrize("server", ["redis"], indirect=True)
def test_writers_pin_shards_and_round_robin_spreads(server):
    buf = _buf(server, rows=30, block_rows=10, pin_shard=1)
    assert buf.pin_shard == 1
    for call in range(5):
        assert set(torch.div(buf.extend(w.tagged_rows(0, call, 2)), 10, rounding_mode="floor").tolist()) == {1}
    buf.pin_shard = None
    shards = [int(buf.extend(w.tagged_rows(0, c, 1))[0]) // 10 for c in range(6)]
    assert sorted(shards) == [0, 0, 1, 1, 2, 2] and shards[:3] == shards[3:]
    # handles start at different shards (per process random offset): over 30 handles, all three
    starts = set()
    for _ in range(30):
        other = ShardedStore.from_store(td_id=buf.td_id, **server.connection_kwargs())
        starts.add(other._ring._next)
        other.close()
    assert starts == {0, 1, 2}
    with pytest.raises(
        ValueError, match=r"pin_shard of ShardedStore\(td_id=.*must be a shard number from 0 to 2, got 3"
    ):
        buf.pin_shard = 3
    buf.clear_redis()
    buf.close()


def _fill_unequal(buf: ShardedStore, counts: list[int]) -> None:
    for shard, count in enumerate(counts):
        done = 0
        while done < count:
            n = min(5, count - done)
            buf.extend(w.tagged_rows(shard, done, n), shard=shard)
            done += n


@pytest.mark.parametrize("server", ["redis"], indirect=True)
def test_uniform_sample_is_uniform_over_the_union(server, request):
    """Shards of 20, 7 and 13 valid rows: every valid row equally likely (chi-square, 200,000 draws)."""
    buf = _buf(server, rows=60, block_rows=20)
    _fill_unequal(buf, [20, 7, 13])
    assert buf.ring_state().valid == 40
    valid = torch.cat([torch.arange(0, 20), torch.arange(20, 27), torch.arange(40, 53)])
    g = torch.Generator().manual_seed(11)
    counts = torch.zeros(60, dtype=torch.float64)
    draws = 0
    while draws < 200_000:
        batch, info = buf.sample(10_000, return_info=True, generator=g)
        counts += torch.bincount(info["index"], minlength=60).double()
        draws += 10_000
        assert torch.equal(batch["v"][:, 0], batch["tag"])  # each row whole
    assert float(counts[~torch.isin(torch.arange(60), valid)].sum()) == 0  # never a row not appended
    p = chi_square_p(counts[valid], torch.full((40,), draws / 40, dtype=torch.float64))
    # the per-shard split alone: 20/40, 7/40, 13/40
    per_shard = torch.stack([counts[0:20].sum(), counts[20:40].sum(), counts[40:60].sum()])
    p_split = chi_square_p(per_shard, torch.tensor([20, 7, 13], dtype=torch.float64) / 40 * draws)
    _record(request, draws=draws, chi_square_p=f"{p:.4f}", split_p=f"{p_split:.4f}")
    assert p > 0.001 and p_split > 0.001
    # the positions are shuffled: the first row is not always from the same shard
    firsts = {int(buf.sample(30, return_info=True, generator=g)[1]["index"][0]) // 20 for _ in range(40)}
    assert firsts == {0, 1, 2}
    buf.clear_redis()
    buf.close()


@pytest.mark.parametrize("server", ["redis", "cluster"], indirect=True)
def test_full_shards_are_sampled_drawn_first_and_uniform_over_their_written_rows(server, request, monkeypatch):
    """Two full shards of 20 rows, 6 rows of the first reserved again by an appender that
    died: no flags read first, and every written row equally likely over the union (the
    rows drawn unwritten are drawn again from the union; chi-square)."""
    from test_append_flags import dead_reservation
    from test_sample_drawn_first import count_flag_reads

    buf = ShardedStore.from_schema(_SCHEMA, batch_size=[40], block_rows=20, **server.connection_kwargs())
    buf.extend(w.tagged_rows(1, 0, 20), shard=0)
    buf.extend(w.tagged_rows(1, 1, 10), shard=1)  # (a shard of 20 rows, half of them: not full)
    buf.blocks[1].set_ring_total(20)  # ... now counted full: rows 10-19 hold zeros, flagged
    buf.sample(4)  # (the two-step sample: each shard now known full)
    assert all(b._conn.ring_full for b in buf.blocks)
    monkeypatch.setattr("test_append_flags.CAP", 20)  # (the helper's ring size)
    assert dead_reservation(buf.blocks[0], 6) == 20  # rows 0-5 of shard 0: not written
    flag_reads = count_flag_reads(monkeypatch)
    g = torch.Generator().manual_seed(8)
    counts = torch.zeros(40, dtype=torch.float64)
    draws = calls = 0
    while draws < 100_000:
        batch, info = buf.sample(5_000, return_info=True, generator=g)
        counts += torch.bincount(info["index"], minlength=40).double()
        draws += 5_000
        calls += 1
        assert torch.equal(batch["v"][:, 0], batch["tag"])  # each row whole
    written = torch.ones(40, dtype=torch.bool)
    written[0:6] = False
    assert float(counts[~written].sum()) == 0, "a row not written was drawn"
    # the rows drawn unwritten are drawn again by the two-step path: one flags read per shard per call at most
    assert len(flag_reads) <= 2 * calls
    p = chi_square_p(counts[written], torch.full((34,), draws / 34, dtype=torch.float64))
    _record(request, draws=draws, chi_square_p=f"{p:.4f}", flag_reads=len(flag_reads), calls=calls)
    assert p > 0.001
    flag_reads.clear()
    for _ in range(5):
        buf.blocks[0].extend(w.tagged_rows(1, 2, 6))  # the dead rows written: nothing to draw again
    buf.sample(64)
    assert flag_reads == [], "full shards with every row written were read in two steps"
    buf.clear_redis()
    buf.close()


@pytest.mark.parametrize("server", ["redis"], indirect=True)
def test_prioritized_sample_and_weights_are_over_the_union(server, request):
    buf = _buf(server, rows=60, block_rows=20)
    _fill_unequal(buf, [20, 7, 13])
    alpha, beta, eps = 0.7, 0.5, 1e-3
    buf.enable_priorities(alpha=alpha, beta=beta, eps=eps)
    valid = torch.cat([torch.arange(0, 20), torch.arange(20, 27), torch.arange(40, 53)])
    g = torch.Generator().manual_seed(5)
    q = torch.rand(40, generator=g, dtype=torch.float64) * 5
    q[30] = 0.0
    q[8] = 40.0  # shard 0 holds much more mass than its row count says
    assert buf.update_priority(valid, q).all()
    p = torch.zeros(60, dtype=torch.float64)
    p[valid] = (q + eps) ** alpha
    p_min = float(p[valid].min())
    counts = torch.zeros(60, dtype=torch.float64)
    draws = 0
    while draws < 200_000:
        batch, info = buf.sample(10_000, prioritized=True, return_info=True, generator=g)
        counts += torch.bincount(info["index"], minlength=60).double()
        draws += 10_000
        want = (p[info["index"]] / p_min) ** -beta  # (N P_i)^-beta / max over the union
        torch.testing.assert_close(info["_weight"].double(), want, atol=1e-5, rtol=0)
        assert torch.equal(batch["tag"], batch["v"][:, 0])
    assert float(counts[p == 0].sum()) == 0
    chi = chi_square_p(counts[valid], p[valid] / p.sum() * draws)
    _record(request, draws=draws, chi_square_p=f"{chi:.4f}")
    assert chi > 0.001
    # update_priority routes by shard; a generation that moved is left alone
    _, info = buf.sample(6, prioritized=True, return_info=True, generator=g)
    assert buf.update_priority(info["index"], 1.0, info["generation"]).all()
    before = buf.update_priority([20, 21, 50], 1.0)  # (no generation: applied)
    assert before.all()
    got = buf.extend(w.tagged_rows(9, 0, 15), shard=1)  # shard 1 wraps: rows 27..39, then 20 and 21
    assert got.tolist()[-2:] == [20, 21]
    # an update carrying the generation of before the wrap is left alone on 20, 21; row 50 (shard 2) applies
    assert buf.update_priority([20, 50, 21], 2.0, [0, 0, 0]).tolist() == [False, True, False]
    assert buf.disable_priorities() is True
    with pytest.raises(ValueError, match="priorities are off on shard 0"):
        buf.sample(4, prioritized=True)
    buf.clear_redis()
    buf.close()


@pytest.mark.parametrize("server", ["redis"], indirect=True)
def test_bad_input_changes_nothing(server, wire):
    buf = _buf(server, rows=24, block_rows=8)
    _fill_unequal(buf, [3, 8, 2])
    buf.enable_priorities()
    before = wire(server)
    where = rf"ShardedStore\(td_id='{buf.td_id}', 24 rows\)"
    with pytest.raises(ValueError, match=rf"shard of {where} must be a shard number from 0 to 2, got 3"):
        buf.extend(w.tagged_rows(0, 0, 2), shard=3)
    with pytest.raises(ValueError, match="must be a shard number"):
        buf.extend(w.tagged_rows(0, 0, 2), shard=True)
    with pytest.raises(SchemaError, match="appends 1 to 8 rows at once"):
        buf.extend(w.tagged_rows(0, 0, 9), shard=0)
    with pytest.raises(SchemaError, match="missing"):
        buf.extend(TensorDict(v=torch.zeros(2, w.WIDTH, dtype=torch.int64), batch_size=[2]))
    for n in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=rf"sample\(\) from {where}: n must be an int >= 1"):
            buf.sample(n)
    with pytest.raises(ValueError, match=r"row 24 is out of the buffer's range 0 to 23; nothing was changed"):
        buf.update_priority([0, 24], [1.0, 2.0])
    with pytest.raises(ValueError, match="priorities must be finite and >= 0, got nan"):
        buf.update_priority([0, 9, 16], [1.0, 2.0, float("nan")])  # (the bad value is on the last shard)
    with pytest.raises(ValueError, match="3 rows and 2 generations"):
        buf.update_priority([0, 9, 16], 1.0, [1, 2])
    with pytest.raises(ValueError, match="alpha must be a finite number"):
        buf.enable_priorities(alpha=-1.0)
    assert wire(server) == before
    empty = _buf(server, rows=10, block_rows=5)
    with pytest.raises(ValueError, match="no row was appended yet"):
        empty.sample(3)
    empty.clear_redis()
    empty.close()
    buf.clear_redis()
    buf.close()


def _spread_td_id(cluster, shards: int) -> str:
    """A td_id whose shards ``<td_id>.b<i>`` lie on ``shards`` different masters."""
    for _ in range(500):
        td_id = f"spread-{uuid.uuid4().hex[:10]}"
        if len({cluster.node_of_store(f"{td_id}.b{i}") for i in range(shards)}) == shards:
            return td_id
    raise AssertionError("no td_id found whose shards spread over the masters")


def test_a_master_down_fails_the_sample_clearly_or_is_skipped(request):
    from tdstore.server import start_cluster

    with start_cluster(masters=3, replicas=0, node_timeout_ms=1000) as cluster:
        td_id = _spread_td_id(cluster, 3)
        conn = dict(cluster.connection_kwargs(), retry=RetryPolicy(attempts=2, deadline=1.0))
        buf = ShardedStore.from_schema(_SCHEMA, batch_size=[30], block_rows=10, td_id=td_id, **conn)
        _fill_unequal(buf, [10, 10, 4])
        buf.enable_priorities()
        down = cluster.node_of_store(f"{td_id}.b1")
        node = f"127.0.0.1:{cluster.nodes[down].port}"
        os.kill(cluster.nodes[down].pid, signal.SIGKILL)
        for prioritized in (False, True):
            with pytest.raises(ShardUnavailableError, match=rf"shard 1 \(td_id '{td_id}.b1'\) of .*{node}") as err:
                buf.sample(16, prioritized=prioritized)
            assert "skip_unavailable=True" in str(err.value)
            started = time.monotonic()
            batch, info = buf.sample(4000, prioritized=prioritized, return_info=True, skip_unavailable=True)
            took = time.monotonic() - started
            assert batch.batch_size == torch.Size([4000]) and info["index"].numel() == 4000  # never short
            shards = torch.div(info["index"], 10, rounding_mode="floor")
            assert set(shards.tolist()) == {0, 2}
            # renormalized over the reachable shards: 10 and 4 valid rows (uniform), equal priorities
            share = float((shards == 0).double().mean())
            assert abs(share - 10 / 14) < 0.05
            assert torch.equal(batch["tag"], batch["v"][:, 0])
        _record(request, skip_sample_s=f"{took:.3f}")
        with pytest.raises(ShardUnavailableError, match="shard 1"):
            buf.ring_state()
        # the reachable shards still take appends; the one down refuses clearly
        assert int(buf.extend(w.tagged_rows(5, 0, 2), shard=2)[0]) // 10 == 2
        with pytest.raises(ConnectionError):  # (tdstore's ServerUnavailableError, a redis ConnectionError)
            buf.extend(w.tagged_rows(5, 1, 2), shard=1)
        buf.close()


POOL_WRITERS = 3


@pytest.mark.parametrize("server", ["redis", "cluster"], indirect=True)
@pytest.mark.parametrize("pin", [False, True])
def test_writer_processes_and_a_sampler(server, pool, pin, request):
    """Writer processes extend while this process samples: every acknowledged append is in the
    buffer exactly once, at the indices it was given, and no sampled row is torn."""
    calls, n = 120, 4
    rows = 3 * 500  # room for every append: nothing wraps, so every acknowledged row must stay
    buf = _buf(server, rows=rows, block_rows=500)
    conn = server.connection_kwargs()
    start = time.time() + 0.5
    futures = [pool.submit(w.writer, conn, buf.td_id, who, calls, n, start, pin) for who in range(1, POOL_WRITERS + 1)]
    samples = torn = 0
    deadline = time.monotonic() + 30
    while not all(f.done() for f in futures) and time.monotonic() < deadline:
        if buf.ring_state().valid == 0:
            time.sleep(0.01)
            continue
        batch = buf.sample(64)
        samples += 1
        torn += int((batch["v"] != batch["tag"][:, None]).any(dim=1).sum())
    acked = {who: f.result(timeout=60) for who, f in zip(range(1, POOL_WRITERS + 1), futures, strict=True)}
    remote = buf.to_tensordict()
    seen: dict[int, int] = {}
    for tag in remote["tag"].tolist():
        if tag:
            seen[tag] = seen.get(tag, 0) + 1
    missing = wrong = 0
    for who, per_call in acked.items():
        for call, index in enumerate(per_call):
            want = w.tagged_rows(who, call, n)["tag"]
            got = remote["tag"][torch.tensor(index)]
            wrong += int((got != want).sum())
            missing += sum(seen.get(int(t), 0) != 1 for t in want.tolist())
            if pin:
                assert {i // 500 for i in index} == {who % 3}
    total = POOL_WRITERS * calls * n
    _record(request, samples=samples, torn=torn, missing=missing, wrong=wrong, rows=total)
    assert len(seen) == total and torn == 0 and missing == 0 and wrong == 0
    assert buf.ring_state().valid == total
    buf.clear_redis()
    buf.close()


@pytest.mark.parametrize("server", ["redis", "cluster"], indirect=True)
def test_pickles_by_td_id(server):
    """A pickled handle is the same buffer (not a copy of its rows); a deleted one fails clearly."""
    import pickle

    from tdstore import StoreNotFoundError

    buf = _buf(server, rows=24, block_rows=8, pin_shard=1)
    buf.extend(w.tagged_rows(1, 0, 3))
    blob = pickle.dumps(buf)
    clone = pickle.loads(blob)
    assert clone.td_id == buf.td_id and clone.pin_shard == 1 and clone.ring_state().valid == 3
    assert clone.extend(w.tagged_rows(2, 0, 2)).tolist() == [11, 12]
    assert buf.ring_state().valid == 5 and torch.equal(buf.to_tensordict()["tag"], clone.to_tensordict()["tag"])
    clone.close()
    buf.clear_redis()
    buf.close()
    with pytest.raises(StoreNotFoundError, match=rf"no ShardedStore with td_id='{buf.td_id}'"):
        pickle.loads(blob)
