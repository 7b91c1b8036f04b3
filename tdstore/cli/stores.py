"""``tdstore ls``, ``info`` and ``rm``: read store metadata and present it.

Metadata comes through :mod:`tdstore._backend.ops` (``list_stores``, ``parse_layout``,
``fetch_layout``) and key names through :class:`~tdstore._core.keys.StoreKeys`; nothing here
parses key names beyond taking the prefix of a meta key that SCAN returned. Sizes are the
servers' own string lengths (STRLEN of each data key), the TTL is the meta key's PTTL, and
the age comes from a creation timestamp in the meta hash when the store has one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

from tdstore._backend import inventory as _inventory
from tdstore._backend import ops as _backend
from tdstore._core.keys import StoreKeys, encode_path

if TYPE_CHECKING:
    from tdstore._backend.protocols import AsyncClient
    from tdstore.cli.commands import ConnOptions
    from tdstore.sharded import ShardedStore

_T = TypeVar("_T")

__all__ = ["list_store_infos", "store_info", "remove_stores", "format_ls", "format_info", "table"]

#: meta hash fields that may hold a creation time (seconds or milliseconds since the epoch)
CREATED_FIELDS = ("created", "created_at", "ctime")
#: stores read per pipeline round trip in ``ls``
LS_BATCH = 100


# --------------------------------------------------------------------------- formatting
def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def human_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f}s" if s >= 10 else f"{s:.1f}s"
    minutes, sec = divmod(int(s), 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    return f"{hours // 24}d{hours % 24:02d}h"


def table(headers: list[str], rows: list[list[str]], right: frozenset[int] | set[int] = frozenset()) -> str:
    """A plain text table: columns padded to their widest cell, numbers (``right``) right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: list[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)]) + "\n"


def _shape(dims: object) -> str:
    if isinstance(dims, dict) and "ragged" in dims:
        return "ragged " + " | ".join(_shape(d) for d in dims["ragged"])
    return "[" + ", ".join(str(d) for d in dims) + "]" if isinstance(dims, list) else "-"


# --------------------------------------------------------------------------- reading
def _text(value: object) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _ttl_seconds(pttl: int | None) -> float | None:
    """PTTL reply -> seconds left, or None when the key has no expiry (-1) or is gone (-2)."""
    ms = int(pttl) if pttl is not None else -1
    return ms / 1000.0 if ms >= 0 else None


def _age_seconds(meta: dict[str, str], now: float) -> float | None:
    for name in CREATED_FIELDS:
        raw = meta.get(name)
        if not raw:
            continue
        try:
            stamp = float(raw)
        except ValueError:
            continue
        if stamp > 1e11:  # milliseconds
            stamp /= 1000.0
        return max(0.0, now - stamp)
    return None


#: the registry entry of a ShardedStore's manifest store (tdstore.sharded)
SHARDED_MANIFEST = ("sharded_manifest",)


_leaf_paths = _inventory.leaf_paths


def store_kind(layout: _backend.Layout) -> str:
    """``"lazy"`` (LazyStackedTensorDictStore), ``"sharded"`` (a ShardedStore's manifest) or ``"store"``."""
    if layout.meta.get("kind") == "lazy":
        return "lazy"
    if SHARDED_MANIFEST in layout.entries and len(layout.entries) == 1:
        return "sharded"
    return "store"


def _run(opts: ConnOptions, fn: Callable[..., Awaitable[_T]]) -> _T:
    """Runs ``fn(client)`` on tdstore's IO loop with a fresh ``redis.asyncio`` client."""
    from tdstore._backend import loop as _io

    async def call() -> _T:
        client = opts.async_client()
        try:
            return await fn(client)
        finally:
            await client.aclose()

    return _io.sync(call(), opts.timeout * 4)


async def _summaries(client: AsyncClient, prefix: str | None) -> list[dict[str, Any]]:
    now = time.time()
    candidates = await _inventory.scan_stores(client, prefix)
    out: list[dict[str, Any]] = []
    for start in range(0, len(candidates), LS_BATCH):
        for reading in await _inventory.read_stores(client, candidates[start : start + LS_BATCH]):
            k, layout = reading.keys, reading.layout
            if reading.damage is not None or layout is None or reading.leaf_bytes is None:
                summary = _damaged_summary(k, reading.damage or ValueError("unreadable"), reading.pttl)
                if reading.sealed:
                    summary["kind"] = "deleting"
                out.append(summary)
                continue
            out.append(
                {
                    "td_id": k.td_id,
                    "prefix": k.prefix,
                    "kind": store_kind(layout),
                    "batch_size": layout.batch_size,
                    "entries": len(reading.leaf_bytes),
                    "bytes": sum(reading.leaf_bytes),
                    "age_s": _age_seconds(layout.meta, now),
                    "ttl_s": _ttl_seconds(reading.pttl),
                }
            )
    return out


