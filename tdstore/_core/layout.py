"""The store's metadata as read from the server: a :class:`Layout` snapshot of the meta hash and
the registry, and the parsing of the raw HGETALL replies into one (pure: no I/O).

The server operations that read them live in :mod:`tdstore._backend.ops`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tdstore._core.keys import decode_path

__all__ = ["Layout", "SCRIPT_META_FIELDS", "registry_lost", "parse_layout", "parse_entry"]


@dataclass
class Layout:
    """A consistent snapshot of a store's metadata, at layout version ``lv``."""

    lv: int
    meta: dict[str, str]
    entries: dict[tuple[str, ...], dict[str, Any]]
    wv: str = "0"  #: the write version, when read with the snapshot
    #: values derived from this snapshot (sorted key lists, parsed batch sizes), computed
    #: once per layout: a layout is never changed in place, a new one replaces it
    memo: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)


#: Meta hash fields that only the scripts write (commit.lua refuses them as metadata updates).
SCRIPT_META_FIELDS = frozenset({"lv", "fmt", "lock", "ne", "exp", "ttl"})


def registry_lost(layout: Layout) -> bool:
    """True when the meta hash counts more registry fields than the registry holds.

    A hash is evicted (or deleted by hand) as a whole, so an entry count kept in the meta
    hash (``ne``, maintained by every step that adds or removes a registry field) tells a
    store with no entries from one whose registry is gone. Stores written before the count
    existed have no ``ne`` and are never reported.
    """
    count = layout.meta.get("ne")
    return count is not None and count.isdigit() and int(count) != len(layout.entries)


def _s(value: bytes | str | None) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else value


def parse_layout(meta_raw: Any, reg_raw: Any, base: str = "the store") -> Layout | None:
    """Builds a :class:`Layout` from the raw HGETALL replies of meta and registry.

    Damaged data (a key of the wrong type, bytes that are not UTF-8, a registry value that
    is not JSON, JSON nested too deep, a layout version that is not a number) raises
    :class:`~tdstore.errors.CorruptMetadataError` naming the store (``base``) and the field;
    the entries themselves are checked by the store class (``_check_layout``).
    """
    from tdstore.errors import CorruptMetadataError

    if isinstance(meta_raw, Exception) or isinstance(reg_raw, Exception):
        which, err = ("meta", meta_raw) if isinstance(meta_raw, Exception) else ("reg", reg_raw)
        raise CorruptMetadataError(f"the {which} key of the store {base} cannot be read as a hash: {err}")
    if not meta_raw:
        return None
    try:
        meta = {_s(k): _s(v) for k, v in meta_raw.items()}
    except UnicodeDecodeError:
        raise CorruptMetadataError(f"the meta hash of the store {base} holds bytes that are not UTF-8") from None
    entries: dict[tuple[str, ...], Any] = {}
    for k, v in reg_raw.items():
        try:
            path = decode_path(k)
        except (UnicodeDecodeError, ValueError):
            raise CorruptMetadataError(f"the registry of the store {base} has a malformed field name {k!r:.200}") from None
        entries[path] = parse_entry(path, v, base)
    lv = meta.get("lv") or "0"
    if not lv.isdigit():
        raise CorruptMetadataError(f"the store {base} has a malformed layout version (meta field 'lv') {lv!r:.200}")
    return Layout(int(lv), meta, entries)  # type: ignore[arg-type]


def parse_entry(path: tuple[str, ...], raw: Any, base: str = "the store") -> Any:
    """One registry value: JSON, or :class:`~tdstore.errors.CorruptMetadataError` naming the entry."""
    from tdstore.errors import CorruptMetadataError

    try:
        return json.loads(raw)
    except (ValueError, RecursionError, TypeError):  # UnicodeDecodeError is a ValueError
        raise CorruptMetadataError(
            f"entry {path!r} of the store {base} has registry metadata that is not JSON: {raw!r:.200}"
        ) from None
