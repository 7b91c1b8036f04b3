"""Workers and helpers of the trajectory-slice tests (tests/test_slices.py): episodes whose
rows identify themselves, a checker of slices, a Python reference of the valid windows, and
appender and sampler processes on one store.

Every row of episode ``ep`` at step ``t`` holds ``ep`` and ``t`` in two entries and
``[ep, t, ep + t]`` in a third, with ``done`` at the episode's last row and ``traj = ep``:
a checker can tell a torn row (its entries disagree), a slice across two episodes, and
rows that are not consecutive.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from tdstore import TensorDictStore

END = ("next", "done")
SCHEMA: dict[Any, Any] = {
    "ep": ([], torch.int64), "step": ([], torch.int64), "obs": ([3], torch.int64),
    END: ([1], torch.bool), "traj": ([], torch.int64),
}


def warm_up(seconds: float) -> int:
    time.sleep(seconds)
    return 0


def episode(ep: int, n: int, start: int = 0, done: bool = True) -> TensorDict:
    """Steps ``start .. start + n - 1`` of episode ``ep``; the last row ends it when ``done``."""
    step = torch.arange(start, start + n, dtype=torch.int64)
    epv = torch.full((n,), ep, dtype=torch.int64)
    end = torch.zeros(n, 1, dtype=torch.bool)
    if done:
        end[-1] = True
    return TensorDict(
        {"ep": epv, "step": step, "obs": torch.stack([epv, step, epv + step], 1), END: end, "traj": epv.clone()},
        batch_size=[n],
    )


def bad_slices(batch: TensorDictBase, length: int) -> dict[str, int]:
    """Counts of the slices of ``batch`` (flat, ``length`` rows each) that hold a torn row,
    cross an episode end, hold two episodes or rows that are not consecutive steps."""
    ep = batch["ep"].reshape(-1, length)
    step = batch["step"].reshape(-1, length)
    obs = batch["obs"].reshape(-1, length, 3)
    done = batch[END].reshape(-1, length)
    torn = ((obs[..., 0] != ep) | (obs[..., 1] != step) | (obs[..., 2] != ep + step) | (batch["traj"].reshape(-1, length) != ep)).any(1)
    crossing = done[:, :-1].any(1)
    mixed = (ep != ep[:, :1]).any(1)
    gaps = (step[:, 1:] - step[:, :-1] != 1).any(1) if length > 1 else torch.zeros(ep.shape[0], dtype=torch.bool)
    return {"torn": int(torn.sum()), "crossing": int(crossing.sum()), "mixed": int(mixed.sum()), "gaps": int(gaps.sum())}


def valid_starts(done: list[bool], flags: list[bool], ids: list[int] | None, cursor: int, length: int) -> list[int]:
    """The reference: every absolute position ``a`` whose window ``[a, a + length)`` lies in
    the ring (``cursor - min(cursor, cap) <= a <= cursor - length``), holds only flagged rows,
    and has no end in its first ``length - 1`` rows (``ids`` given: one id)."""
    cap = len(done)
    size = min(cursor, cap)
    out = []
    for a in range(cursor - size, cursor - length + 1):
        rows = [(a + i) % cap for i in range(length)]
        if not all(flags[r] for r in rows):
            continue
        if ids is None:
            if any(done[r] for r in rows[:-1]):
                continue
        elif any(ids[r] != ids[rows[0]] for r in rows):
            continue
        out.append(a)
    return out


def appender(conn: dict[str, Any], td_id: str, aid: int, duration: float, seed: int = 0) -> int:
    """Appends whole episodes of 1 to 10 rows (``done`` at each one's end) until ``duration``
    passes; returns the rows appended."""
    store = TensorDictStore.from_store(td_id=td_id, **conn)
    rng = random.Random(seed * 1000 + aid)
    rows = k = 0
    deadline = time.time() + duration
    while time.time() < deadline:
        n = rng.randint(1, 10)
        store.extend(episode(aid * 10**6 + k, n))
        k += 1
        rows += n
    store.close()
    return rows


def sampler(conn: dict[str, Any], td_id: str, length: int, duration: float, prioritized: bool = False) -> dict[str, int]:
    """Samples slices of ``length`` rows until ``duration`` passes; returns the counts of
    :func:`bad_slices`, of slices and samples, and of draw steps (a sample whose slices were
    appended to before the check draws again)."""
    from tdstore.replay import slices as S

    store = TensorDictStore.from_store(td_id=td_id, **conn)
    counts = {"torn": 0, "crossing": 0, "mixed": 0, "gaps": 0, "slices": 0, "samples": 0, "draws": 0}
    real = S._draw

    def counting(*args: Any, **kwargs: Any) -> Any:
        counts["draws"] += 1  # (more draws than samples: slices appended to under a read, drawn again)
        return real(*args, **kwargs)

    S._draw = counting
    try:
        deadline = time.time() + duration
        while time.time() < deadline:
            try:
                batch = store.sample_slices(16, length, end_key=END, prioritized=prioritized)
            except ValueError:  # (no episode of length rows yet)
                time.sleep(0.01)
                continue
            for k, v in bad_slices(batch, length).items():
                counts[k] += v
            counts["slices"] += 16
            counts["samples"] += 1
    finally:
        S._draw = real
    store.close()
    return counts
