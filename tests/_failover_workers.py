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


def sharded_writer(conn: dict[str, Any], td_id: str, wid: int, duration: float) -> tuple[list[int], list[int]]:
    """As :func:`writer`, on a ShardedStore (the shards in turn): (acknowledged, unknown) counters."""
    from tdstore import ShardedStore

    policy = RetryPolicy(attempts=400, backoff_base=0.05, backoff_cap=0.2, deadline=30.0)
    store = ShardedStore.from_store(td_id=td_id, retry=policy, **conn)
    acked, unknown = [], []
    end = time.time() + duration
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


def sharded_sampler(conn: dict[str, Any], td_id: str, duration: float) -> tuple[list[float], int]:
    """Samples 32 rows of the union in a loop: (the times of the samples that succeeded, failures)."""
    from tdstore import ShardedStore

    policy = RetryPolicy(attempts=400, backoff_base=0.05, backoff_cap=0.2, deadline=30.0)
    store = ShardedStore.from_store(td_id=td_id, retry=policy, **conn)
    ok, failed = [], 0
    end = time.time() + duration
    while time.time() < end:
        try:
            batch = store.sample(32)
            if not bool((batch["w"] > 0).all()):
                raise AssertionError("a sampled row was never written")
            ok.append(time.time())
        except (TDStoreError, TimeoutError, ValueError):
            failed += 1
            time.sleep(0.05)
        time.sleep(0.01)
    store.close()
    return ok, failed
