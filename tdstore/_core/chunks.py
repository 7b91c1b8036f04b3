"""Chunked entries: one tensor entry kept as several row-block strings (pure: key names and
byte arithmetic, no I/O).

A store created with ``chunk_bytes=N`` (meta field ``cb``) keeps every tensor entry of
more than N bytes as strings of at most N bytes each::

    <prefix>:{<td_id>}:c:<k>:<path>   bytes [k * c, (k + 1) * c) of the entry

``c`` (the registry field ``"c"`` of the entry) is a whole number of rows of the entry's
first dim when a row fits in N bytes (row-block chunks: a row never straddles two
strings), else a whole number of elements. Entries of at most N bytes, and non-tensor
entries, stay one ``d:<path>`` string, so small entries cost nothing more.

Every chunk shares the store's hash tag, so scripts and transactions over them stay
legal on Redis Cluster and every operation keeps its atomicity: a byte run of the entry
simply becomes one piece per chunk it crosses (:func:`pieces`).

The client knows an entry's chunking from the layout it planned with (``StoreKeys.chunks``,
replaced with every layout the connection caches); each operation is checked against that
layout's version on the server, so a chunking that changed meanwhile is never used.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import TypeAlias

    from tdstore._core.keys import StoreKeys
    from tdstore._core.layout import Entry

    #: ``(path, runs (offset, length) in the entry, their bytes back to back)`` of a row write
    RunGroup: TypeAlias = "tuple[tuple[str, ...], Sequence[tuple[int, int]], bytes | bytearray | memoryview]"

__all__ = [
    "Chunking", "MIN_CHUNK_BYTES", "annotate", "chunk_size", "check_chunk_bytes", "chunk_map", "of_meta", "pieces",
    "key_groups", "write_pieces", "setrange_commands", "written_keys",
]

#: The smallest chunk size a store accepts (the largest element, complex128, is 16 bytes).
MIN_CHUNK_BYTES = 16
#: The most strings one chunked entry may have: registry metadata that asks for more is
#: damage (a hand edit of ``"c"`` or ``"shape"``), refused before any key name is built.
MAX_CHUNKS = 2**22


@dataclass(frozen=True)
class Chunking:
    """How one entry of ``nbytes`` bytes is split: strings of ``size`` bytes (the last one shorter)."""

    size: int
    nbytes: int

    @property
    def count(self) -> int:
        return max(1, -(-self.nbytes // self.size))

    def length(self, k: int) -> int:
        """The bytes of chunk ``k``."""
        return max(0, min(self.size, self.nbytes - k * self.size))


def check_chunk_bytes(value: object, where: str) -> int | None:
    """Validates the ``chunk_bytes=`` argument (None: entries are never chunked)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < MIN_CHUNK_BYTES:
        raise ValueError(
            f"chunk_bytes of {where} must be an int of at least {MIN_CHUNK_BYTES} bytes (or None for "
            f"one string per entry), got {value!r}"
        )
    return int(value)


#: The environment variable that gives new stores a default ``chunk_bytes``.
ENV = "TDSTORE_CHUNK_BYTES"


def env_chunk_bytes() -> int | None:
    """The default ``chunk_bytes`` of new stores from ``TDSTORE_CHUNK_BYTES`` (unset or empty: None)."""
    import os

    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r} is not a number of bytes (unset it, or give an int of at least {MIN_CHUNK_BYTES})") from None
    if value < MIN_CHUNK_BYTES:
        raise ValueError(f"{ENV}={raw!r} is below the smallest chunk size, {MIN_CHUNK_BYTES} bytes")
    return value


