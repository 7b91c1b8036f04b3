"""Lifetimes of stores: ``expire(seconds)``, ``persist()``, ``ttl()`` (a mixin of TensorDictStore).

A lifetime applies to every key of the store at once (``lua/expire.lua``): the meta hash,
the registry, the counters and every data key expire at the same millisecond of the
server's clock. The steps that create keys later (``commit``, ``reserve`` and the MULTI of an
append, ``write_runs``, and the WATCH-guarded MULTI of indexed writes) read the store's expiry from its meta hash
and give the new keys the same one, in the same atomic step. Data left by a job that
crashed thus cleans itself up.
"""

from __future__ import annotations

import math
import numbers
from functools import partial
from typing import TYPE_CHECKING

from tdstore._backend import lifecycle as _lifecycle
from tdstore._backend import ops as _backend
from tdstore._backend.optimistic import optimistic

if TYPE_CHECKING:
    from tdstore.store import TensorDictStore

__all__ = ["expire", "persist", "ttl", "set_expiry", "ttl_ms"]

#: The longest lifetime a store takes, in ms (15 digits: the scripts' limit).
MAX_TTL_MS = 10**15 - 1


def ttl_ms(seconds: object, where: str) -> int | None:
    """``expire=`` / ``expire(seconds)`` as whole ms (rounded up); None stays None.

    Raises:
        TypeError: ``seconds`` is not a real number.
        ValueError: ``seconds`` is not finite and positive, or too large.
    """
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise TypeError(
            f"the lifetime of {where} must be a number of seconds (int or float), got {type(seconds).__name__} "
            f"{seconds!r}"
        )
    value = float(seconds)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"the lifetime of {where} must be a positive, finite number of seconds, got {seconds!r}; "
            "use persist() to remove an expiry, clear_redis() to delete the store now"
        )
    ms = math.ceil(value * 1000)
    if ms > MAX_TTL_MS:
        raise ValueError(f"the lifetime of {where} must be at most {MAX_TTL_MS // 1000} seconds, got {seconds!r}")
    return ms


def expire(store: TensorDictStore, seconds: float) -> TensorDictStore:
    """:meth:`TensorDictStore.expire` (its documentation is there)."""
    set_expiry(store, ttl_ms(seconds, store._where()))
    return store

def persist(store: TensorDictStore) -> TensorDictStore:
    """:meth:`TensorDictStore.persist` (its documentation is there)."""
    set_expiry(store, None)
    return store

def ttl(store: TensorDictStore) -> float | None:
    """:meth:`TensorDictStore.ttl` (its documentation is there)."""
    conn = store._conn
    pttl = conn.run(lambda c: _backend.ttl_ms(c, conn.keys))
    if pttl == -2:
        raise store._not_found()
    return None if pttl < 0 else pttl / 1000

def set_expiry(store: TensorDictStore, ms: int | None) -> None:
    conn = store._conn

    def once(attempt: int) -> None:
        # after a stale try (a key was added or removed meanwhile): list the keys again
        layout = store._layout(refresh=attempt > 0)
        conn.run(partial(_lifecycle.expire, keys=conn.keys, runner=conn.runner, layout=layout, ttl_ms=ms))
        conn.layout = None  # the meta hash changed ("exp", "ttl")

    optimistic(once, where=store._where, what="expire()/persist()")


