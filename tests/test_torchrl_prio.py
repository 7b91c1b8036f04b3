"""Prioritized replay in TorchRL buffers on a TensorDictStore (``tdstore.torchrl``, issue 26 item 4).

``TensorDictStorePrioritizedSampler`` keeps the priorities on the server
(``store.enable_priorities``, docs/replay.md). These tests check it in each TorchRL buffer
class that takes it, against TorchRL's formulas, and read what the server holds back with
``tdstore.replay.priorities.tree_report`` on a second handle.

Like tests/test_torchrl.py, they need TorchRL and run in the tensordict 0.14.3 environment
of ``.ci/run`` (``-m torchrl``); the main run deselects them.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import _torchrl_workers as w
import pytest
import torch
from fixtures import PoolSpec
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore.replay.priorities import tree_report

ALPHA, BETA, EPS = 0.7, 0.5, 1e-8

#: the module's ``pool`` (tests/fixtures.py): one learner process beside the test's
POOL = PoolSpec(workers=1, warm_up=w.warm_up, warm_up_arg=0.3)


@pytest.fixture
def rl():
    """The torchrl names the tests use (imported here: the main environment has no torchrl)."""
    import torchrl.data as data

    import tdstore.torchrl as tds

    return {
        "ReplayBuffer": data.ReplayBuffer,
        "TensorDictReplayBuffer": data.TensorDictReplayBuffer,
        "PrioritizedReplayBuffer": data.PrioritizedReplayBuffer,
        "TensorDictPrioritizedReplayBuffer": data.TensorDictPrioritizedReplayBuffer,
        "LazyTensorStorage": data.LazyTensorStorage,
        "Storage": tds.TensorDictStoreStorage,
        "Writer": tds.TensorDictStoreWriter,
        "Sampler": tds.TensorDictStorePrioritizedSampler,
        "StorePRB": tds.TensorDictStorePrioritizedReplayBuffer,
        "helper": tds.prioritized_replay_buffer,
    }


def _rows(start: int, n: int) -> TensorDict:
    x = torch.arange(start, start + n, dtype=torch.float32)
    return TensorDict(obs=x[:, None].expand(n, 3).clone(), reward=x * 0.5, batch_size=[n])


def _buffer(rl: dict[str, Any], kind: str, capacity: int, conn: dict[str, Any], batch_size: int = 16, **storage_kw: Any) -> Any:
    """A prioritized buffer of the ``kind`` asked for, on a fresh TensorDictStoreStorage."""
    storage = rl["Storage"](capacity, **storage_kw, **conn)
    if kind == "PrioritizedReplayBuffer":
        rb = rl["PrioritizedReplayBuffer"](
            alpha=ALPHA, beta=BETA, eps=EPS, storage=storage, sampler=rl["Sampler"](ALPHA, BETA, EPS), batch_size=batch_size
        )
        rb.set_writer(rl["Writer"]())
        return rb
    if kind == "TensorDictPrioritizedReplayBuffer":
        return rl["StorePRB"](alpha=ALPHA, beta=BETA, eps=EPS, storage=storage, batch_size=batch_size)
    if kind == "helper":
        return rl["helper"](storage, ALPHA, BETA, EPS, batch_size=batch_size)
    if kind == "helper-plain":
        return rl["helper"](storage, ALPHA, BETA, EPS, tensordict=False, batch_size=batch_size)
    return rl[kind](storage=storage, sampler=rl["Sampler"](ALPHA, BETA, EPS), writer=rl["Writer"](), batch_size=batch_size)


def _leaves(server: Any, rb: Any) -> torch.Tensor:
    """The values ``p`` the server holds for every row, read through a second handle."""
    other = TensorDictStore.from_store(td_id=rb.storage.store.td_id, **server.connection_kwargs())
    try:
        report = tree_report(other)
    finally:
        other.close()
    assert report is not None and report["problems"] == []
    return torch.as_tensor(report["leaves"], dtype=torch.float64)


def _p(q: torch.Tensor | float) -> torch.Tensor:
    return (torch.as_tensor(q, dtype=torch.float64) + EPS) ** ALPHA


def _sample(rb: Any, n: int | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    return rb.sample(n, return_info=True) if n is not None else rb.sample(return_info=True)


def _data_of(got: Any) -> TensorDict:
    return got._tensordict if hasattr(got, "_tensordict") else got


# --------------------------------------------------------------------------- draws and weights
@pytest.mark.torchrl
@pytest.mark.parametrize("server", ["fakeredis", "redis"], indirect=True)
def test_draw_frequencies_and_weights_follow_torchrls_formulas(server, rl):
    """50k draws: chi-square against p^alpha / sum (p > 0.001); weights (N P)^-beta / max to 1e-5."""
    from scipy.stats import chisquare

    n_rows = 10
    rb = _buffer(rl, "TensorDictReplayBuffer", n_rows, server.connection_kwargs(), batch_size=1000)
    rb.extend(_rows(0, n_rows))
    q = torch.tensor([0.1, 0.5, 1.0, 2.0, 3.0, 0.2, 5.0, 0.05, 1.5, 4.0], dtype=torch.float64)
    rb.update_priority(torch.arange(n_rows), q)
    rb.set_rng(torch.Generator().manual_seed(7))
    p = _p(q)
    prob = p / p.sum()
    expected_w = (n_rows * prob) ** -BETA
    expected_w = expected_w / expected_w.max()
    counts = torch.zeros(n_rows, dtype=torch.float64)
    for _ in range(50):
        batch = rb.sample()
        index = batch["index"]
        assert torch.equal(batch["obs"][:, 0].long(), index)  # the rows of the index, read once
        assert batch["_weight"].dtype == torch.float32
        assert torch.allclose(batch["_weight"].double(), expected_w[index], rtol=0, atol=1e-5)
        assert torch.equal(batch["priority_weight"], batch["_weight"])  # what TorchRL's losses read
        counts += torch.bincount(index, minlength=n_rows).double()
    assert counts.sum() == 50_000
    stat = chisquare(counts.numpy(), (prob * counts.sum()).numpy())
    assert stat.pvalue > 0.001, (counts.tolist(), stat)


@pytest.mark.torchrl
@pytest.mark.parametrize(
    "kind",
    [
        "PrioritizedReplayBuffer", "TensorDictPrioritizedReplayBuffer", "ReplayBuffer", "TensorDictReplayBuffer",
        "helper", "helper-plain",
    ],
)
def test_each_buffer_class_samples_and_updates_on_the_server(server, rl, kind):
    rb = _buffer(rl, kind, 8, server.connection_kwargs(), batch_size=6)
    if kind in ("TensorDictPrioritizedReplayBuffer", "helper"):
        assert isinstance(rb, rl["TensorDictPrioritizedReplayBuffer"])
    if kind in ("PrioritizedReplayBuffer", "helper-plain"):
        assert isinstance(rb, rl["PrioritizedReplayBuffer"])
    assert torch.equal(rb.extend(_rows(0, 8)), torch.arange(8))
    assert rb.storage.store.priority_settings() is not None  # enabled when the store was made, before the first append
    assert tree_report(rb.storage.store)["gens"].tolist() == list(range(1, 9))  # so every row has its generation
    data, info = _sample(rb)
    settings = rb.storage.store.priority_settings()
    assert (settings.alpha, settings.beta, settings.eps) == (ALPHA, BETA, EPS)
    assert {"_weight", "priority_weight", "generation", "index"} <= set(info)
    assert torch.equal(_data_of(data)["obs"][:, 0].long(), info["index"])
    assert torch.allclose(info["_weight"], torch.ones(6))  # every row at the first max priority, 1
    rb.update_priority(torch.tensor([2, 5]), torch.tensor([4.0, 0.25]))
    leaves = _leaves(server, rb)
    assert torch.allclose(leaves[[2, 5]], _p([4.0, 0.25]), rtol=1e-12)
    assert torch.allclose(leaves[[0, 1, 3]], _p(1.0).expand(3), rtol=1e-12)
    rb.extend(_rows(8, 1))  # row 0 again: the max priority given so far
    assert math.isclose(float(_leaves(server, rb)[0]), float(_p(4.0)), rel_tol=1e-12)


@pytest.mark.torchrl
def test_update_tensordict_priority_reaches_the_server(server, rl):
    rb = _buffer(rl, "TensorDictPrioritizedReplayBuffer", 16, server.connection_kwargs(), batch_size=32)
    rb.extend(_rows(0, 16))
    batch = rb.sample()
    assert "generation" in batch.keys()  # TensorDictReplayBuffer writes every info entry into the sample
    batch["td_error"] = batch["index"].double() / 4 + 0.5  # one value per row: duplicates agree
    rb.update_tensordict_priority(batch)
    leaves = _leaves(server, rb)
    drawn = batch["index"].unique()
    assert torch.allclose(leaves[drawn], _p(drawn.double() / 4 + 0.5), rtol=1e-9)
    untouched = torch.tensor([i for i in range(16) if i not in set(drawn.tolist())], dtype=torch.long)
    assert torch.allclose(leaves[untouched], _p(1.0).expand(untouched.numel()), rtol=1e-12)
    # add() without the entry keeps the server's max priority (default_priority is "the server's")
    row = rb.add(_rows(200, 1)[0])
    top = float(drawn.max()) / 4 + 0.5
    assert math.isclose(float(_leaves(server, rb)[row]), float(_p(top)), rel_tol=1e-12)
    # rows stored with the priority entry: extend gives them its values (TorchRL's extend calls update_priority)
    other = _buffer(rl, "TensorDictPrioritizedReplayBuffer", 4, server.connection_kwargs(), batch_size=2)
    td = _rows(100, 3)
    td["td_error"] = torch.tensor([7.0, 9.0, 0.5])
    index = other.extend(td)
    assert torch.allclose(_leaves(server, other)[index], _p([7.0, 9.0, 0.5]), rtol=1e-9)


@pytest.mark.torchrl
def test_a_stale_update_is_dropped(server, rl):
    """Rows appended to between the sample and the update keep the priority of their new data."""
    rb = _buffer(rl, "TensorDictPrioritizedReplayBuffer", 8, server.connection_kwargs(), batch_size=64)
    rb.extend(_rows(0, 8))
    rb.set_rng(torch.Generator().manual_seed(3))
    batch = rb.sample()
    assert set(batch["index"].tolist()) >= {0, 1, 2}  # 64 draws among 8 equal rows
    rb.extend(_rows(8, 3))  # rows 0, 1, 2 written again
    batch["td_error"] = torch.full((64,), 3.0)
    rb.update_tensordict_priority(batch)
    leaves = _leaves(server, rb)
    assert torch.allclose(leaves[:3], _p(1.0).expand(3), rtol=1e-12)  # dropped: the new rows' max priority
    drawn_later = sorted(set(batch["index"].tolist()) - {0, 1, 2})
    assert torch.allclose(leaves[drawn_later], _p(3.0).expand(len(drawn_later)), rtol=1e-12)
    # the sampler says so, for the index of a sample (its generations) and with generation= given
    data, info = _sample(rb)
    rb.extend(_rows(20, 8))  # every row appended to, each at the max priority given so far (3)
    rb.update_priority(info["index"], 2.0)  # TorchRL's rb.update_priority passes the index on unchanged
    assert torch.allclose(_leaves(server, rb), _p(3.0).expand(8), rtol=1e-12)
    assert not rb.sampler.update_priority(info["index"], 2.0).any()
    assert not rb.sampler.update_priority(info["index"].clone(), 2.0, generation=info["generation"]).any()
    assert rb.sampler.update_priority(info["index"].clone(), 2.0).all()  # a copy: no generation known


# --------------------------------------------------------------------------- one read per sample
def _calls(handle: Any) -> int:
    client = handle.sync_client()
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return sum(int(v["calls"]) for k, v in stats.items() if k.startswith("cmdstat_"))


@pytest.mark.torchrl
def test_a_sample_reads_its_rows_once(redis_server, rl):
    """rb.sample() sends the commands of store.sample(prioritized=True) and no more."""
    rb = _buffer(rl, "TensorDictReplayBuffer", 64, redis_server.connection_kwargs(), batch_size=16)
    rb.extend(_rows(0, 64))
    rb.sample()  # enables priorities, caches the layout
    store = rb.storage.store
    store.sample(16, prioritized=True, return_info=True)
    hits = rb.storage.handoff_hits
    base = _calls(redis_server)
    probe = _calls(redis_server) - base  # what counting costs
    for seed in range(3):  # the same draws both ways: the same runs of rows to read
        before = _calls(redis_server)
        _, direct_info = store.sample(16, prioritized=True, return_info=True, generator=torch.Generator().manual_seed(seed))
        direct = _calls(redis_server) - before - probe
        rb.set_rng(torch.Generator().manual_seed(seed))
        before = _calls(redis_server)
        batch = rb.sample()
        via_rb = _calls(redis_server) - before - probe
        assert torch.equal(batch["index"], direct_info["index"])
        assert via_rb == direct, (via_rb, direct)
    assert rb.storage.handoff_hits == hits + 3
    # any other read of the storage reads the rows (the handed-over batch is for that index only)
    _, info = _sample(rb)
    other = info["index"].clone()
    assert torch.equal(rb.storage.get(info["index"])["obs"][:, 0].long(), info["index"])  # already consumed: read
    assert torch.equal(rb.storage.get(other)["obs"][:, 0].long(), other)
    assert rb.storage.handoff_hits == hits + 4


@pytest.mark.torchrl
def test_the_handed_over_batch_is_per_thread(server, rl):
    """One slot per thread: a sample in another thread does not take this thread's rows,
    and TorchRL's prefetching threads (each samples and reads in its own thread) hit too."""
    import threading

    storage = rl["Storage"](32, **server.connection_kwargs())
    storage.extend(_rows(0, 32))
    sampler = rl["Sampler"](ALPHA, BETA, EPS)
    mine, _ = sampler.sample(storage, 8)
    theirs: list[bool] = []

    def other_thread() -> None:
        index, _ = sampler.sample(storage, 8)
        theirs.append(torch.equal(storage.get(index)["obs"][:, 0].long(), index))

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert theirs == [True] and storage.handoff_hits == 1
    assert torch.equal(storage.get(mine)["obs"][:, 0].long(), mine)  # still this thread's, not the other's
    assert storage.handoff_hits == 2

    rb = rl["TensorDictReplayBuffer"](
        storage=storage, sampler=sampler, writer=rl["Writer"](), batch_size=8, prefetch=3
    )
    for _ in range(10):
        batch = rb.sample()
        assert torch.equal(batch["obs"][:, 0].long(), batch["index"])
    assert storage.handoff_hits >= 2 + 10


