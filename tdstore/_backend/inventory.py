"""What the command line reads of the stores on a server: listings, sizes, details, deletion.

The ``tdstore ls``, ``info`` and ``rm`` commands present what these functions read; the reads
themselves (SCAN of the meta keys, pipelines of HGETALL / PTTL / STRLEN) live here, beside the
other server operations, and take key names from :class:`~tdstore._core.keys.StoreKeys` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tdstore._backend import lifecycle as _lifecycle
from tdstore._backend import ops as _backend
from tdstore._backend.scripts import ScriptRunner, probe_shebang
from tdstore._core import chunks as _chunks
from tdstore._core.keys import StoreKeys

__all__ = ["StoreReading", "scan_stores", "read_stores", "read_details", "wipe_store", "leaf_paths"]


def leaf_paths(layout: _backend.Layout) -> list[tuple[str, ...]]:
    """Entries that have data strings: tensors and non-tensors of dense and lazy stores."""
    return [p for p, e in layout.entries.items() if e.has_data]


@dataclass
class StoreReading:
    """One store as read by :func:`read_stores`: its layout and sizes, or what is wrong with it."""

    keys: StoreKeys
    pttl: Any
    layout: _backend.Layout | None = None
    leaf_bytes: list[int] | None = None  # per entry of leaf_paths(layout), chunks summed
    damage: BaseException | None = None


async def scan_stores(client: Any, prefix: str | None) -> list[tuple[str, str]]:
    """(prefix, td_id) of every store under ``prefix``, or under every prefix when None."""
    if prefix is not None:
        return [(prefix, td_id) for td_id in await _lifecycle.list_stores(client, prefix)]
    found = set()
    async for key in client.scan_iter(match=StoreKeys.any_meta_pattern(), count=1000):
        parsed = StoreKeys.parse_meta_key(key.decode(errors="replace") if isinstance(key, bytes) else str(key))
        if parsed is not None:
            found.add(parsed)
    return sorted(found)


async def read_stores(client: Any, candidates: list[tuple[str, str]]) -> list[StoreReading]:
    """Layouts, lifetimes and data sizes of ``candidates`` in two pipelines; stores deleted
    meanwhile and keys that only look like a store's meta are left out."""
    keys = []
    for pfx, td_id in candidates:
        try:
            keys.append(StoreKeys(pfx, td_id))
        except ValueError:
            continue
    async with client.pipeline(transaction=False) as pipe:
        for k in keys:
            pipe.hgetall(k.meta)
            pipe.hgetall(k.reg)
            pipe.pttl(k.meta)
        replies = await pipe.execute(raise_on_error=False)
    readings: list[StoreReading] = []
    good: list[tuple[StoreReading, dict[tuple[str, ...], Any]]] = []
    for i, k in enumerate(keys):
        meta_raw, reg_raw, pttl = replies[3 * i : 3 * i + 3]
        reading = StoreReading(k, pttl)
        try:
            layout = _backend.parse_layout(meta_raw, reg_raw, k.base)
            if layout is not None and "fmt" in layout.meta:
                chunk_map = _chunks.chunk_map(layout.entries)
                layout.batch_size  # noqa: B018 - parsed here: damage shows in the listing
        except (ValueError, TypeError, RecursionError) as err:  # CorruptMetadataError is a ValueError
            reading.damage = err
            readings.append(reading)
            continue
        if layout is None or "fmt" not in layout.meta:
            continue  # deleted meanwhile, or not a tdstore store
        reading.layout = layout
        readings.append(reading)
        good.append((reading, chunk_map))
    counts: list[int] = []
    async with client.pipeline(transaction=False) as pipe:
        for reading, chunk_map in good:
            assert reading.layout is not None
            for path in leaf_paths(reading.layout):
                names = reading.keys.entry_keys(path, chunk_map.get(path))
                counts.append(len(names))
                for name in names:
                    pipe.strlen(name)
        lengths = await pipe.execute()
    pos = 0
    sizes = []
    for n in counts:
        sizes.append(sum(int(x) for x in lengths[pos : pos + n]))
        pos += n
    it = iter(sizes)
    for reading, _ in good:
        assert reading.layout is not None
        reading.leaf_bytes = [next(it) for _ in leaf_paths(reading.layout)]
    return readings


async def read_details(client: Any, keys: StoreKeys, *extra_keys: str) -> tuple[Any, ...]:
    """(layout, write version, ring counter, PTTL, data bytes per entry in creation order, then
    the values of ``extra_keys``) of one store; all None and [] when there is no store."""
    layout = await _backend.fetch_layout(client, keys)
    if layout is None:
        return None, None, None, None, [], []
    paths = sorted(layout.entries, key=lambda p: layout.entries[p].order_key)
    chunk_map = _chunks.chunk_map(layout.entries)
    strings = [keys.entry_keys(p, chunk_map.get(p)) for p in paths if layout.entries[p].has_data]
    async with client.pipeline(transaction=False) as pipe:
        pipe.get(keys.wv)
        pipe.get(keys.ring)
        pipe.pttl(keys.meta)
        for names in strings:
            for name in names:
                pipe.strlen(name)  # a chunked entry: the sum of its chunks
        for key in extra_keys:
            pipe.get(key)
        replies = await pipe.execute()
    lengths, pos = [], 3
    for names in strings:
        lengths.append(sum(replies[pos : pos + len(names)]))
        pos += len(names)
    return layout, replies[0], replies[1], replies[2], lengths, replies[pos:]


async def wipe_store(client: Any, keys: StoreKeys) -> int:
    """Deletes a store whatever its metadata says (:func:`tdstore._backend.lifecycle.wipe`), on a
    client that has not run tdstore's setup (the command line's)."""
    return await _lifecycle.wipe(client, keys, ScriptRunner(await probe_shebang(client)))
