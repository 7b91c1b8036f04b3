"""Whole-store lifetime operations: deleting a store (``wipe``), its expiry, listing stores.

The expiry is one server step over every key of a store (the ``expire`` script); a delete is
two (the ``clear`` script's seal, then its delete of the listed keys); a listing is a SCAN of
the store keys under a prefix.
"""

from __future__ import annotations

import redis.exceptions
from redis.crc import key_slot

from tdstore._backend.ops import Layout, _s
from tdstore._backend.protocols import AsyncClient
from tdstore._backend.scripts import ScriptRunner
from tdstore._core import chunks as _chunks
from tdstore._core.keys import StoreKeys
from tdstore._core.layout import parse_layout
from tdstore.errors import CorruptMetadataError

__all__ = ["wipe", "expire", "list_stores"]


def _layout_data_keys(keys: StoreKeys, layout: Layout) -> list[str]:
    """Every key holding the bytes of an entry of ``layout``."""
    chunks = _chunks.chunk_map(layout.entries)
    return [
        key
        for p, e in layout.entries.items() if e.has_data
        for key in keys.entry_keys(p, chunks.get(p))
    ]


#: How long the keys of a store being cleared live at most (ms): a clear killed between its
#: seal and its delete leaves nothing that the registry names once this has passed.
CLEAR_GRACE_MS = 60_000


async def _registry_data_keys(client: AsyncClient, keys: StoreKeys) -> list[str]:
    """The data keys that the (sealed, so frozen) registry names; none where it is damaged
    (the listing finds those keys all the same)."""
    try:
        reg_raw = await client.hgetall(keys.reg)
        layout = parse_layout({b"lv": b"0"}, reg_raw, keys.base)
    except (redis.exceptions.ResponseError, CorruptMetadataError, ValueError, TypeError, KeyError):
        return []
    return [] if layout is None else _layout_data_keys(keys, layout)


#: The most keys the store's slot may hold for :func:`wipe` to list them with one
#: ``CLUSTER GETKEYSINSLOT`` (a reply of that many names); a fuller slot is SCANned.
SLOT_LIST_MAX = 100_000


async def _listed_keys(client: AsyncClient, keys: StoreKeys, cluster_node: bool) -> list[str]:
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


async def wipe(client: AsyncClient, keys: StoreKeys, runner: ScriptRunner, *, cluster_node: bool = False) -> int:
    """Deletes every key of the store whatever its bookkeeping says, in two script steps.

    1. The seal (the clear script's "seal" mode) moves the meta field ``lv`` to
       ``clearing``. From then on no script and no WATCHed transaction finds a store, so
       no writer adds, changes or creates a key of it (an append's first flags and
       counters included), and no new store is made at the id while the meta hash exists.
       This is the step at which the store is gone for every other process.
    2. The keys are listed once: with SCAN (one pass over the database's keyspace, ~1000
       keys per round trip) or, on a Redis Cluster node (``cluster_node``), with
       ``CLUSTER GETKEYSINSLOT`` (the keys of the store's one slot, which holds all of
       them). The list is complete, since nothing changes the store any more; the clear
       script then deletes them, with the meta hash, the registry and every fixed key
       family (named, not listed). The data keys of chunked entries go through short-lived
       trash keys in that step and are then freed one per command (freeing a large string
       blocks the server for as long as it takes, so no step frees more than one chunk).

    A clear therefore never retries however busy the writers are: its cost is one listing.
    It works on a store whose bookkeeping is damaged (a registry or meta hash evicted or
    edited by hand, data keys without a registry entry) and on one whose clear was
    interrupted between the steps (a sealed store: ``from_store`` finds none, ``tdstore ls``
    lists it as being deleted; after the doom step it also frees itself within the grace). In-flight tmp keys are left alone (they expire). Raises
    :class:`~tdstore.errors.StaleLayoutError` only when a store was created at the id
    between the steps (possible only where there was no meta hash to seal).
    """
    await runner.call(client, "clear", [keys.meta], ["seal"])
    fixed = [
        keys.wv, keys.ring, keys.flags, keys.inflight, keys.fence, keys.appends, keys.rl, keys.rate,
        *keys.replay_keys(),
    ]
    named = await _registry_data_keys(client, keys)
    await runner.call(client, "clear", [keys.meta, keys.reg, *fixed, *named], ["doom", str(CLEAR_GRACE_MS)])
    own = {keys.meta, keys.reg, *fixed}
    tmp_prefix = f"{keys.base}:tmp:"
    found = [text for text in await _listed_keys(client, keys, cluster_node) if text not in own and not text.startswith(tmp_prefix)]
    chunk_prefix = f"{keys.base}:c:"
    chunked = sorted({key for key in found if key.startswith(chunk_prefix)})
    plain = sorted(set(found) - set(chunked))
    trash = [keys.tmp() for _ in chunked]
    pairs = [key for pair in zip(chunked, trash, strict=True) for key in pair]
    deleted = int(
        await runner.call(client, "clear", [keys.meta, keys.reg, *fixed, *plain, *pairs], ["absent", "", str(len(chunked))])
    )
    for key in trash:
        await client.delete(key)
    return deleted


async def expire(client: AsyncClient, keys: StoreKeys, runner: ScriptRunner, layout: Layout, ttl_ms: int | None) -> int:
    """Sets (``ttl_ms``) or removes (None) the expiry of every key of the store at ``layout.lv``.

    Returns:
        The absolute expiry in ms on the server's clock, or 0 when removed.
    """
    data_keys = _layout_data_keys(keys, layout)
    return int(
        await runner.call(
            client,
            "expire",
            [keys.meta, keys.reg, keys.wv, keys.ring, keys.flags, keys.inflight, keys.fence, keys.appends, keys.rate,
             *keys.replay_keys(), *data_keys],
            [str(layout.lv), str(len(layout.entries)), "" if ttl_ms is None else str(int(ttl_ms))],
        )
    )


async def list_stores(client: AsyncClient, prefix: str, count: int = 1000) -> list[str]:
    """The td_ids of every store under ``prefix`` (SCAN; no blocking KEYS)."""
    out = []
    async for key in client.scan_iter(match=StoreKeys.meta_pattern(prefix), count=count):
        text = _s(key) or ""
        start, end = text.find("{"), text.rfind("}")
        out.append(text[start + 1 : end])
    return sorted(out)