# --------------------------------------------------------------------------- lifetime
@pytest.mark.torchrl
def test_empty_resets_the_priorities(server, rl):
    rb = _buffer(rl, "TensorDictPrioritizedReplayBuffer", 8, server.connection_kwargs(), batch_size=4)
    rb.extend(_rows(0, 8))
    rb.update_priority(torch.arange(8), torch.arange(8).double() + 1)
    rb.sample()
    rb.empty()
    assert len(rb) == 0
    assert torch.equal(_leaves(server, rb), torch.zeros(8, dtype=torch.float64))
    rb.extend(_rows(0, 3))
    leaves = _leaves(server, rb)
    assert torch.allclose(leaves[:3], _p(1.0).expand(3), rtol=1e-12)  # the max priority was forgotten too
    assert set(rb.sample()["index"].tolist()) <= {0, 1, 2}


@pytest.mark.torchrl
@pytest.mark.parametrize("how", ["state_dict", "dumps"])
def test_state_round_trip_keeps_the_priorities(server, rl, tmp_path, how):
    conn = server.connection_kwargs()
    rb = _buffer(rl, "TensorDictPrioritizedReplayBuffer", 8, conn, batch_size=4)
    rb.extend(_rows(0, 6))
    rb.update_priority(torch.arange(6), torch.tensor([0.5, 1.0, 2.0, 8.0, 0.1, 3.0]))
    rb.update_priority(torch.tensor([3]), 0.2)  # the max priority (8) stays what was given
    before = _leaves(server, rb)
    other = _buffer(rl, "TensorDictPrioritizedReplayBuffer", 8, conn, batch_size=4)
    if how == "state_dict":
        other.load_state_dict(rb.state_dict())
    else:
        rb.dumps(tmp_path / "ckpt")
        assert (tmp_path / "ckpt" / "sampler" / "sampler.pt").is_file()
        other.loads(tmp_path / "ckpt")
    assert other.storage.store.td_id != rb.storage.store.td_id and len(other) == 6
    after = _leaves(server, other)
    assert torch.allclose(after, before, rtol=1e-9, atol=0)
    other.extend(_rows(6, 1))  # a new row: the max priority given before the checkpoint
    assert math.isclose(float(_leaves(server, other)[6]), float(_p(8.0)), rel_tol=1e-9)


