"""Worker functions for tests/test_sharded_ring.py (spawned processes import them by name)."""

from __future__ import annotations

import time
from typing import Any

import torch
from tensordict import TensorDict

from tdstore import ShardedStore

WIDTH = 16


def warm_up(seconds: float) -> int:
    """Keeps a pool worker busy so that every worker gets started (and imports torch) up front."""
    time.sleep(seconds)
    return 0


def tagged_rows(writer: int, call: int, n: int) -> TensorDict:
    """``n`` rows whose ``v`` holds the tag ``writer * 1_000_000 + call * 100 + row`` in every element."""
    tags = writer * 1_000_000 + call * 100 + torch.arange(n)
    return TensorDict(v=tags[:, None].expand(n, WIDTH).clone(), tag=tags.clone(), batch_size=[n])


def writer(conn: dict[str, Any], td_id: str, who: int, calls: int, n: int, start: float, pin: bool) -> list[list[int]]:
    """``calls`` extends of ``n`` tagged rows (round-robin, or pinned to ``who % shards``) from
    ``start`` on; returns the indices each acknowledged extend got."""
    buf = ShardedStore.from_store(td_id=td_id, **conn)
    if pin:
        buf.pin_shard = who % buf.num_blocks
    time.sleep(max(0.0, start - time.time()))
    out = []
    for call in range(calls):
        out.append(buf.extend(tagged_rows(who, call, n)).tolist())
    buf.close()
    return out
