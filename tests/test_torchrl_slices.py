"""TorchRL slice samplers with the slices drawn on the server (``tdstore.torchrl.slices``, issue 26 item 4).

Run in the tensordict 0.14.3 + TorchRL 0.14.1 environment of ``.ci/run`` (``-m torchrl``).
TorchRL's own ``SliceSampler`` on a ``LazyTensorStorage`` given the same rows is the
reference for what a sample holds (slices of consecutive rows inside one episode, the
truncated / done / terminated / is_init info); the frequencies are checked by chi-square.
"""

from __future__ import annotations

import doctest
import importlib
import threading
from typing import Any

import _torchrl_workers as w
import pytest
import torch
from fixtures import PoolSpec
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore.testing.counts import record

pytestmark = pytest.mark.torchrl

WRITERS = 3
POOL = PoolSpec(workers=WRITERS + 1, warm_up=w.warm_up, warm_up_arg=0.5)

#: episode ends of the 40 rows the tests append: episodes of 5, 7, 3, 10, 6 and 9 rows
ENDS = [4, 11, 14, 24, 30, 39]
N = 40


@pytest.fixture
def rl() -> dict[str, Any]:
    import torchrl.data as data

    import tdstore.torchrl as tds

    return {"data": data, "tds": tds}


def _episodes(n: int = N, ends: list[int] = ENDS, *, traj: bool = False, init: bool = False) -> TensorDict:
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[ends] = True
    episode = torch.cumsum(torch.nn.functional.pad(done[:-1, 0].long(), (1, 0)), 0)
    td = TensorDict(
        obs=torch.arange(n), episode=episode, next=TensorDict(done=done, terminated=done.clone(), batch_size=[n]),
        batch_size=[n],
    )  # fmt: skip
    if not traj:
        del td["episode"]
    if init:
        td["is_init"] = torch.nn.functional.pad(done[:-1, 0], (1, 0), value=True).unsqueeze(1)
    return td


def _buffer(rl, server, sampler, capacity: int = 64, batch_size: int = 12, kind: str = "TensorDictReplayBuffer"):
    storage = rl["tds"].TensorDictStoreStorage(capacity, **server.connection_kwargs())
    return getattr(rl["data"], kind)(
        storage=storage, sampler=sampler, writer=rl["tds"].TensorDictStoreWriter(), batch_size=batch_size
    )


def _windows(slice_len: int, ends: list[int] = ENDS) -> list[int]:
    """The start rows of every slice of ``slice_len`` rows that stays inside one episode."""
    starts, begin = [], 0
    for end in ends:
        starts += list(range(begin, end - slice_len + 2))
        begin = end + 1
    return starts


def _check_slices(obs: torch.Tensor, num_slices: int, slice_len: int) -> list[int]:
    """Each slice: consecutive rows, inside one episode (only its last row may end one)."""
    slices = obs.reshape(num_slices, slice_len)
    assert bool(((slices[:, 1:] - slices[:, :-1]) == 1).all()), slices
    for row in slices.tolist():
        assert not any(r in ENDS for r in row[:-1]), f"slice {row} crosses an episode end"
    return slices[:, 0].tolist()


# --------------------------------------------------------------------------- what a sample is
@pytest.mark.parametrize("server", ["fakeredis", "redis"], indirect=True)
@pytest.mark.parametrize("how", ["slice_len", "num_slices"])
def test_a_sample_is_torchrls_slices_drawn_on_the_server(server, rl, how):
    """The same keys, shapes and info as TorchRL's SliceSampler on LazyTensorStorage."""
    kw = {"slice_len": 3} if how == "slice_len" else {"num_slices": 4}
    rb = _buffer(rl, server, rl["tds"].TensorDictStoreSliceSampler(**kw), batch_size=12)
    ref = rl["data"].TensorDictReplayBuffer(
        storage=rl["data"].LazyTensorStorage(64), sampler=rl["data"].SliceSampler(**kw), batch_size=12
    )
    data = _episodes(init=True)
    assert rb.extend(data).tolist() == list(range(N))
    ref.extend(data)
    ours, theirs = rb.sample(), ref.sample()
    assert sorted(map(str, ours.keys(True, True))) == sorted(map(str, theirs.keys(True, True)))
    for key in theirs.keys(True, True):
        if key != "index":
            assert ours[key].shape == theirs[key].shape and ours[key].dtype == theirs[key].dtype, key
    num_slices, slice_len = (4, 3)
    starts = _check_slices(ours["obs"], num_slices, slice_len)
    assert torch.equal(ours["index"].reshape(-1), ours["obs"])
    truncated = ours["next", "truncated"].view(num_slices, slice_len)
    assert truncated[:, -1].all() and not truncated[:, :-1].any()
    stored_done = torch.zeros(N, dtype=torch.bool)
    stored_done[ENDS] = True
    assert torch.equal(ours["next", "done"].reshape(-1), stored_done[ours["obs"]] | truncated.reshape(-1))
    assert torch.equal(ours["next", "terminated"].reshape(-1), stored_done[ours["obs"]])
    init = ours["is_init"].view(num_slices, slice_len)
    assert init[:, 0].all()
    assert all(s in _windows(slice_len) for s in starts)


