"""Workers of the prioritized-replay concurrency tests (tests/test_priorities.py): appenders
and learners on one store, importable by spawned processes and usable from threads.

Every appended row holds one token (appender * 10**9 + sequence number) in both of its
entries, so that a reader can tell a torn row (two tokens) and which append it read.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch
from tensordict import TensorDict

from tdstore import TensorDictStore

SCHEMA = {"a": ([], torch.int64), "b": ([2], torch.int64)}


def warm_up(seconds: float) -> int:
    time.sleep(seconds)
    return 0


def rows(tokens: list[int]) -> TensorDict:
    t = torch.tensor(tokens, dtype=torch.int64)
    return TensorDict(a=t, b=t.unsqueeze(1).expand(-1, 2).clone(), batch_size=[len(tokens)])


def appender(conn: dict[str, Any], td_id: str, aid: int, duration: float, seed: int = 0) -> list[tuple[int, int]]:
    """Appends batches of 1 to 8 rows until ``duration`` passes; returns (token, row) of each row."""
    store = TensorDictStore.from_store(td_id=td_id, **conn)
    rng = random.Random(seed * 1000 + aid)
    log: list[tuple[int, int]] = []
    seq = 0
    deadline = time.time() + duration
    while time.time() < deadline:
        n = rng.randint(1, 8)
        tokens = [aid * 10**9 + seq + i for i in range(n)]
        seq += n
        idx = store.extend(rows(tokens))
        log += list(zip(tokens, idx.tolist(), strict=True))
    store.close()
    return log


def learner(conn: dict[str, Any], td_id: str, lid: int, duration: float, batch: int = 32) -> dict[str, Any]:
    """Samples by priority and updates the rows' priorities with their generations until
    ``duration`` passes; returns what it saw: (row, generation, token a, token b) of each
    row drawn, and the (row, generation) of each update left alone."""
    store = TensorDictStore.from_store(td_id=td_id, **conn)
    g = torch.Generator().manual_seed(lid)
    seen: list[tuple[int, int, int, int]] = []
    dropped: list[tuple[int, int]] = []
    applied = updates = samples = 0
    bad_weights = 0
    deadline = time.time() + duration
    while time.time() < deadline:
        try:
            td, info = store.sample(batch, prioritized=True, return_info=True, generator=g)
        except ValueError:  # (nothing appended yet)
            time.sleep(0.01)
            continue
        samples += 1
        w = info["_weight"]
        bad_weights += int((~torch.isfinite(w) | (w <= 0) | (w > 1 + 1e-6)).sum())
        for r, gen, a, b in zip(
            info["index"].tolist(), info["generation"].tolist(), td["a"].tolist(), td["b"].tolist(), strict=True
        ):
            if len(seen) < 20_000:
                seen.append((r, gen, a, b[0] if b[0] == b[1] else -1))  # (-1: the row's b is torn)
        ok = store.update_priority(info["index"], torch.rand(batch, generator=g) * 10, generation=info["generation"])
        updates += 1
        applied += int(ok.sum())
        for r, gen, flag in zip(info["index"].tolist(), info["generation"].tolist(), ok.tolist(), strict=True):
            if not flag:
                dropped.append((r, gen))
    store.close()
    return {
        "seen": seen, "dropped": dropped, "applied": applied, "updates": updates, "batch": batch, "samples": samples,
        "bad_weights": bad_weights,
    }  # fmt: skip
