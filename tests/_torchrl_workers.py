"""Worker functions of tests/test_torchrl.py (importable by spawned processes).

Each worker builds its own TorchRL ``ReplayBuffer`` on the shared store (by ``td_id``),
runs a loop bounded in count and in time, and returns what the test counts.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from tensordict import TensorDict


def warm_up(seconds: float) -> int:
    """Keeps a pool worker busy so that every worker starts (and imports torchrl) up front."""
    import torchrl.data  # noqa: F401

    import tdstore.torchrl  # noqa: F401

    time.sleep(seconds)
    return 0


def _buffer(conn: dict[str, Any], td_id: str, batch_size: int = 8) -> Any:
    from torchrl.data import ReplayBuffer

    from tdstore.torchrl import TensorDictStoreStorage, TensorDictStoreWriter

    storage = TensorDictStoreStorage(td_id=td_id, **conn)
    return ReplayBuffer(storage=storage, writer=TensorDictStoreWriter(), batch_size=batch_size)


def rows_of(proc: int, step: int, rows: int) -> TensorDict:
    """``rows`` rows tagged (proc, step, i); obs repeats one value per row, to detect torn rows."""
    tag = torch.tensor([[proc, step, i] for i in range(rows)], dtype=torch.int64)
    value = (tag[:, 0] * 1000 + tag[:, 1] * 10 + tag[:, 2]).float()
    return TensorDict(tag=tag, obs=value[:, None].expand(rows, 6).clone(), batch_size=[rows])


def _wait_for(path: str, deadline: float) -> None:
    while not os.path.exists(path) and time.time() < deadline:
        time.sleep(0.01)


def extender(conn: dict[str, Any], td_id: str, proc: int, steps: int, rows: int, duration: float, go: str) -> list[int]:
    """Appends ``steps`` batches through the buffer once ``go`` exists; returns the indices handed back."""
    deadline = time.time() + duration
    rb = _buffer(conn, td_id)
    _wait_for(go, deadline)
    indices: list[int] = []
    for step in range(steps):
        if time.time() > deadline:
            break
        indices.extend(rb.extend(rows_of(proc, step, rows)).tolist())
    rb.storage.store.close()
    return indices


def sampler(
    conn: dict[str, Any], td_id: str, until: int, duration: float, max_rounds: int, go: str
) -> tuple[int, int, int]:
    """Creates ``go`` (the writers start), then samples until ``until`` rows were appended in all.

    Returns (samples, torn rows, rows read that no append had written yet).
    """
    deadline = time.time() + duration
    rb = _buffer(conn, td_id, batch_size=16)
    samples = torn = unwritten = 0
    with open(go, "w"):
        pass
    for _ in range(max_rounds):
        if time.time() > deadline or rb.storage.store.ring_state().total >= until:
            break
        if len(rb) == 0:
            time.sleep(0.001)
            continue
        batch = rb.sample()
        samples += 1
        obs, tag = batch["obs"], batch["tag"]
        expected = (tag[:, 0] * 1000 + tag[:, 1] * 10 + tag[:, 2]).float()
        blank = obs[:, 0] == -1  # the test fills the buffer with -1 before any append
        unwritten += int(blank.sum())
        torn += int(((obs != expected[:, None]).any(dim=1) & ~blank).sum())
    rb.storage.store.close()
    return samples, torn, unwritten


def prio_learner(conn: dict[str, Any], td_id: str, row: int, priority: float) -> tuple[float, int]:
    """A second learner (tests/test_torchrl_prio.py): samples the prioritized buffer ``td_id``
    through its own TorchRL buffer, then gives ``row`` the ``priority``.

    Returns (the share of the draws that were row 3, the draws)."""
    from tdstore.torchrl import TensorDictStoreStorage, prioritized_replay_buffer

    rb = prioritized_replay_buffer(TensorDictStoreStorage(td_id=td_id, **conn), 0.7, 0.5, 1e-8, batch_size=500)
    index = rb.sample()["index"]
    rb.update_priority(torch.tensor([row]), torch.tensor([priority]))
    share = float((index == 3).double().mean())
    rb.storage.store.close()
    return share, int(index.numel())


def episodes_of(proc: int, episode: int, first: int, count: int) -> TensorDict:
    """Steps ``first`` .. ``first + count - 1`` of episode ``episode`` of writer ``proc``:
    ``traj`` one id per episode, ``step`` the step number, ``obs`` both (a torn row shows)."""
    traj = torch.full((count,), proc * 10_000 + episode, dtype=torch.int64)
    step = torch.arange(first, first + count, dtype=torch.int64)
    obs = (traj * 1000 + step).float()[:, None].expand(count, 4).clone()
    return TensorDict(traj=traj, step=step, obs=obs, batch_size=[count])


def episode_writer(conn: dict[str, Any], td_id: str, proc: int, episodes: int, duration: float, go: str) -> int:
    """Appends ``episodes`` episodes of 4 to 12 steps, each in one or two ``rb.extend`` calls
    (so the writers' rows interleave within episodes); returns the rows appended."""
    import random

    deadline = time.time() + duration
    rb = _buffer(conn, td_id)
    rng = random.Random(proc)
    _wait_for(go, deadline)
    rows = 0
    for episode in range(episodes):
        if time.time() > deadline:
            break
        length = rng.randint(4, 12)
        cut = rng.randint(1, length)
        for first, count in ((0, cut), (cut, length - cut)):
            if count:
                rb.extend(episodes_of(proc, episode, first, count))
                rows += count
    rb.storage.store.close()
    return rows


def slice_learner(conn: dict[str, Any], td_id: str, slice_len: int, duration: float, max_rounds: int, go: str) -> dict[str, int]:
    """Samples slices by ``traj_key="traj"`` through TorchRL's TensorDictReplayBuffer until
    the writers are done; counts slices that mix episodes, skip steps, or hold torn rows."""
    from torchrl.data import TensorDictReplayBuffer

    from tdstore.torchrl import TensorDictStoreSliceSampler, TensorDictStoreStorage

    deadline = time.time() + duration
    rb = TensorDictReplayBuffer(
        storage=TensorDictStoreStorage(td_id=td_id, **conn),
        sampler=TensorDictStoreSliceSampler(slice_len=slice_len, traj_key="traj"),
        batch_size=8 * slice_len,
    )
    with open(go, "w"):
        pass
    counts = {"samples": 0, "slices": 0, "mixed": 0, "gaps": 0, "torn": 0, "not_yet": 0}
    done_file = go + ".done"
    for _ in range(max_rounds):
        if time.time() > deadline or os.path.exists(done_file):
            break
        try:
            batch = rb.sample()
        except (ValueError, RuntimeError):  # (no slice of slice_len steps yet)
            counts["not_yet"] += 1
            time.sleep(0.005)
            continue
        counts["samples"] += 1
        traj = batch["traj"].view(-1, slice_len)
        step = batch["step"].view(-1, slice_len)
        counts["slices"] += traj.shape[0]
        counts["mixed"] += int((traj != traj[:, :1]).any(dim=1).sum())
        counts["gaps"] += int(((step[:, 1:] - step[:, :-1]) != 1).any(dim=1).sum())
        expected = (batch["traj"] * 1000 + batch["step"]).float()
        counts["torn"] += int((batch["obs"] != expected[:, None]).any(dim=1).sum())
    rb.storage.store.close()
    return counts


def sharded_sampler(storage: Any, prioritized: bool, alpha: float, beta: float, rounds: int) -> dict[str, list[Any]]:
    """Samples a pickled ShardedStoreStorage (tests/test_torchrl_sharded.py) in this process:
    a buffer of its own over the same ShardedStore; returns what it drew."""
    from torchrl.data import ReplayBuffer

    from tdstore.torchrl import ShardedStorePrioritizedSampler, ShardedStoreWriter, prioritized_replay_buffer

    if prioritized:
        rb = prioritized_replay_buffer(storage, alpha, beta, batch_size=64)
    else:
        rb = ReplayBuffer(storage=storage, writer=ShardedStoreWriter(), batch_size=64)
    out: dict[str, list[Any]] = {"index": [], "obs": [], "weight": [], "len": [len(rb)], "td_id": [storage.store.td_id]}
    for _ in range(rounds):
        batch, info = rb.sample(return_info=True)
        out["index"].extend(info["index"].tolist())
        out["obs"].extend(batch["obs"][:, 0].tolist())
        if prioritized:
            out["weight"].extend(info["_weight"].tolist())
    assert not prioritized or isinstance(rb._sampler, ShardedStorePrioritizedSampler)
    storage.store.close()
    return out
