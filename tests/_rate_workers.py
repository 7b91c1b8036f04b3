"""Worker functions for tests/test_rate_limit.py (spawned processes import them by name)."""

from __future__ import annotations

import time
from typing import Any

import torch
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore.errors import RateLimitTimeoutError


def warm_up(seconds: float) -> int:
    """Keeps a pool worker busy so that every worker gets started (and imports torch) up front."""
    time.sleep(seconds)
    return 0


def appender(conn: dict[str, Any], td_id: str, start: float, duration: float, rows: int) -> tuple[int, int]:
    """Appends ``rows``-row batches from ``start`` for ``duration`` seconds; returns (rows
    appended, calls the limiter held back past its timeout)."""
    store = TensorDictStore.from_store(td_id=td_id, **conn)
    batch = TensorDict(x=torch.ones(rows, 4), batch_size=[rows])
    time.sleep(max(0.0, start - time.time()))
    deadline = time.time() + duration
    done = timeouts = 0
    while time.time() < deadline:
        try:
            store.extend(batch)
            done += rows
        except RateLimitTimeoutError:
            timeouts += 1
    store.close()
    return done, timeouts


def sampler(conn: dict[str, Any], td_id: str, start: float, duration: float, n: int) -> tuple[int, int]:
    """Samples ``n`` rows at a time from ``start`` for ``duration`` seconds; returns (rows
    sampled, calls held back past the timeout)."""
    store = TensorDictStore.from_store(td_id=td_id, **conn)
    time.sleep(max(0.0, start - time.time()))
    deadline = time.time() + duration
    done = timeouts = 0
    while time.time() < deadline:
        try:
            batch = store.sample(n)
            assert batch.batch_size == torch.Size([n])
            done += n
        except RateLimitTimeoutError:
            timeouts += 1
    store.close()
    return done, timeouts


def slow_appender(conn: dict[str, Any], td_id: str, pause: float, reserved: Any) -> None:
    """Appends 2 rows of 7.0, pausing ``pause`` seconds between the reserve and the write
    (``reserved`` is set at the start of the pause)."""
    from tdstore._backend import append as _append

    write = _append.AppendPlan.write_commands

    def slow(self: Any, *args: Any, **kwargs: Any) -> Any:
        reserved.set()
        time.sleep(pause)
        return write(self, *args, **kwargs)

    _append.AppendPlan.write_commands = slow  # type: ignore[method-assign]
    store = TensorDictStore.from_store(td_id=td_id, **conn)
    store.extend(TensorDict(x=torch.full((2, 4), 7.0), batch_size=[2]))
    store.close()