def _damaged_summary(k: StoreKeys, err: BaseException, pttl: object) -> dict[str, Any]:
    """The ``ls`` line of a store whose metadata cannot be read (``tdstore rm`` deletes it)."""
    return {
        "td_id": k.td_id, "prefix": k.prefix, "kind": "damaged", "batch_size": None, "entries": None,
        "bytes": 0, "age_s": None, "ttl_s": _ttl_seconds(pttl) if isinstance(pttl, int) else None,
        "damage": str(err),
    }


def list_store_infos(opts: ConnOptions, prefix: str | None) -> list[dict[str, Any]]:
    """One summary per store (dicts ready for JSON), sorted by prefix and td_id; a store
    whose metadata cannot be read is listed with kind "damaged" (and what is wrong)."""
    summaries: list[dict[str, Any]] = _run(opts, lambda client: _summaries(client, prefix))
    summaries.sort(key=lambda s: (s["prefix"], s["td_id"]))
    return summaries


def _list(dims: tuple[int, ...] | None) -> list[int] | None:
    return None if dims is None else list(dims)


def _parent_batch(layout: _backend.Layout, path: tuple[str, ...]) -> list[int]:
    parent = layout.entries.get(path[:-1]) if len(path) > 1 else None
    if parent is not None and parent.is_node:
        return list(parent.batch_size or [])
    return list(layout.batch_size)


async def _details(
    client: AsyncClient, keys: StoreKeys
) -> tuple[_backend.Layout | None, bytes | str | None, bytes | str | None, int | None, list[Any]]:
    layout, wv, ring, pttl, lengths, extra = await _inventory.read_details(client, keys, keys.data(SHARDED_MANIFEST))
    if layout is not None and store_kind(layout) != "sharded":
        extra = []
    return layout, wv, ring, pttl, lengths + list(extra)


def _manifest(raw: Any) -> dict[str, Any] | None:
    """The manifest of a ShardedStore (a JSON text stored as a JSON non-tensor value)."""
    try:
        value = json.loads(raw)
        value = json.loads(value) if isinstance(value, str) else value
    except (TypeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def store_info(opts: ConnOptions, prefix: str, td_id: str) -> dict[str, Any]:
    """Everything ``tdstore info`` shows about one store (a dict ready for JSON)."""
    from tdstore.errors import CliError

    try:
        keys = StoreKeys(prefix, td_id)
    except ValueError as err:
        raise CliError(f"tdstore: {err}", 2) from None
    layout, wv, ring, pttl, strlens = _run(opts, lambda client: _details(client, keys))
    if layout is None and _run(opts, lambda client: _inventory.is_sealed(client, keys)):
        from tdstore.errors import CorruptMetadataError

        raise CorruptMetadataError(f"the store {td_id!r} under prefix {prefix!r} is {_inventory.SEALED}")
    if layout is None:
        raise CliError(
            f"tdstore: no store with td_id={td_id!r} under prefix {prefix!r} on {opts.describe()} "
            "(`tdstore ls` lists the stores)"
        )
    kind = store_kind(layout)
    manifest = _manifest(strlens.pop()) if kind == "sharded" else None
    lengths = iter(strlens)
    paths = sorted(layout.entries, key=lambda p: layout.entries[p].order_key)
    entries = []
    for path in paths:
        meta = layout.entries[path]
        k = meta.kind
        row: dict[str, Any] = {"key": list(path), "field": encode_path(path)}
        if k in ("t", "lt"):
            # a lazy leaf has one shape per element when the elements differ (ragged)
            shape = _list(meta.shape) if meta.shapes is None else {"ragged": [list(s) for s in meta.shapes]}
            row.update(kind="tensor", shape=shape, dtype=meta.dtype, bytes=int(next(lengths)))
        elif k in ("nt", "lnt"):
            shape = _parent_batch(layout, path)[: meta.stack] if k == "nt" else None
            row.update(kind="non-tensor", shape=shape, dtype=meta.enc, bytes=int(next(lengths)))
        elif k == "td":
            row.update(kind="tensordict", shape=_list(meta.batch_size), dtype=None, bytes=None)
        else:
            row.update(kind=f"unknown ({k!r})", shape=None, dtype=None, bytes=int(next(lengths)))
        entries.append(row)
    m = layout.meta
    total = sum(e["bytes"] for e in entries if e["bytes"] is not None)
    return {
        "td_id": td_id,
        "prefix": prefix,
        "server": opts.describe(),
        "kind": kind,
        "stack_dim": int(m["stack_dim"]) if kind == "lazy" and m.get("stack_dim", "").lstrip("-").isdigit() else None,
        "sharded_blocks": int(manifest["blocks"]) if manifest and str(manifest.get("blocks", "")).isdigit() else None,
        "batch_size": json.loads(m.get("batch_size") or "[]"),
        "device": m.get("device") or None,
        "names": json.loads(m.get("names") or "null"),
        "tensorclass": m.get("tensorclass") or None,
        "format": m.get("fmt"),
        "layout_version": layout.lv,
        "write_version": int(_text(wv) or 0),
        "locked": m.get("lock") == "1",
        # chunk_bytes= of the store (None: one string per entry), and its chunked entries
        "chunking": (
            {"chunk_bytes": int(m["cb"]), "chunked_entries": sum(1 for e in layout.entries.values() if e.chunk is not None)}
            if str(m.get("cb") or "").isdigit() else None
        ),
        "ring_total": int(_text(ring) or 0) if ring is not None else None,
        "ttl_s": _ttl_seconds(pttl),
        "age_s": _age_seconds(m, time.time()),
        "bytes": total,
        "entries": entries,
    }


# --------------------------------------------------------------------------- presenting
def _leaves(info: dict[str, Any]) -> int:
    return sum(1 for e in info["entries"] if e["kind"] != "tensordict")


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word[:-1]}ies" if word.endswith("y") else f"{n} {word}s"