def chunk_size(shape: Sequence[int], itemsize: int, chunk_bytes: int | None) -> int | None:
    """The chunk size of a tensor entry, or None when it stays one string.

    Row blocks of the first dim when a row fits in ``chunk_bytes``; else whole elements.
    """
    if not chunk_bytes:
        return None
    nbytes = math.prod(shape) * itemsize
    if nbytes <= chunk_bytes:
        return None
    row_bytes = nbytes // shape[0]  # nbytes > 0, so shape is not empty and shape[0] > 0
    if row_bytes <= chunk_bytes:
        return (chunk_bytes // row_bytes) * row_bytes
    return (chunk_bytes // itemsize) * itemsize


def annotate(meta: Entry, store_meta: Mapping[str, str]) -> Entry:
    """Adds the chunk size to a new tensor entry's metadata when its store chunks it."""
    cb = store_meta.get("cb")
    if cb and meta.is_tensor:
        assert meta.shape is not None
        size = chunk_size(meta.shape, meta.itemsize, int(cb))
        if size is not None:
            return meta._replace(chunk=size)
    return meta


def chunk_map(entries: Mapping[tuple[str, ...], Entry]) -> dict[tuple[str, ...], Chunking]:
    """The chunking of every chunked entry of a layout's registry (validated when parsed:
    see :meth:`~tdstore._core.layout.Entry.from_json`)."""
    out = {}
    for path, meta in entries.items():
        ch = meta.chunking
        if ch is not None:
            out[path] = ch
    return out


def of_meta(meta: Entry | None) -> Chunking | None:
    """The chunking a registry entry describes (None: one string, or no entry)."""
    return None if meta is None else meta.chunking


def pieces(chunking: Chunking, offset: int, length: int) -> Iterator[tuple[int, int, int]]:
    """``(chunk, offset in the chunk, length)`` of the byte run ``[offset, offset + length)``, in order."""
    size = chunking.size
    end = offset + length
    while offset < end:
        k = offset // size
        local = offset - k * size
        n = min(end - offset, size - local)
        yield k, local, n
        offset += n


# --------------------------------------------------------------------------- writes of runs
# ``groups`` are ``(path, runs, payload)``: byte runs ``(offset, length)`` of the entry at
# ``path`` and their bytes back to back. These map them onto the entry's keys.


def _chunking(keys: StoreKeys, path: tuple[str, ...], extra: Mapping[tuple[str, ...], Chunking | None] | None) -> Chunking | None:
    """The chunking of the entry at ``path``: from ``extra`` (entries created in the same
    step) or from the layout last cached."""
    if extra and path in extra:
        return extra[path]
    return keys.chunks.get(path)


def key_groups(
    keys: StoreKeys, groups: Sequence[RunGroup], extra: Mapping[tuple[str, ...], Chunking | None] | None = None
) -> list[tuple[str, list[tuple[int, int]], bytes | bytearray | memoryview]]:
    """``(key, runs, payload)`` groups of ``(path, runs, payload)`` groups: a chunked entry's
    runs split into the pieces each chunk holds (a group per stretch of pieces in one chunk).

    ``extra``: the chunking of entries the same step creates (path -> Chunking or None)."""
    out: list[tuple[str, list[tuple[int, int]], bytes | bytearray | memoryview]] = []
    for path, runs, payload in groups:
        chunking = _chunking(keys, path, extra)
        if chunking is None:
            out.append((keys.plain(path), list(runs), payload))
            continue
        last_k = -1
        parts: list[bytes | memoryview] = []
        local_runs: list[tuple[int, int]] = []
        for k, offset, data in write_pieces(keys, path, runs, payload, chunking):
            if k != last_k and local_runs:
                out.append((keys.chunk(path, last_k), local_runs, parts[0] if len(parts) == 1 else b"".join(parts)))
                parts, local_runs = [], []
            last_k = k
            local_runs.append((offset, len(data)))
            parts.append(data)
        if local_runs:
            out.append((keys.chunk(path, last_k), local_runs, parts[0] if len(parts) == 1 else b"".join(parts)))
    return out


def write_pieces(
    keys: StoreKeys, path: tuple[str, ...], runs: Sequence[tuple[int, int]], payload: bytes | bytearray | memoryview, chunking: Chunking | None = None
) -> Iterator[tuple[int, int, bytes | memoryview]]:
    """``(chunk, offset in the chunk, bytes)`` of the runs of a chunked entry (``payload``: their bytes back to back)."""
    chunking = chunking if chunking is not None else keys.chunks[path]
    view = payload if isinstance(payload, (bytes, memoryview)) else memoryview(payload)
    pos = 0
    for offset, length in runs:
        for k, local, n in pieces(chunking, offset, length):
            yield k, local, view[pos : pos + n]
            pos += n


def setrange_commands(
    keys: StoreKeys, groups: Sequence[RunGroup], extra: Mapping[tuple[str, ...], Chunking | None] | None = None
) -> Iterator[tuple[str, int, bytes | bytearray | memoryview]]:
    """``(key, offset, bytes)`` of one SETRANGE per run (per piece of a run, in a chunked entry)."""
    for path, runs, payload in groups:
        chunking = _chunking(keys, path, extra)
        if chunking is None:
            data_key = keys.plain(path)
            pos = 0
            for offset, length in runs:
                if length:
                    yield data_key, offset, payload[pos : pos + length]
                pos += length
        else:
            for k, offset, data in write_pieces(keys, path, runs, payload, chunking):
                yield keys.chunk(path, k), offset, data


def written_keys(keys: StoreKeys, groups: Sequence[RunGroup], extra: Mapping[tuple[str, ...], Chunking | None] | None = None) -> set[str]:
    """The keys the runs of ``groups`` write to."""
    out: set[str] = set()
    for path, runs, _ in groups:
        if not runs:
            continue
        chunking = _chunking(keys, path, extra)
        if chunking is None:
            out.add(keys.plain(path))
        else:
            for offset, length in runs:
                out.update(keys.chunk(path, k) for k, _, _ in pieces(chunking, offset, length))
    return out