@pytest.mark.torchrl
def test_beta_and_alpha_changes(server, rl):
    rb = _buffer(rl, "TensorDictReplayBuffer", 4, server.connection_kwargs(), batch_size=4)
    rb.extend(_rows(0, 4))
    rb.update_priority(torch.arange(4), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    rb.sampler.beta = 0.9  # (what TorchRL's schedulers do): the server's beta, priorities kept
    assert rb.storage.store.priority_settings().beta == 0.9
    assert torch.allclose(_leaves(server, rb), _p([1.0, 2.0, 3.0, 4.0]), rtol=1e-12)
    rb.sampler.alpha = 1.0  # the tree is rebuilt and the priorities written back
    assert rb.storage.store.priority_settings().alpha == 1.0
    assert torch.allclose(_leaves(server, rb), torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64) + EPS, rtol=1e-9)


@pytest.mark.torchrl
def test_bad_use_gives_clear_errors(server, rl):
    with pytest.raises(ValueError, match="max_priority_within_buffer"):
        rl["Sampler"](0.6, 0.4, max_priority_within_buffer=True)
    with pytest.raises(ValueError, match="alpha must be"):
        rl["Sampler"](-1.0, 0.4)
    rb = rl["ReplayBuffer"](storage=rl["LazyTensorStorage"](4), sampler=rl["Sampler"](0.6, 0.4), batch_size=2)
    rb.extend(_rows(0, 4))
    with pytest.raises(TypeError, match="TensorDictStoreStorage"):
        rb.sample()
    empty = _buffer(rl, "TensorDictReplayBuffer", 4, server.connection_kwargs())
    with pytest.raises(RuntimeError, match="empty storage"):
        empty.sample()
    with pytest.raises(TypeError, match="TensorDictStoreStorage"):
        rl["StorePRB"](alpha=0.6, beta=0.4, storage=rl["LazyTensorStorage"](4))
    import torchrl.data as data

    indexed = rl["ReplayBuffer"](
        storage=rl["Storage"](4, **server.connection_kwargs()), sampler=rl["Sampler"](0.6, 0.4),
        writer=data.RoundRobinWriter(), batch_size=2,
    )
    indexed.extend(_rows(0, 4))
    with pytest.raises(RuntimeError, match="explicit indices.*TensorDictStoreWriter"):
        indexed.sample()


