"""Worker functions for tests/test_appends.py (spawned processes import them by name)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from tensordict import TensorDict

from tdstore import TensorDictStore


def warm_up(seconds: float) -> int:
    """Keeps a pool worker busy so that every worker gets started (and imports torch) up front."""
    time.sleep(seconds)
    return 0


def sub_appender(
    conn: dict[str, Any], td_id: str, sub: str, start: float, count: int, duration: float, stop_file: str | None = None
) -> int:
    """Appends 4-row batches to ``store[sub]`` from ``start`` (a time.time()) on, at most
    ``count`` times and ``duration`` seconds, and until ``stop_file`` exists; returns the
    number of appends."""
    store = TensorDictStore.from_store(td_id=td_id, **conn)
    part = store[sub]
    batch = TensorDict(obs=torch.ones(4, 8), batch_size=[4])
    time.sleep(max(0.0, start - time.time()))
    deadline = time.time() + duration
    done = 0
    while done < count and time.time() < deadline:
        if stop_file is not None and done % 8 == 0 and os.path.exists(stop_file):
            break
        part.extend(batch)
        done += 1
    store.close()
    return done
