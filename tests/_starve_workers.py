"""Workers of tests/test_starvation.py, run in spawned processes: add and delete keys of one
store as fast as they can (every step changes its layout version), bounded in count and time."""

from __future__ import annotations

import time
from typing import Any

import torch


def warm_up(_: float) -> int:
    import tdstore  # noqa: F401 - the import is the warm-up

    return 0


def churn(conn: dict[str, Any], td_id: str, name: str, lazy: bool, rows: int, seconds: float, count: int = 100_000) -> int:
    """Adds and deletes key ``<name><i>`` until ``seconds`` pass (or ``count`` rounds); returns the rounds."""
    from tdstore import LazyStackedTensorDictStore, TensorDictStore

    torch.set_num_threads(1)
    cls = LazyStackedTensorDictStore if lazy else TensorDictStore
    store = cls(td_id=td_id, **conn) if lazy else cls.from_store(td_id=td_id, **conn)
    end = time.monotonic() + seconds
    done = 0
    try:
        for i in range(count):
            if time.monotonic() > end:
                break
            key = f"{name}{i % 8}"
            store[key] = torch.ones(rows, 2)
            store.del_(key)
            done += 1
    finally:
        store.close()
    return done
