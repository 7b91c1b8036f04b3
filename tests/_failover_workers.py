"""Worker functions for tests/test_sentinel.py's failover test (spawned processes import them by name)."""

from __future__ import annotations

import time
from typing import Any

import torch
from tensordict import TensorDict

from tdstore import OutcomeUnknownError, RetryPolicy, TDStoreError, TensorDictStore


def writer(conn: dict[str, Any], td_id: str, wid: int, duration: float) -> tuple[list[int], list[int]]:
    """Appends rows (wid, counter) for ``duration`` s; returns (acknowledged, unknown) counters."""
    policy = RetryPolicy(attempts=400, backoff_base=0.05, backoff_cap=0.2, deadline=30.0)
    store = TensorDictStore.from_store(td_id=td_id, retry=policy, **conn)
    acked, unknown = [], []
    end = time.time() + duration + 5.0  # (writing starts when the test is ready: see its wait)
    counter = 0
    while time.time() < end:
        counter += 1
        row = TensorDict(w=torch.tensor([wid]), c=torch.tensor([counter]), batch_size=[1])
        try:
            store.extend(row)
            acked.append(counter)
        except (OutcomeUnknownError, TDStoreError, TimeoutError):
            unknown.append(counter)
        time.sleep(0.002)
    store.close()
    return acked, unknown
