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
from tdstore._backend.protocols import AsyncClient
from tdstore._backend.scripts import ScriptRunner, probe_shebang
from tdstore._core import chunks as _chunks
from tdstore._core.keys import CURSOR_MAX, StoreKeys
from tdstore._core.layout import counter_damage
from tdstore.errors import CorruptMetadataError

__all__ = ["StoreReading", "scan_stores", "read_stores", "read_details", "wipe_store", "leaf_paths", "is_sealed"]

#: what a sealed store's ``damage`` says (``StoreReading.sealed``)
SEALED = "being deleted: a clear_redis() is in progress, or was interrupted (`tdstore rm` finishes it)"


def _is_sealed_meta(meta_raw: Any) -> bool:
    """A meta hash that a clear sealed (lua/clear.lua): "clearing" in place of "lv"."""
    if not isinstance(meta_raw, dict):
        return False
    names = {k.decode(errors="replace") if isinstance(k, bytes) else str(k) for k in meta_raw}
    return "clearing" in names and "lv" not in names


def _ring_damage(keys: StoreKeys, ring_raw: Any, flags_len: Any, wv_raw: Any) -> CorruptMetadataError | None:
    """What is wrong with the ring cursor (a count of at most CURSOR_MAX), the row flags (a
    string) or the write version (a counter)."""
    if isinstance(ring_raw, Exception):
        return CorruptMetadataError(f"the ring cursor {keys.ring} cannot be read as a count: {ring_raw}")
    if ring_raw is not None:
        text = ring_raw.decode(errors="replace") if isinstance(ring_raw, bytes) else str(ring_raw)
        if not (text.isascii() and text.isdigit() and int(text) <= CURSOR_MAX):
            return CorruptMetadataError(f"the ring cursor {keys.ring} holds {text[:60]!r}, not a row count")
    if isinstance(flags_len, Exception):
        return CorruptMetadataError(f"the row flags {keys.flags} cannot be read as a string: {flags_len}")
    return counter_damage(wv_raw, keys.wv)


def _data_damage(names: list[str], replies: list[Any]) -> CorruptMetadataError | None:
    """The first data key whose STRLEN the server refused (a key of another type)."""
    for name, reply in zip(names, replies, strict=True):
        if isinstance(reply, Exception):
            return CorruptMetadataError(f"the data key {name} is not a string of bytes: {reply}")
    return None


async def is_sealed(client: AsyncClient, keys: StoreKeys) -> bool:
    """Whether the store is sealed by a clear that has not deleted it yet (see :data:`SEALED`)."""
    return _is_sealed_meta(await client.hgetall(keys.meta) if await client.type(keys.meta) in (b"hash", "hash") else None)


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
    sealed: bool = False  # a clear sealed it and has not deleted it yet (``damage`` says so)


async def scan_stores(client: AsyncClient, prefix: str | None) -> list[tuple[str, str]]:
    """(prefix, td_id) of every store under ``prefix``, or under every prefix when None."""
    if prefix is not None:
        return [(prefix, td_id) for td_id in await _lifecycle.list_stores(client, prefix)]
    found = set()
    async for key in client.scan_iter(match=StoreKeys.any_meta_pattern(), count=1000):
        parsed = StoreKeys.parse_meta_key(key.decode(errors="replace") if isinstance(key, bytes) else str(key))
        if parsed is not None:
            found.add(parsed)
    return sorted(found)


async def read_stores(client: AsyncClient, candidates: list[tuple[str, str]]) -> list[StoreReading]:
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
            pipe.get(k.ring)
            pipe.strlen(k.flags)
            pipe.get(k.wv)
        replies = await pipe.execute(raise_on_error=False)
    readings: list[StoreReading] = []
    good: list[tuple[StoreReading, dict[tuple[str, ...], Any]]] = []
    for i, k in enumerate(keys):
        meta_raw, reg_raw, pttl, ring_raw, flags_len, wv_raw = replies[6 * i : 6 * i + 6]
        reading = StoreReading(k, pttl)
        if _is_sealed_meta(meta_raw):
            reading.sealed, reading.damage = True, CorruptMetadataError(SEALED)
            readings.append(reading)
            continue
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
        readings.append(reading)
        reading.damage = _ring_damage(k, ring_raw, flags_len, wv_raw)
        if reading.damage is None:
            reading.layout = layout
            good.append((reading, chunk_map))
    # one STRLEN per data string; a key of another type is refused alone (raise_on_error=False)
    # and marks its store damaged, so the other stores are listed all the same
    per_store: list[list[list[str]]] = []
    async with client.pipeline(transaction=False) as pipe:
        for reading, chunk_map in good:
            assert reading.layout is not None
            names_of = [reading.keys.entry_keys(path, chunk_map.get(path)) for path in leaf_paths(reading.layout)]
            per_store.append(names_of)
            for names in names_of:
                for name in names:
                    pipe.strlen(name)
        lengths = await pipe.execute(raise_on_error=False)
    pos = 0
    for (reading, _), names_of in zip(good, per_store, strict=True):
        flat = [name for names in names_of for name in names]
        replies_of = lengths[pos : pos + len(flat)]
        pos += len(flat)
        reading.damage = _data_damage(flat, replies_of)
        if reading.damage is not None:
            reading.layout = None
            continue
        it = iter(replies_of)
        reading.leaf_bytes = [sum(int(next(it)) for _ in names) for names in names_of]
    return readings


async def read_details(
    client: AsyncClient, keys: StoreKeys, *extra_keys: str
) -> tuple[_backend.Layout | None, bytes | str | None, bytes | str | None, int | None, list[int], list[bytes | str | None]]:
    """(layout, write version, ring counter, PTTL, data bytes per entry in creation order, then
    the values of ``extra_keys``) of one store; all None and [] when there is no store.

    Raises :class:`~tdstore.errors.CorruptMetadataError` naming the key for damage the
    layout does not show: a data key, the ring cursor or the write version of another type
    or holding garbage (``tdstore rm`` deletes such a store).
    """
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
        pipe.strlen(keys.flags)
        for key in extra_keys:
            pipe.get(key)
        replies = await pipe.execute(raise_on_error=False)
    wv, ring, pttl = replies[:3]
    flat = [name for names in strings for name in names]
    damage = _ring_damage(keys, ring, replies[3 + len(flat)], wv) or _data_damage(flat, replies[3 : 3 + len(flat)])
    if damage is not None:
        raise damage
    lengths, pos = [], 3
    for names in strings:
        lengths.append(sum(replies[pos : pos + len(names)]))
        pos += len(names)
    extra = [None if isinstance(r, Exception) else r for r in replies[pos + 1 :]]
    return layout, wv, ring, pttl, lengths, extra


async def wipe_store(client: AsyncClient, keys: StoreKeys) -> int:
    """Deletes a store whatever its metadata says (:func:`tdstore._backend.lifecycle.wipe`), on a
    client that has not run tdstore's setup (the command line's)."""
    return await _lifecycle.wipe(client, keys, ScriptRunner(await probe_shebang(client)))