@pytest.mark.torchrl
def test_sampler_pickles(real_server, rl):
    import pickle

    rb = _buffer(rl, "TensorDictReplayBuffer", 4, real_server.connection_kwargs(), batch_size=2)
    rb.extend(_rows(0, 4))
    rb.sample()
    clone = pickle.loads(pickle.dumps(rb.sampler))
    assert (clone.alpha, clone.beta) == (ALPHA, BETA)


# --------------------------------------------------------------------------- processes
@pytest.mark.torchrl
@pytest.mark.multiprocess
@pytest.mark.parametrize("real_server", ["redis"], indirect=True)
def test_two_learner_processes_share_the_priorities(real_server, rl, pool):
    """A second process's buffer (by td_id) samples by the priorities this one set, and its
    updates are seen here."""
    conn = real_server.connection_kwargs()
    rb = _buffer(rl, "TensorDictPrioritizedReplayBuffer", 16, conn, batch_size=200, td_id="prio-learners")
    rb.extend(_rows(0, 16))
    q = torch.full((16,), 1e-4)
    q[3] = 100.0
    rb.update_priority(torch.arange(16), q)
    share3, _ = pool.submit(w.prio_learner, conn, "prio-learners", 5, 1e6).result(timeout=60)
    assert share3 > 0.95  # the other process drew row 3 almost always
    counts = torch.bincount(rb.sample()["index"], minlength=16)
    assert counts[5] > 190  # its update (row 5 at 1e6) is seen here
    rb.storage.store.clear_redis()


# --------------------------------------------------------------------------- docs
@pytest.mark.torchrl
def test_docs_prioritized_example_runs(redis_server, monkeypatch):
    """The prioritized example of docs/torchrl.md (its ```py block), as written."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "torchrl.md").read_text()
    blocks = re.findall(r"```py\n(.*?)```", text, re.S)
    assert len(blocks) == 1
    monkeypatch.setenv("TDSTORE_URL", redis_server.url)
    exec(compile(blocks[0], "docs/torchrl.md", "exec"), {})
    assert redis_server.sync_client().dbsize() == 0  # the example cleans up after itself