@pytest.mark.parametrize("server", ["fakeredis", "redis"], indirect=True)
def test_replay_buffer_and_return_info(server, rl):
    """A plain ReplayBuffer(sampler=...): rows and TorchRL's info dict, keyed as TorchRL's."""
    rb = _buffer(rl, server, rl["tds"].TensorDictStoreSliceSampler(slice_len=4), batch_size=8, kind="ReplayBuffer")
    rb.extend(_episodes())
    batch, info = rb.sample(return_info=True)
    _check_slices(batch["obs"], 2, 4)
    assert torch.equal(info["index"], batch["obs"])
    assert info[("next", "truncated")].view(2, 4)[:, -1].all()


@pytest.mark.parametrize("server", ["fakeredis", "redis"], indirect=True)
@pytest.mark.parametrize("key", ["traj_key", "default-episode", "end_key"])
def test_the_episode_key_follows_torchrls_rule(server, rl, key):
    """traj_key= given, or "episode" found in the storage (TorchRL's default), or end_key=."""
    kw = {"traj_key": "episode"} if key == "traj_key" else {"end_key": ("next", "done")} if key == "end_key" else {}
    rb = _buffer(rl, server, rl["tds"].TensorDictStoreSliceSampler(slice_len=5, **kw), batch_size=10)
    rb.extend(_episodes(traj=key != "end_key"))
    for _ in range(20):
        batch = rb.sample()
        _check_slices(batch["obs"], 2, 5)
        if key != "end_key":
            ep = batch["episode"].view(2, 5)
            assert bool((ep == ep[:, :1]).all())


@pytest.mark.parametrize("server", ["fakeredis", "redis"], indirect=True)
def test_starts_are_uniform_over_the_valid_windows(server, rl):
    """30,000 slices: the start rows match the uniform law over every window that stays in
    one episode (chi-square, p > 0.001), and no slice crosses an episode end."""
    from scipy.stats import chisquare

    slice_len = 3
    rb = _buffer(rl, server, rl["tds"].TensorDictStoreSliceSampler(slice_len=slice_len), batch_size=3 * 500)
    rb.extend(_episodes())
    rb.set_rng(torch.Generator().manual_seed(3))
    windows = _windows(slice_len)
    counts = dict.fromkeys(windows, 0)
    for _ in range(60):
        for s in _check_slices(rb.sample()["obs"], 500, slice_len):
            counts[s] += 1  # (a start outside the windows: KeyError)
    observed = torch.tensor([counts[s] for s in windows], dtype=torch.float64)
    expected = torch.full_like(observed, observed.sum() / len(windows))
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3