def format_ls(stores: list[dict[str, Any]], where: str) -> str:
    if not stores:
        return f"no stores on {where}\n"
    rows = [
        [
            s["td_id"],
            s["prefix"],
            s["kind"],
            _shape(s["batch_size"]) if s["batch_size"] is not None else "?",
            str(s["entries"]) if s["entries"] is not None else "?",
            human_bytes(s["bytes"]),
            human_seconds(s["age_s"]),
            human_seconds(s["ttl_s"]) if s["ttl_s"] is not None else "none",
        ]
        for s in stores
    ]
    text = table(["TD_ID", "PREFIX", "KIND", "BATCH", "ENTRIES", "BYTES", "AGE", "TTL"], rows, right={4, 5, 6, 7})
    total = sum(s["bytes"] for s in stores)
    plural = "s" if len(stores) != 1 else ""
    for s in stores:
        if s["kind"] == "deleting":
            text += f"deleting: {s['td_id']} (prefix {s['prefix']!r}): {s['damage'][:300]}\n"
        elif s.get("damage"):
            text += f"damaged: {s['td_id']} (prefix {s['prefix']!r}): {s['damage'][:300]} (`tdstore rm` deletes it)\n"
    return text + f"{len(stores)} store{plural}, {human_bytes(total)} ({total:,} bytes) on {where}\n"


def _kind_text(info: dict[str, Any]) -> str:
    if info["kind"] == "lazy":
        return f"LazyStackedTensorDictStore (stack_dim {show(info['stack_dim'])})"
    if info["kind"] == "sharded":
        blocks = info["sharded_blocks"]
        return f"ShardedStore manifest ({show(blocks)} blocks: {info['td_id']}.b0 ...)"
    return "TensorDictStore"


def show(value: object) -> str:
    return "-" if value is None else str(value)


