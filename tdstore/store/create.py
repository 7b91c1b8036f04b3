"""Making a store and connecting to one: the work behind :class:`~tdstore.store.core.TensorDictStore`'s
constructors, as functions that take the new handle.

- :func:`schema_ops`: the operations that ``from_schema`` creates the store with, in one
  atomic step (``_create_store``; ``from_tensordict``'s are :func:`tdstore.store.writes.upload_ops`);
- :func:`check_reconnect`: what ``TensorDictStore(td_id=...)`` checks when the store exists;
- :func:`check_layout`: what a handle checks in every layout it reads from the server;
- :func:`resolve_class` and :func:`import_class`: the tensorclass ``from_store`` returns.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from tdstore._backend import ops as _backend
from tdstore._core import chunks as _chunks
from tdstore._core import codec as _codec
from tdstore._core import values as _values
from tdstore._core.layout import Entry
from tdstore.errors import CorruptMetadataError, SchemaError, UnsupportedOperationError

if TYPE_CHECKING:
    from tdstore.store.core import TensorDictStore

__all__ = ["schema_ops", "check_reconnect", "check_layout", "resolve_class", "import_class"]


def schema_ops(
    store: TensorDictStore, bs: torch.Size, entries: Sequence[tuple[tuple[str, ...], list[int], torch.dtype]]
) -> list[_backend.Op]:
    """The operations that create the nodes and the zero-filled entries of a schema on the
    new ``store`` (``entries``: ``tdstore._core.schema.parse_schema``'s); no command carries
    tensor bytes. Every entry's size is checked against the server's limits first."""
    store._conn_max_bulk()  # sets up the connection: proto-max-bulk-len is known
    ops: list[_backend.Op] = []
    seq = 0
    nodes: set[tuple[str, ...]] = set()
    for path, shape, dtype in entries:
        for i in range(1, len(path)):
            if path[:i] not in nodes:
                nodes.add(path[:i])
                seq += 1
                ops.append(_backend.Op("node", path[:i], _values.node_meta(bs, None, [1, seq])))
        full = list(bs) + shape
        nbytes = math.prod(full) * _codec.tensor_nbytes((), dtype)
        seq += 1
        meta = _chunks.annotate(Entry.tensor(_codec.dtype_name(dtype), full, (1, seq)), store._creation_meta())
        # zero-filled on the server: no command carries the bytes
        store._conn.check_entry_size(path, nbytes, store._where(), "schema entry", chunk=meta.chunk, sent=False)
        ops.append(_backend.Op("zero", path, meta, nbytes=nbytes))
    return ops


def check_reconnect(
    store: TensorDictStore, td_id: str, batch_size: torch.Size | None, chunk_bytes: int | None
) -> None:
    """``TensorDictStore(td_id=...)`` found the store already there: the handle connects to it
    as it is, and a ``batch_size`` or ``chunk_bytes`` given that differs from the stored one
    raises :class:`~tdstore.errors.SchemaError` (what another process stored is never reset)."""
    layout = store._layout(refresh=True)
    stored = torch.Size(layout.batch_size)
    if batch_size is not None and stored != batch_size:
        raise SchemaError(
            f"td_id {td_id!r} already holds a store with batch_size={list(stored)}, "
            f"not {list(batch_size)}; use TensorDictStore.from_store(td_id=...) to reconnect"
        )
    stored_cb = int(layout.meta["cb"]) if layout.meta.get("cb") else None
    if chunk_bytes is not None and stored_cb != chunk_bytes:
        raise SchemaError(
            f"td_id {td_id!r} already holds a store with chunk_bytes={stored_cb}, not {chunk_bytes}; "
            "the chunking is set when a store is created (from_store reads it from the server)"
        )


def check_layout(store: TensorDictStore, layout: _backend.Layout) -> None:
    """Raises when ``layout`` (read from the server) is not a TensorDictStore's, or holds
    metadata this handle cannot use (:class:`~tdstore.errors.CorruptMetadataError`)."""
    where = store._where()
    store._check_store_meta(layout, where)
    if layout.meta.get("kind"):
        kind = layout.meta["kind"]
        hint = "connect with tdstore.LazyStackedTensorDictStore.from_store(td_id=...)" if kind == "lazy" else "use the class that wrote it"
        raise UnsupportedOperationError(
            f"store {where} is not a TensorDictStore (kind {kind!r}"
            f"{', a LazyStackedTensorDictStore' if kind == 'lazy' else ''}); {hint}"
        )
    cb = layout.meta.get("cb")
    if cb and not (cb.isdigit() and int(cb) >= _chunks.MIN_CHUNK_BYTES):
        raise CorruptMetadataError(f"store {where} has a malformed chunk size {cb!r}")
    for path, meta in layout.entries.items():
        _values.check_meta(path, meta, where)
    batch_size = _values.parse_dims(layout.meta.get("batch_size"), "batch size", where)
    _values.parse_names(layout.meta.get("names"), len(batch_size), where)
    _values.check_tree(batch_size, layout.entries, where)
    dev = layout.meta.get("device") or ""
    try:
        torch.device(dev) if dev else None
    except (RuntimeError, TypeError, ValueError):
        raise CorruptMetadataError(f"store {where} has a malformed device {dev!r:.200} in its meta hash") from None


def resolve_class(store: TensorDictStore, cls: type, layout: _backend.Layout, tensorclass_cls: type | str | None) -> object:
    """What ``from_store`` returns for the open ``store`` (``layout``: the one it read): the
    store itself, or the tensorclass it was written from (``tensorclass_cls``, else the one
    its meta hash names) wrapping it. The store is closed when that class cannot be imported
    (ImportError)."""
    chosen = tensorclass_cls if tensorclass_cls is not None else layout.meta.get("tensorclass") or None
    if isinstance(chosen, str):
        try:
            chosen = import_class(chosen, store._where())
        except ImportError:
            store.close()
            raise
    if chosen is None or (isinstance(chosen, type) and issubclass(chosen, cls)):
        return store
    return chosen._from_tensordict(store)  # type: ignore[attr-defined]  # (a tensorclass)


def import_class(path: str, where: str = "the store") -> type:
    module_name, _, name = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
        obj: Any = module
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj
    except (ImportError, AttributeError, ValueError) as err:
        raise ImportError(
            f"{where} was written from the tensorclass {path!r}, which cannot be imported here "
            f"({err}); make its module importable, or pass tensorclass_cls=TensorDictStore to "
            "from_store to get the plain store"
        ) from err