@pytest.mark.parametrize("server", ["fakeredis", "redis"], indirect=True)
def test_a_sample_reads_its_rows_once_and_per_thread(server, rl):
    """rb.sample() takes the rows store.sample_slices read (one read), one slot per thread:
    four threads sampling at once each get the rows of their own draw."""
    rb = _buffer(rl, server, rl["tds"].TensorDictStoreSliceSampler(slice_len=2), batch_size=8)
    rb.extend(_episodes())
    hits = rb.storage.handoff_hits
    rb.sample()
    assert rb.storage.handoff_hits == hits + 1
    bad: list[str] = []

    def sample_many() -> None:
        for _ in range(25):
            batch = rb.sample()
            if not torch.equal(batch["index"], batch["obs"]):
                bad.append(f"index {batch['index'].tolist()} with rows {batch['obs'].tolist()}")

    threads = [threading.Thread(target=sample_many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert bad == [] and rb.storage.handoff_hits == hits + 1 + 100


# --------------------------------------------------------------------------- prioritized
@pytest.mark.parametrize("server", ["fakeredis", "redis"], indirect=True)
def test_prioritized_slices_follow_the_start_priorities(server, rl):
    """Starts drawn by p^alpha of their row among the valid windows (chi-square over 20,000
    slices); weights TorchRL's (N P)^-beta / max, one per slice given to each of its rows."""
    from scipy.stats import chisquare

    alpha, beta, eps, slice_len = 0.7, 0.5, 1e-8, 3
    sampler = rl["tds"].TensorDictStorePrioritizedSliceSampler(alpha, beta, eps, slice_len=slice_len)
    rb = _buffer(rl, server, sampler, batch_size=3 * 400)
    rb.extend(_episodes())
    q = torch.rand(N, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 4 + 0.1
    rb.update_priority(torch.arange(N), q)
    rb.set_rng(torch.Generator().manual_seed(5))
    windows = _windows(slice_len)
    p = (q[windows] + eps) ** alpha
    prob = p / p.sum()
    counts = dict.fromkeys(windows, 0)
    for _ in range(50):
        batch = rb.sample()
        starts = _check_slices(batch["obs"], 400, slice_len)
        w = batch["_weight"].view(400, slice_len)
        assert bool((w == w[:, :1]).all())
        for s in starts:
            counts[s] += 1
    observed = torch.tensor([counts[s] for s in windows], dtype=torch.float64)
    assert chisquare(observed.numpy(), (prob * observed.sum()).numpy()).pvalue > 1e-3
    # the weights of the last batch, against the formula over the rows the server holds
    p_all = (q + eps) ** alpha
    p_min = p_all.min() / p_all.sum()
    expected = ((p_all[torch.tensor(starts)] / p_all.sum()) / p_min) ** -beta
    assert torch.allclose(batch["_weight"].view(400, slice_len)[:, 0].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("server", ["fakeredis", "redis"], indirect=True)
def test_prioritized_update_reaches_the_server_and_stale_rows_are_left_alone(server, rl):
    """rb.update_priority(index of a sample) sets every row of its slices, except the rows
    appended to since the sample (their generation moved); update_tensordict_priority too."""
    from tdstore.replay.priorities import generations, tree_report

    sampler = rl["tds"].TensorDictStorePrioritizedSliceSampler(1.0, 0.4, 0.0, slice_len=2)
    storage = rl["tds"].TensorDictStoreStorage(N, **server.connection_kwargs())
    rb = rl["data"].TensorDictReplayBuffer(
        storage=storage,
        sampler=sampler,
        writer=rl["tds"].TensorDictStoreWriter(),
        batch_size=8,
        priority_key="td_error",
    )
    rb.extend(_episodes())
    batch = rb.sample()
    rows = batch["index"]
    # the sampler enabled the priorities before the first append: each row's generation is its position + 1
    assert torch.equal(batch["generation"], rows + 1)
    applied = sampler.update_priority(batch["index"], torch.full((8,), 7.0))
    assert bool(applied.all())
    leaves = torch.as_tensor(tree_report(storage.store)["leaves"], dtype=torch.float64)
    assert torch.allclose(leaves[rows], torch.full((8,), 7.0, dtype=torch.float64))
    q = torch.full((N,), 1e-6)
    q[0] = 1e6  # the slices start at row 0 (almost surely): rows 0 and 1 are drawn
    rb.update_priority(torch.arange(N), q)
    batch = rb.sample()
    assert bool((batch["index"] == 0).any())
    storage.store.extend(_episodes(2, [1]))  # the ring is full: rows 0 and 1 appended to again
    batch["td_error"] = torch.full((8,), 3.0)
    rb.update_tensordict_priority(batch)
    leaves = torch.as_tensor(tree_report(storage.store)["leaves"], dtype=torch.float64)
    stale = (batch["index"] == 0) | (batch["index"] == 1)
    assert torch.allclose(leaves[batch["index"][~stale]], torch.tensor(3.0, dtype=torch.float64))
    assert torch.allclose(leaves[:2], torch.tensor(1e6, dtype=torch.float64))  # the new rows: the max priority
    # slices of rows appended with priorities on: every row's generation is its append position + 1
    rb.update_priority(torch.arange(N), torch.ones(N))
    for _ in range(20):
        batch = rb.sample()
        assert torch.equal(batch["generation"], generations(storage.store, batch["index"]))
    assert torch.equal(generations(storage.store, torch.tensor([0, 1, 2])), torch.tensor([41, 42, 3]))
    # priorities turned off and on again (another process): generations 0, read from the server for the update
    storage.store.disable_priorities()
    batch = rb.sample()
    assert torch.equal(batch["generation"], torch.zeros(8, dtype=torch.long))
    assert bool(sampler.update_priority(batch["index"], torch.full((8,), 2.0)).all())


@pytest.mark.parametrize("server", ["fakeredis"], indirect=True)
def test_prioritized_slice_sampler_state_round_trip(server, rl):
    sampler = rl["tds"].TensorDictStorePrioritizedSliceSampler(0.6, 0.4, slice_len=2)
    rb = _buffer(rl, server, sampler, batch_size=4)
    rb.extend(_episodes())
    rb.update_priority(torch.arange(N), torch.arange(N, dtype=torch.float64) + 1)
    state = rb.state_dict()
    other = _buffer(rl, server, rl["tds"].TensorDictStorePrioritizedSliceSampler(0.6, 0.4, slice_len=2), batch_size=4)
    other.load_state_dict(state)
    other.sample()
    q = other.sampler.state_dict()["priority"]
    assert torch.allclose(
        torch.as_tensor(q, dtype=torch.float64)[:N], torch.arange(N, dtype=torch.float64) + 1, rtol=1e-6
    )


# --------------------------------------------------------------------------- refused, with reasons
@pytest.mark.parametrize(
    "kw, error, says",
    [
        ({}, TypeError, "exactly one of num_slices= and slice_len="),
        ({"slice_len": 2, "num_slices": 2}, TypeError, "exactly one"),
        ({"slice_len": 0}, ValueError, "slice_len must be an int >= 1"),
        ({"slice_len": 2, "end_key": "done", "traj_key": "episode"}, ValueError, "not both"),
        ({"slice_len": 2, "strict_length": False}, ValueError, "always slice_len rows within one episode"),
        ({"slice_len": 2, "span": True}, ValueError, "span=True is not supported"),
        ({"slice_len": 2, "cache_values": True}, ValueError, "nothing to cache"),
        ({"slice_len": 2, "compile": True}, ValueError, "nothing to compile"),
        ({"slice_len": 2, "fragmented": True}, ValueError, "consecutive appended rows"),
        ({"slice_len": 2, "end_keys": [("next", "done")]}, ValueError, "one end_key"),
        ({"slice_len": 2, "no_such": 1}, TypeError, "unexpected keyword argument 'no_such'"),
    ],
)
def test_what_the_server_does_not_do_is_refused_clearly(rl, kw, error, says):
    with pytest.raises(error, match=says.replace("(", r"\(").replace(")", r"\)")):
        rl["tds"].TensorDictStoreSliceSampler(**kw)


@pytest.mark.parametrize("server", ["fakeredis"], indirect=True)
def test_bad_use_gives_clear_errors_and_changes_nothing(server, rl):
    rb = _buffer(rl, server, rl["tds"].TensorDictStoreSliceSampler(slice_len=4), batch_size=10)
    with pytest.raises(RuntimeError, match="empty storage"):
        rb.sample()
    rb.extend(_episodes())
    before = rb.storage.store.to_tensordict()
    with pytest.raises(RuntimeError, match="not divisible by the slice length 4"):
        rb.sample(10)
    rb2 = _buffer(rl, server, rl["tds"].TensorDictStoreSliceSampler(slice_len=11), batch_size=11)
    rb2.extend(_episodes())  # no episode of 11 rows
    with pytest.raises(ValueError, match="slice"):
        rb2.sample()
    with pytest.raises(TypeError, match="needs a TensorDictStoreStorage"):
        rl["tds"].TensorDictStoreSliceSampler(slice_len=2).sample(rl["data"].LazyTensorStorage(4), 4)
    assert (rb.storage.store.to_tensordict() == before).all()


# --------------------------------------------------------------------------- the docs
@pytest.mark.parametrize(
    "module",
    ["tdstore.torchrl", "tdstore.torchrl.storage", "tdstore.torchrl.prioritized", "tdstore.torchrl.slices", "tdstore.torchrl.sharded"],
)
def test_the_module_examples_run(redis_server, monkeypatch, module):
    """The docstring examples of tdstore.torchrl (test_docs skips them: the main run has no
    torchrl), on a real server through TDSTORE_URL."""
    monkeypatch.setenv("TDSTORE_URL", redis_server.url)
    mod = importlib.import_module(module)
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = [t for t in finder.find(mod, module) if t.examples and t.name.startswith(module)]
    for test in tests:
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.failed == 0
    if module in ("tdstore.torchrl", "tdstore.torchrl.slices", "tdstore.torchrl.sharded"):
        assert results.attempted > 0
    client = redis_server.sync_client()
    try:
        assert client.dbsize() == 0  # the examples clean up after themselves
    finally:
        client.close()


def test_docs_slices_example_runs(redis_server, monkeypatch):
    """The slice example of docs/torchrl.md (its ```python3 block), as written."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "torchrl.md").read_text()
    blocks = re.findall(r"```python3\n(.*?)```", text, re.S)
    assert len(blocks) == 1
    monkeypatch.setenv("TDSTORE_URL", redis_server.url)
    exec(compile(blocks[0], "docs/torchrl.md", "exec"), {})
    client = redis_server.sync_client()
    try:
        assert client.dbsize() == 0  # the example cleans up after itself
    finally:
        client.close()


def test_store_handle_round_trip_of_a_sampled_buffer(redis_server, rl):
    """A second handle (from_store) sees the rows the buffer appended: the slices came from the server."""
    rb = _buffer(rl, redis_server, rl["tds"].TensorDictStoreSliceSampler(slice_len=2), batch_size=4)
    rb.extend(_episodes())
    other = TensorDictStore.from_store(td_id=rb.storage.store.td_id, **redis_server.connection_kwargs())
    try:
        batch, info = other.sample_slices(2, 2, end_key=("next", "done"), return_info=True)
        _check_slices(batch["obs"], 2, 2)
    finally:
        other.close()
        rb.storage.store.clear_redis()


@pytest.mark.multiprocess
@pytest.mark.parametrize("real_server", ["redis", "valkey"], indirect=True)
def test_processes_append_episodes_while_a_learner_samples_slices(real_server, rl, pool, request, tmp_path):
    """3 writer processes append episodes through TorchRL buffers, each episode in one or two
    extends (so the writers' rows interleave), into a ring that wraps; a learner process
    samples slices by traj_key meanwhile. No slice mixes episodes, skips a step or holds a
    torn row; afterwards a fresh handle's slices are whole too."""
    conn = real_server.connection_kwargs()
    schema = {"traj": ([], torch.int64), "step": ([], torch.int64), "obs": ([4], torch.float32)}
    store = TensorDictStore.from_schema(schema, batch_size=[600], **conn)
    go = str(tmp_path / "go")
    learner = pool.submit(w.slice_learner, conn, store.td_id, 3, 30.0, 5_000, go)
    writers = [pool.submit(w.episode_writer, conn, store.td_id, p, 150, 30.0, go) for p in range(WRITERS)]
    rows = sum(f.result(timeout=90) for f in writers)
    open(go + ".done", "w").close()
    counts = learner.result(timeout=90)
    after = TensorDictStore.from_store(td_id=store.td_id, **conn)
    try:
        batch = after.sample_slices(200, 3, traj_key="traj")
        traj, step = batch["traj"].view(200, 3), batch["step"].view(200, 3)
        final_bad = int(((traj != traj[:, :1]).any(dim=1) | ((step[:, 1:] - step[:, :-1]) != 1).any(dim=1)).sum())
    finally:
        after.close()
    record(request, writers=WRITERS, rows_appended=rows, **counts, final_bad_slices=final_bad)
    assert rows > 600 and counts["samples"] > 0 and counts["slices"] > 0
    assert (counts["mixed"], counts["gaps"], counts["torn"], final_bad) == (0, 0, 0, 0)
    store.clear_redis()
    store.close()