def format_info(info: dict[str, Any]) -> str:
    header = [
        ("td_id", info["td_id"]),
        ("prefix", info["prefix"]),
        ("server", info["server"]),
        ("kind", _kind_text(info)),
        ("batch size", _shape(info["batch_size"])),
        ("device", show(info["device"])),
        ("names", show(info["names"])),
        ("tensorclass", show(info["tensorclass"])),
        ("format", show(info["format"])),
        ("layout version", str(info["layout_version"])),
        ("write version", str(info["write_version"])),
        ("lock", "locked" if info["locked"] else "unlocked"),
        ("chunking", show(info["chunking"])),
        ("ring", "-" if info["ring_total"] is None else f"{info['ring_total']:,} rows appended"),
        ("age", human_seconds(info["age_s"])),
        ("ttl", human_seconds(info["ttl_s"]) if info["ttl_s"] is not None else "none"),
        ("size", f"{human_bytes(info['bytes'])} ({info['bytes']:,} bytes) in {_count(_leaves(info), 'entry')}"),
    ]
    width = max(len(name) for name, _ in header)
    lines = "".join(f"{name.ljust(width)}  {value}\n" for name, value in header)
    rows = [
        [
            ".".join(e["key"]),
            e["kind"],
            _shape(e["shape"]),
            show(e["dtype"]),
            "-" if e["bytes"] is None else f"{e['bytes']:,}",
        ]
        for e in info["entries"]
    ]
    if not rows:
        return lines + "\n(no entries)\n"
    return lines + "\n" + table(["KEY", "KIND", "SHAPE", "DTYPE", "BYTES"], rows, right={4})


# --------------------------------------------------------------------------- deleting
def _open(info: dict[str, Any], prefix: str, opts: ConnOptions) -> ShardedStore:
    """The ShardedStore of ``info``, so that ``clear_redis()`` deletes its blocks too."""
    from tdstore import ShardedStore

    return ShardedStore.from_store(td_id=info["td_id"], prefix=prefix, **opts.store_kwargs())


def _rm_summary(info: dict[str, Any]) -> str:
    if info["kind"] in ("damaged", "deleting"):
        return str(info["kind"])
    if info["kind"] == "sharded":
        return f"ShardedStore with {show(info['sharded_blocks'])} blocks"
    return human_bytes(info["bytes"])


def remove_stores(
    opts: ConnOptions, prefix: str, td_ids: list[str], *, yes: bool, as_json: bool, out: TextIO, stdin: TextIO
) -> int:
    """Deletes the stores ``td_ids`` as ``clear_redis()`` does (sealed in one step, then freed),
    damaged stores and ones whose clear was interrupted included."""
    import sys

    from tdstore import StoreNotFoundError
    from tdstore.errors import CliError, CorruptMetadataError, DataLostError

    found: list[dict[str, Any]] = []
    missing: list[str] = []
    for td_id in td_ids:
        try:
            found.append(store_info(opts, prefix, td_id))
        except CliError as err:
            if err.code != 1:
                raise
            missing.append(td_id)
        except (CorruptMetadataError, DataLostError) as err:
            # damaged metadata: still deleted (by the store's key pattern)
            kind = "deleting" if _inventory.SEALED in str(err) else "damaged"
            found.append({"td_id": td_id, "kind": kind, "bytes": 0, "entries": [], "locked": False, "damage": str(err)})
    for td_id in missing:
        print(f"tdstore rm: no store with td_id={td_id!r} under prefix {prefix!r} on {opts.describe()}", file=sys.stderr)
    if not found:
        return 1
    if not yes:
        listing = ", ".join(f"{s['td_id']} ({_rm_summary(s)}{', locked' if s['locked'] else ''})" for s in found)
        prompt = f"delete {len(found)} store{'s' if len(found) != 1 else ''} on {opts.describe()}: {listing}? [y/N] "
        print(prompt, end="", file=sys.stderr, flush=True)
        answer = stdin.readline().strip().lower()
        if answer not in ("y", "yes"):
            print("tdstore rm: nothing deleted", file=sys.stderr)
            return 1
    deleted = []
    for info in found:
        if info["kind"] != "sharded":
            # one step of the server's (the clear script after a SCAN of the store's keys), whatever
            # the metadata says: no store class to open, so no torch to import
            keys = StoreKeys(prefix, info["td_id"])
            if _run(opts, lambda client, keys=keys: _inventory.wipe_store(client, keys)):
                deleted.append(info)
            else:
                missing.append(info["td_id"])  # deleted by someone else since
            continue
        try:
            store = _open(info, prefix, opts)  # clear_redis(): the manifest, then every block
        except StoreNotFoundError:
            missing.append(info["td_id"])
            continue
        try:
            store.clear_redis()
        finally:
            store.close()
        deleted.append(info)
    if as_json:
        doc = {"deleted": [d["td_id"] for d in deleted], "bytes": sum(d["bytes"] for d in deleted), "missing": missing}
        json.dump(doc, out, indent=2)
        out.write("\n")
    else:
        for d in deleted:
            out.write(f"deleted {d['td_id']} ({_rm_summary(d)}, {_count(_leaves(d), 'entry')})\n")
    return 1 if missing else 0
