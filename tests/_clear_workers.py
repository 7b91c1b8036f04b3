"""Worker of tests/test_clear.py (importable by spawned processes): a writer that keeps
changing a store's layout until the store is gone, bounded in count and in time."""

from __future__ import annotations

import time
from typing import Any

import torch
from tensordict import TensorDict

from tdstore import StoreNotFoundError, TensorDictStore


def churn(conn: dict[str, Any], td_id: str, started: Any, results: Any, duration: float, rounds: int) -> None:
    """Adds and deletes an entry, and appends rows, until the store is deleted.

    Puts on ``results`` the layout changes and appends that succeeded, and ``refused``: 1 when
    the loop ended on StoreNotFoundError (the store was cleared under it), 0 when it ran out
    of time.
    """
    store = TensorDictStore.from_store(td_id=td_id, **conn)
    n = store.batch_size[0]
    changes = appends = refused = 0
    deadline = time.monotonic() + duration
    try:
        for k in range(rounds):
            if time.monotonic() > deadline:
                break
            try:
                store[f"churn{k % 3}"] = torch.full((n,), float(k))  # a new key: a layout change
                del store[f"churn{k % 3}"]
                changes += 2
                store.extend(TensorDict(x=torch.full((2, 3), float(k)), batch_size=[2]))
                appends += 1
            except StoreNotFoundError:
                refused = 1
                break
            if k == 20:
                started.set()  # the churn is under way: the test may start its clear
    finally:
        started.set()
        store.close()
    results.put({"changes": changes, "appends": appends, "refused": refused})


class Died(Exception):
    """Stands for the process being killed inside a clear_redis()."""


def clear_killed_after_seal(store: TensorDictStore, monkeypatch: Any) -> None:
    """Runs ``store.clear_redis()`` as if the process died after its seal (and grace) steps,
    before the listing and the delete: the store is left sealed."""
    import pytest

    from tdstore._backend import lifecycle

    async def died(*args: Any) -> Any:
        raise Died

    with monkeypatch.context() as m:
        m.setattr(lifecycle, "_listed_keys", died)
        with pytest.raises(Died):
            store.clear_redis()
