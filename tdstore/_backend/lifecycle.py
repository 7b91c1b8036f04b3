"""Whole-store lifetime operations: deleting a store (``wipe``), its expiry, listing stores.

Each is one server step over every key of a store (the ``clear`` and ``expire`` scripts), or a
SCAN of the store keys under a prefix.
"""

from __future__ import annotations

from typing import Any

import redis.exceptions
from redis.crc import key_slot

from tdstore._backend.ops import Layout, _s
from tdstore._backend.scripts import ScriptRunner
from tdstore._core import chunks as _chunks
from tdstore._core.keys import StoreKeys

__all__ = ["wipe", "expire", "list_stores"]


def _layout_data_keys(keys: StoreKeys, layout: Layout) -> list[str]:
    """Every key holding the bytes of an entry of ``layout``."""
    chunks = _chunks.chunk_map(layout.entries)
    return [
        key
        for p, e in layout.entries.items() if e.has_data
        for key in keys.entry_keys(p, chunks.get(p))
    ]


#: The most keys the store's slot may hold for :func:`wipe` to list them with one
#: ``CLUSTER GETKEYSINSLOT`` (a reply of that many names); a fuller slot is SCANned.
SLOT_LIST_MAX = 100_000


async def _listed_keys(client: Any, keys: StoreKeys, cluster_node: bool) -> list[str]:
    """Every key of the store: on a cluster node, the keys of the store's one slot (its hash
    tag's) with the store's name; else (in a slot of more than :data:`SLOT_LIST_MAX` keys,
    or where the server refuses the CLUSTER commands: an ACL, a managed service) a SCAN of
    the whole database."""
    if cluster_node:
        slot = key_slot(keys.meta.encode())
        try:
            count = int(await client.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot))
            if count <= SLOT_LIST_MAX:
                # (room for keys created since the count: a key missed would be left behind)
                names = await client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, count + 1024)
                mine = f"{keys.base}:"
                return [text for text in (_s(name) or "" for name in names) if text.startswith(mine)]
        except redis.exceptions.ResponseError:
            pass  # refused: the SCAN finds the same keys
    return [_s(key) or "" async for key in client.scan_iter(match=keys.pattern(), count=1000)]


async def wipe(client: Any, keys: StoreKeys, runner: ScriptRunner, *, cluster_node: bool = False) -> int:
    """Deletes every key of the store whatever its bookkeeping says, in one step.

    Works on a store whose bookkeeping is damaged (a registry or meta hash evicted or edited
    by hand, data keys without a registry entry): the keys are found with SCAN (one pass over
    the database's keyspace, ~1000 keys per round trip) or, on a Redis Cluster node
    (``cluster_node``), with ``CLUSTER GETKEYSINSLOT`` (the keys of the store's one slot,
    which holds all of them), after the layout
    version and registry size were read, and the clear script deletes them only if neither
    changed since (any new entry changes both), so that nothing written meanwhile is lost
    unseen. In-flight tmp keys are left alone (they expire). The data keys go through
    short-lived trash keys in that step and are then freed one per command (freeing a large
    string blocks the server for as long as it takes, so no step frees more than one chunk).
    The fixed key families (write version, ring cursor, row flags, appends in flight, fence,
    append counters, read leases) are named, not listed, so a key of theirs created after the
    listing (a first append) goes in the same step too.
    """
    # a meta or registry key of another type (damage too) is not read as a hash: the store is
    # then "absent" to the clear script's checks, and the key is deleted with the rest (the
    # script checks again what is read here, in the step that deletes)
    async with client.pipeline(transaction=True) as pipe:
        pipe.type(keys.meta)
        pipe.type(keys.reg)
        pipe.hget(keys.meta, "lv")
        pipe.hlen(keys.reg)
        meta_type, reg_type, lv_raw, n_raw = await pipe.execute(raise_on_error=False)
    lv = _s(lv_raw) if _s(meta_type) == "hash" and lv_raw is not None else None
    n = int(n_raw) if _s(reg_type) == "hash" else -1
    # every fixed key family goes whatever the listing saw: a first append between the listing
    # and the script creates the flags and counters (which move neither version nor count)
    fixed = [keys.wv, keys.ring, keys.flags, keys.inflight, keys.fence, keys.appends, keys.rl]
    own = {keys.meta, keys.reg, *fixed}
    tmp_prefix = f"{keys.base}:tmp:"
    found = [text for text in await _listed_keys(client, keys, cluster_node) if text not in own and not text.startswith(tmp_prefix)]
    chunk_prefix = f"{keys.base}:c:"
    chunked = sorted({key for key in found if key.startswith(chunk_prefix)})
    plain = sorted(set(found) - set(chunked))
    trash = [keys.tmp() for _ in chunked]
    pairs = [key for pair in zip(chunked, trash, strict=True) for key in pair]
    deleted = int(
        await runner.call(
            client,
            "clear",
            [keys.meta, keys.reg, *fixed, *plain, *pairs],
            ["absent" if lv is None else lv if lv.isdigit() else "", str(n) if n >= 0 else "", str(len(chunked))],
        )
    )
    for key in trash:
        await client.delete(key)
    return deleted


async def expire(client: Any, keys: StoreKeys, runner: ScriptRunner, layout: Layout, ttl_ms: int | None) -> int:
    """Sets (``ttl_ms``) or removes (None) the expiry of every key of the store at ``layout.lv``.

    Returns:
        The absolute expiry in ms on the server's clock, or 0 when removed.
    """
    data_keys = _layout_data_keys(keys, layout)
    return int(
        await runner.call(
            client,
            "expire",
            [keys.meta, keys.reg, keys.wv, keys.ring, keys.flags, keys.inflight, keys.fence, keys.appends, *data_keys],
            [str(layout.lv), str(len(layout.entries)), "" if ttl_ms is None else str(int(ttl_ms))],
        )
    )


async def list_stores(client: Any, prefix: str, count: int = 1000) -> list[str]:
    """The td_ids of every store under ``prefix`` (SCAN; no blocking KEYS)."""
    out = []
    async for key in client.scan_iter(match=StoreKeys.meta_pattern(prefix), count=count):
        text = _s(key) or ""
        start, end = text.find("{"), text.rfind("}")
        out.append(text[start + 1 : end])
    return sorted(out)
