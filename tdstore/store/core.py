"""TensorDictStore: a TensorDict whose entries live on a Redis-wire server.

All TensorDict semantics live here; every server operation is in :mod:`tdstore._backend.ops`.
The consistency rules (see ``docs/guarantees.md``):

* one logical operation is one atomic server step (the ``commit`` and ``write_runs``
  scripts, or one MULTI/EXEC for reads);
* every layout change bumps a store-wide layout version in the same step; reads get the
  version with the bytes, and writes send the version they assume, so cached metadata
  is never used stale: the client refreshes and retries.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase
from tensordict.utils import is_tensorclass

from tdstore._backend import ops as _backend
from tdstore._backend import transfer as _transfer
from tdstore._backend.connection import Connection, open_connection
from tdstore._backend.loop import DEFAULT_TIMEOUT
from tdstore._backend.optimistic import optimistic
from tdstore._backend.retry import RetryPolicy
from tdstore._core import chunks as _chunks
from tdstore._core import values as _values
from tdstore._core.indexing import normalize_index, select_rows
from tdstore._core.keys import as_path as _as_path
from tdstore._core.keys import new_td_id
from tdstore._core.planner import WritePlanner, check_tensor, flatten_values, tensor_like
from tdstore._core.values import NO_DEFAULT, is_no_default
from tdstore.errors import (
    CorruptMetadataError,
    EntryNotFoundError,
    SchemaError,
    StoreExistsError,
    StoreNotFoundError,
)
from tdstore.store.api import StoreAPI
from tdstore.store.compat import StoreCompat014
from tdstore.store.layout_cache import LayoutCache
from tdstore.store.lifetime import LifetimeAPI, ttl_ms
from tdstore.store.reads import StoreReads
from tdstore.store.ring import RingBufferAPI
from tdstore.store.unsupported import StoreUnsupported
from tdstore.store.views import StoreKeysView

__all__ = ["TensorDictStore"]


class TensorDictStore(
    LayoutCache, StoreAPI, StoreReads, RingBufferAPI, LifetimeAPI, StoreUnsupported, StoreCompat014, TensorDictBase
):
    """A TensorDict whose entries live on a Redis-compatible server.

    See the module docstring and ``docs/`` for the full guide; the public API follows
    ``TensorDictBase`` plus the classmethods ``from_dict``, ``from_tensordict``,
    ``from_schema`` and ``from_store``.

    Examples:
        >>> import torch
        >>> from tdstore import TensorDictStore
        >>> td = TensorDictStore(batch_size=[100])
        >>> td["obs"] = torch.randn(100, 84)
        >>> td["obs"].shape  # fetched from the store
        torch.Size([100, 84])
        >>> td.clear_redis()
        >>> td.close()
    """

    # hooks of TensorDictBase (0.15) for backends whose reads return copies
    _reads_return_copies = True
    _leaves_built_on_read = True
    _storage_holds_no_gradients = True
    _contiguous_via_to_tensordict = True
    _masking_on_dense_copy = True
    _masked_select_on_dense_copy = True
    _map_on_dense_copies = True
    _update_stores_copy_of_self = True
    _pin_memory_unsupported = True
    _setitem_key_inplace = False

    def __init__(
        self,
        *,
        backend: str = "redis",
        host: str = "localhost",
        port: int = 6379,
        db: int = 0,
        unix_socket_path: str | None = None,
        prefix: str = "tensordict",
        batch_size: Sequence[int] | torch.Size | None = None,
        device: torch.device | str | int | None = None,
        client: Any = None,
        td_id: str | None = None,
        cache_metadata: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        names: Sequence[str | None] | None = None,
        allow_pickle: bool | None = None,
        pickle_key: bytes | str | None = None,
        expire: float | None = None,
        progress: bool | None = None,
        retry: RetryPolicy | int | bool | None = None,
        chunk_bytes: int | None = None,
        _create: bool = True,
        **redis_kwargs: Any,
    ) -> None:
        if batch_size is not None and any(not isinstance(d, int) or d < 0 for d in torch.Size(batch_size)):
            raise SchemaError(f"batch_size must hold non-negative ints, got {list(batch_size)}")
        conn = open_connection(
            host=host, port=port, db=db, unix_socket_path=unix_socket_path, client=client, prefix=prefix,
            td_id=td_id if td_id is not None else new_td_id(), timeout=timeout, allow_pickle=allow_pickle,
            pickle_key=pickle_key, retry=retry, progress=progress, **redis_kwargs,
        )
        device = torch.device(device) if device is not None else None
        self._init_handle(conn, (), device, cache_metadata, backend)
        # expire=: the lifetime given to the store when this call creates it (seconds)
        self._create_ttl_ms = ttl_ms(expire, self._where())
        # chunk_bytes=: the chunking given to the store when this call creates it
        conn.chunk_bytes = _chunks.check_chunk_bytes(
            chunk_bytes if chunk_bytes is not None else _chunks.env_chunk_bytes(), self._where()
        )
        if not _create:
            return
        bs = torch.Size(batch_size) if batch_size is not None else torch.Size([])
        try:
            self._create_store(bs, device, names, [], tensorclass=None)
        except StoreExistsError:
            if td_id is None:
                raise
            # reconnecting: never reset what another process stored
            layout = self._layout(refresh=True)
            stored = torch.Size(json.loads(layout.meta.get("batch_size", "[]")))
            if batch_size is not None and stored != bs:
                raise SchemaError(
                    f"td_id {td_id!r} already holds a store with batch_size={list(stored)}, "
                    f"not {list(bs)}; use TensorDictStore.from_store(td_id=...) to reconnect"
                ) from None
            stored_cb = int(layout.meta["cb"]) if layout.meta.get("cb") else None
            if chunk_bytes is not None and stored_cb != chunk_bytes:
                raise SchemaError(
                    f"td_id {td_id!r} already holds a store with chunk_bytes={stored_cb}, not {chunk_bytes}; "
                    "the chunking is set when a store is created (from_store reads it from the server)"
                ) from None

    def _init_handle(
        self,
        conn: Connection,
        path: tuple[str, ...],
        device: torch.device | None,
        cache_metadata: bool,
        backend: str,
    ) -> None:
        self._conn = conn
        self._path = path
        self._device_override = device
        self._cache_metadata = bool(cache_metadata)
        self._backend_label = backend
        self._is_shared = False
        self._is_memmap = False
        self._cleared_meta: dict[str, str] | None = None

    @classmethod
    def _handle(
        cls,
        conn: Connection,
        path: tuple[str, ...] = (),
        device: torch.device | None = None,
        cache_metadata: bool = True,
        backend: str = "redis",
    ) -> TensorDictStore:
        self = cls.__new__(cls)
        self._init_handle(conn, path, device, cache_metadata, backend)
        return self

    def _sub(self, path: tuple[str, ...]) -> TensorDictStore:
        return type(self)._handle(
            self._conn, path, self._device_override, self._cache_metadata, self._backend_label
        )

    # ------------------------------------------------------------------ identity
    @property
    def _td_id(self) -> str:
        return self._conn.keys.td_id

    def __repr__(self) -> str:
        if self._conn.closed:
            return f"TensorDictStore(td_id={self.td_id!r}, prefix={self.prefix!r}, closed)"
        try:
            layout = self._layout()
        except Exception as err:  # noqa: BLE001 - repr must not raise
            return f"TensorDictStore(td_id={self.td_id!r}, prefix={self.prefix!r}, <{type(err).__name__}>)"
        fields = []
        for path, meta in self._children(layout, self._path):
            key = path[-1]
            if meta["k"] == "t":
                fields.append(f"{key}: {meta['dtype']}{meta['shape']}")
            elif meta["k"] == "td":
                fields.append(f"{key}: TensorDictStore{meta['batch_size']}")
            else:
                fields.append(f"{key}: NonTensor")
        return (
            f"TensorDictStore(td_id={self.td_id!r}, prefix={self.prefix!r}, "
            f"batch_size={list(self.batch_size)}, device={self.device}, "
            f"backend={self._backend_label!r}, fields={{{', '.join(fields)}}})"
        )

    # ------------------------------------------------------------------ layout
    def _check_layout(self, layout: _backend.Layout) -> None:
        self._check_store_meta(layout, self._where())
        if layout.meta.get("kind"):
            from tdstore.errors import UnsupportedOperationError

            kind = layout.meta["kind"]
            hint = "connect with tdstore.LazyStackedTensorDictStore.from_store(td_id=...)" if kind == "lazy" else "use the class that wrote it"
            raise UnsupportedOperationError(
                f"store {self._where()} is not a TensorDictStore (kind {kind!r}"
                f"{', a LazyStackedTensorDictStore' if kind == 'lazy' else ''}); {hint}"
            )
        cb = layout.meta.get("cb")
        if cb and not (cb.isdigit() and int(cb) >= _chunks.MIN_CHUNK_BYTES):
            raise CorruptMetadataError(f"store {self._where()} has a malformed chunk size {cb!r}")
        where = self._where()
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

    def _not_found(self) -> StoreNotFoundError:
        return StoreNotFoundError(
            f"no TensorDictStore with td_id={self.td_id!r} under prefix {self.prefix!r} on "
            f"{self._conn.describe()} (deleted with clear_redis(), expired, or a wrong "
            "td_id/prefix/db?)"
        )

    @staticmethod
    def _children(layout: _backend.Layout, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
        memo = layout.memo.get(("children", path))
        if memo is not None:
            return memo
        n = len(path)
        items = [(p, m) for p, m in layout.entries.items() if len(p) == n + 1 and p[:n] == path]
        items.sort(key=lambda item: _values.order_key(item[1]))
        layout.memo[("children", path)] = items
        return items

    @staticmethod
    def _descendants(layout: _backend.Layout, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
        memo = layout.memo.get(("descendants", path))
        if memo is not None:
            return memo
        n = len(path)
        items = [(p, m) for p, m in layout.entries.items() if len(p) > n and p[:n] == path]
        items.sort(key=lambda item: (len(item[0]), _values.order_key(item[1])))
        layout.memo[("descendants", path)] = items
        return items

    def _node(self, layout: _backend.Layout | None = None) -> dict[str, Any]:
        layout = layout if layout is not None else self._layout()
        if not self._path:
            root = layout.memo.get("root")
            if root is None:
                meta = layout.meta
                root = layout.memo["root"] = {
                    "batch_size": json.loads(meta.get("batch_size", "[]")),
                    "names": json.loads(meta.get("names") or "null"),
                }
            return root
        node = layout.entries.get(self._path)
        if node is None or node.get("k") != "td":
            # the sub-store was deleted or replaced by another client: refresh once
            layout = self._layout(refresh=True)
            node = layout.entries.get(self._path)
            if node is None or node.get("k") != "td":
                raise EntryNotFoundError(f"nested key {self._path!r} no longer exists in {self._where()}")
        return node

    def _owner_batch_size(self, layout: _backend.Layout, path: tuple[str, ...]) -> torch.Size:
        if len(path) <= 1:
            return torch.Size(self._node(layout)["batch_size"]) if not self._path else torch.Size(
                json.loads(layout.meta.get("batch_size", "[]"))
            )
        node = layout.entries.get(path[:-1])
        return torch.Size(node["batch_size"]) if node else torch.Size([])

    # ------------------------------------------------------------------ properties
    @property
    def batch_size(self) -> torch.Size:
        return torch.Size(self._node()["batch_size"])

    @batch_size.setter
    def batch_size(self, new_size: Sequence[int] | torch.Size) -> None:
        self._change_batch_size(torch.Size(new_size))

    def _change_batch_size(self, new_size: torch.Size) -> None:
        new_size = torch.Size(new_size)

        def plan(layout: _backend.Layout) -> tuple[list[_backend.Op], dict[str, str] | None]:
            n = len(new_size)
            for path, meta in self._descendants(layout, self._path):
                shape = meta.get("shape") if meta["k"] == "t" else meta.get("batch_size") if meta["k"] == "td" else None
                if shape is not None and torch.Size(shape[:n]) != new_size:
                    raise RuntimeError(
                        f"the batch size {list(new_size)} does not fit entry {path!r} of shape "
                        f"{shape} in {self._where()}"
                    )
            names = self._node(layout).get("names")
            if names is not None and len(names) != n:
                names = None
            if not self._path:
                return [], {"batch_size": json.dumps(list(new_size)), "names": json.dumps(names)}
            meta = dict(layout.entries[self._path], batch_size=list(new_size), names=names)
            return [_backend.Op("node", self._path, meta)], None

        self._commit_planned(plan, check_lock=True)

    @property
    def device(self) -> torch.device | None:
        if self._device_override is not None:
            return self._device_override
        layout = self._layout()
        if "device" not in layout.memo:
            dev = layout.meta.get("device") or ""
            layout.memo["device"] = torch.device(dev) if dev else None
        return layout.memo["device"]

    @device.setter
    def device(self, value: Any) -> None:
        raise RuntimeError(
            "the device of a TensorDictStore cannot be set; use store.to(device) for a handle "
            "that reads onto that device"
        )

    @property
    def _td_dim_names(self) -> list[str | None] | None:  # type: ignore[override]
        return self._node().get("names")

    @_td_dim_names.setter
    def _td_dim_names(self, value: Any) -> None:
        self._write_names(None if value is None else list(value))

    def _write_names(self, names: list[str | None] | None) -> None:
        if names is not None and all(n is None for n in names):
            names = None

        def plan(layout: _backend.Layout) -> tuple[list[_backend.Op], dict[str, str] | None]:
            # as TensorDict does: the leading names of every nested tensordict follow
            ops = _nested_names_ops(self._descendants(layout, self._path), names, len(self._node(layout)["batch_size"]))
            if not self._path:
                return ops, {"names": json.dumps(names)}
            meta = dict(layout.entries[self._path], names=names)
            return [_backend.Op("node", self._path, meta), *ops], None

        self._commit_planned(plan, check_lock=False)

    def _set_names(self, names: Sequence[str | None] | None) -> None:
        if names is None:
            self._write_names(None)
            return
        names = list(names)
        if len(names) != self.batch_dims:
            raise ValueError(f"expected {self.batch_dims} names, got {len(names)}")
        named = [n for n in names if n is not None]
        if len(set(named)) != len(named):
            raise ValueError(f"dimension names must be unique, got {names}")
        self._write_names(names)

    def _erase_names(self) -> None:
        self._write_names(None)

    def _has_names(self) -> bool:
        return self._node().get("names") is not None

    def _rename_subtds(self, names: Any) -> None:
        return None

    @property
    def _is_locked(self) -> bool:  # type: ignore[override]
        return self._layout().meta.get("lock") == "1"

    @_is_locked.setter
    def _is_locked(self, value: bool) -> None:
        if getattr(self, "_conn", None) is None or self._conn.closed:
            return
        layout = self._fresh_layout()
        if (layout.meta.get("lock") == "1") == bool(value):
            return
        self._commit_planned(lambda _layout: ([], {"lock": "1" if value else "0"}), check_lock=False, expected_any=True)

    @property
    def is_locked(self) -> bool:
        return self._fresh_layout().meta.get("lock") == "1"

    @is_locked.setter
    def is_locked(self, value: bool) -> None:
        if value:
            self.lock_()
        else:
            self.unlock_()

    def lock_(self) -> TensorDictStore:
        """Locks the store on the server: every process sees it locked until ``unlock_()``."""
        if self._conn.closed:
            raise self._conn.closed_error()
        self._is_locked = True
        return self

    def unlock_(self) -> TensorDictStore:
        """Unlocks the store on the server."""
        if self._conn.closed:
            raise self._conn.closed_error()
        self._is_locked = False
        return self

    def is_contiguous(self) -> bool:
        return False

    def is_shared(self) -> bool:
        return False

    def is_memmap(self) -> bool:
        return False

    def detach_(self) -> TensorDictBase:
        return self

    def entry_class(self, key: Any) -> type:
        path = self._path + _as_path(key)
        meta = self._entry(path)
        if meta is None:
            raise self._key_error(path)
        if meta["k"] == "td":
            return type(self)
        if meta["k"] == "nt":
            return NonTensorStack if meta.get("stack") else NonTensorData
        return torch.Tensor

    # ------------------------------------------------------------------ keys
    def keys(
        self,
        include_nested: bool = False,
        leaves_only: bool = False,
        is_leaf: Callable[[type], bool] | None = None,
        *,
        sort: bool = False,
    ) -> StoreKeysView:
        return StoreKeysView(self, include_nested, leaves_only, is_leaf, sort)

    def _key_list(self, include_nested: bool, leaves_only: bool, is_leaf: Callable[[type], bool] | None) -> list[Any]:
        layout = self._fresh_layout()
        n = len(self._path)
        items = self._descendants(layout, self._path) if include_nested else self._children(layout, self._path)
        out = []
        for path, meta in items:
            if leaves_only and meta["k"] == "td":
                continue
            if is_leaf is not None and meta["k"] == "nt" and leaves_only:
                cls = NonTensorStack if meta.get("stack") else NonTensorData
                if not is_leaf(cls):
                    continue
            rel = path[n:]
            out.append(rel[0] if len(rel) == 1 else rel)
        return out

    # ------------------------------------------------------------------ reads
    def _get_str(self, key: Any, default: Any, **kwargs: Any) -> Any:
        return self._get_path(self._path + _as_path(key), default)

    _get_tuple = _get_str

    def _get_path(self, path: tuple[str, ...], default: Any) -> Any:
        meta = self._entry(path)
        if meta is None:
            if is_no_default(default):
                raise self._key_error(path)
            return default
        if meta["k"] == "td":
            return self._sub(path)
        return self._read_values([path])[0]

    # ------------------------------------------------------------------ index reads
    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, str) or (isinstance(index, tuple) and index and all(isinstance(i, str) for i in index)):
            value = self._get_path(self._path + _as_path(index), NO_DEFAULT)
            if isinstance(value, NonTensorData):
                return value.data
            if isinstance(value, NonTensorStack):
                return value.tolist()
            return value
        if index is Ellipsis or (isinstance(index, tuple) and index == ()):
            return self
        return self._read_index(index)

    __getitems__ = __getitem__

    def _get_at_str(self, key: Any, idx: Any, default: Any, **kwargs: Any) -> Any:
        path = self._path + _as_path(key)
        meta = self._entry(path)
        if meta is None:
            if is_no_default(default):
                raise self._key_error(path)
            return default
        if meta["k"] == "td":
            return self._sub(path)[idx]
        return self._read_index(idx, only=path)

    _get_at_tuple = _get_at_str

    # ------------------------------------------------------------------ writes
    def _set_str(self, key: Any, value: Any, *, inplace: Any, validated: bool, ignore_lock: bool = False, non_blocking: bool = False, **kwargs: Any) -> TensorDictStore:
        self._write({self._path + _as_path(key): value}, inplace=inplace is True, ignore_lock=ignore_lock)
        return self

    _set_tuple = _set_str

    def _commit_planned(
        self,
        plan: Callable[[_backend.Layout], tuple[list[_backend.Op], dict[str, str] | None]],
        *,
        check_lock: bool,
        bump: bool = True,
        expected_any: bool = False,
    ) -> int:
        """Plans ops against the cached layout and commits them; refreshes and replans when stale."""
        conn = self._conn

        def attempt(_attempt: int) -> int:
            (ops, meta_updates), layout = self._replan_if_stale(plan, self._layout())
            lv = conn.run(
                lambda c: _backend.commit(
                    c, conn.keys, conn.runner, ops,
                    expected="" if expected_any else str(layout.lv),
                    bump=bump, check_lock=check_lock, meta_updates=meta_updates,
                ),
                idempotent=expected_any,  # a re-sent del_/rename would replan and fail
            )
            if bump or expected_any:
                conn.layout = None
            return lv

        return optimistic(attempt, where=self._where, what="a write", on_stale=lambda: self._layout(refresh=True))

    def _write(self, items: Mapping[tuple[str, ...], Any], *, inplace: bool, ignore_lock: bool = False) -> None:
        """Writes whole entries (tensors, nested tensordicts, non-tensors) in one atomic step."""
        prepared = {path: self._prepare_value(path, value) for path, value in items.items()}

        def check(layout: _backend.Layout) -> None:
            planner = WritePlanner(self, layout, inplace=inplace)
            for path, value in prepared.items():
                planner.add(path, value)

        self._check_on_cleared(check)
        self._ensure_exists()

        conn = self._conn

        def plan(layout: _backend.Layout) -> WritePlanner:
            planner = WritePlanner(self, layout, inplace=inplace)
            for path, value in prepared.items():
                planner.add(path, value)
            return planner

        def attempt(_attempt: int) -> None:
            planner, layout = self._replan_if_stale(plan, self._layout())
            ops, bump = planner.ops, planner.bump
            if not ops:
                return
            check_lock = not inplace and not ignore_lock
            if not bump and all(
                op.op == "put" and op.meta is not None and op.meta.get("k") == "t"
                and layout.entries.get(op.path) == op.meta
                for op in ops
            ):
                # new values of existing tensors, same shapes and dtypes: written in place
                # (SETRANGE at 0 in a WATCH-guarded MULTI), with no tmp key and no rename
                groups = [(op.path, [(0, len(op.payload))], op.payload) for op in ops]
                conn.run(
                    lambda c: _backend.write_runs_watched(
                        c, conn.keys, conn.runner, groups, expected=str(layout.lv), check_lock=check_lock,
                        small_via_script=False,
                    )
                )
                return
            conn.run(
                lambda c: _transfer.commit(
                    c, conn.keys, conn.runner, ops, expected=str(layout.lv), bump=bump,
                    check_lock=check_lock, progress=_transfer.upload_bar(self, ops),
                )
            )
            if bump:
                conn.layout = None

        optimistic(attempt, where=self._where, what="a write", on_stale=lambda: self._layout(refresh=True))

    def _creation_meta(self) -> dict[str, str]:
        """Meta fields a new store gets from this handle's creation settings (its chunking)."""
        cb = getattr(self._conn, "chunk_bytes", None)
        return {"cb": str(cb)} if cb else {}

    @property
    def chunk_bytes(self) -> int | None:
        """The chunk size of the store's entries (see ``chunk_bytes=``), or None for one string per entry.

        Read from the server: a store reconnected with ``from_store`` has the chunking it was created with.
        """
        cb = self._layout().meta.get("cb")
        return int(cb) if cb else None

    def _ensure_exists(self) -> None:
        """After clear_redis() on this handle, the next write recreates the store."""
        meta = self._cleared_meta
        if meta is None or self._path:
            return
        self._cleared_meta = None
        bs = torch.Size(json.loads(meta.get("batch_size", "[]")))
        dev = meta.get("device") or None
        if meta.get("ttl"):
            # the recreated store lives as long as the cleared one was set to, from now
            self._create_ttl_ms = int(meta["ttl"])
        self._conn.chunk_bytes = int(meta["cb"]) if meta.get("cb") else None
        try:
            self._create_store(bs, torch.device(dev) if dev else None, json.loads(meta.get("names") or "null"), [], None)
        except StoreExistsError:
            pass

    def _prepare_value(self, path: tuple[str, ...], value: Any, batch_size: torch.Size | None = None) -> Any:
        """Validates and converts a value before anything is sent."""
        if batch_size is None and not isinstance(value, (torch.Tensor, TensorDictBase)):
            batch_size = self.batch_size
        if is_tensorclass(value) and not isinstance(value, (NonTensorData, NonTensorStack)):
            value = value._tensordict
        if isinstance(value, TensorDictStore):
            value = value.to_tensordict()
        if isinstance(value, (torch.Tensor, TensorDictBase)):
            if isinstance(value, torch.Tensor):
                check_tensor(value, path, self._where())
            return value
        if isinstance(value, dict):
            return TensorDict.from_dict(value, batch_size=batch_size, device=None)
        if value is None or isinstance(value, (str, bytes)) or not tensor_like(value):
            return NonTensorData(data=value, batch_size=batch_size)
        if isinstance(value, list) and any(not isinstance(v, numbers.Number) for v in flatten_values(value)):
            return NonTensorData(data=value, batch_size=batch_size)
        try:
            return torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            return NonTensorData(data=value, batch_size=batch_size)

    def _create_store(
        self,
        batch_size: torch.Size,
        device: torch.device | None,
        names: Sequence[str | None] | None,
        ops: list[_backend.Op],
        tensorclass: str | None,
    ) -> None:
        names_list = list(names) if names is not None else None
        if names_list is not None and len(names_list) != len(batch_size):
            raise SchemaError(f"names {names_list} do not match the batch size {list(batch_size)}")
        if names_list is not None and all(n is None for n in names_list):
            names_list = None
        meta = {
            "batch_size": json.dumps(list(batch_size)),
            "device": str(device) if device is not None else "",
            "names": json.dumps(names_list),
            "tensorclass": tensorclass or "",
            **self._creation_meta(),
        }
        conn = self._conn
        conn.run(
            lambda c: _transfer.commit(
                c, conn.keys, conn.runner, ops, expected="new", bump=True, check_lock=False, meta_updates=meta,
                ttl_ms=getattr(self, "_create_ttl_ms", None), progress=_transfer.upload_bar(self, ops),
            ),
            idempotent=False,  # a re-sent create would find its own store and call it taken
        )
        conn.layout = None

    def _set_at_str(self, key: Any, value: Any, idx: Any, *, validated: bool = False, non_blocking: bool = False, **kwargs: Any) -> TensorDictStore:
        path = self._path + _as_path(key)
        meta = self._entry(path)
        if meta is None:  # set_at_ is in place: it never creates an entry
            raise self._key_error(path)
        if meta["k"] == "nt" and not isinstance(value, (NonTensorData, NonTensorStack)):
            # a plain value, as TensorDict takes it (and refuses for an index that selects nothing)
            owner_bs = self._owner_batch_size(self._layout(), path)
            if len(owner_bs) and select_rows(normalize_index(idx), owner_bs).numel() == 0:
                raise RuntimeError(
                    f"cannot write a value into non-tensor entry {key!r} of {self._where()} at {idx!r}: "
                    "the index selects no element (indexed destination batch size has 0 elements)"
                )
            value = NonTensorData(data=value, batch_size=[])
        from tdstore.store.index_write import write_index

        write_index(self, idx, {path: value}, leaf=True)
        return self

    _set_at_tuple = _set_at_str

    def __setitem__(self, index: Any, value: Any) -> None:
        if isinstance(index, str) or (isinstance(index, tuple) and index and all(isinstance(i, str) for i in index)):
            if value is self:
                raise ValueError("a store cannot hold itself")
            self._write({self._path + _as_path(index): value}, inplace=False)
            return
        self._setitem_index(index, value)

    def _setitem_index(self, index: Any, value: Any) -> None:
        layout = self._layout()
        if isinstance(value, (numbers.Number, torch.Tensor)):
            targets = {p: value for p, m in self._descendants(layout, self._path) if m["k"] == "t"}
            self._write_index(index, targets)
            return
        if is_tensorclass(value):
            value = value._tensordict
        if isinstance(value, TensorDictStore):
            value = value.to_tensordict()
        from_dict = isinstance(value, dict)
        if from_dict:
            value = TensorDict.from_dict(value, batch_size=[])
        if not isinstance(value, TensorDictBase):
            raise TypeError(f"cannot write a {type(value).__name__} at an index of {self._where()}")
        targets = {}
        for key, leaf in value.items(include_nested=True, leaves_only=True, is_leaf=_is_leaf_nontensor_cls):
            rel = _as_path(key)
            targets[self._path + rel] = leaf
        self._write_index(index, targets, check_batch=None if from_dict else _batch_check(value, self._where()))

    def _write_index(self, index: Any, targets: Mapping[tuple[str, ...], Any], check_batch: Any = None) -> None:
        from tdstore.store.index_write import write_index

        write_index(self, index, targets, check_batch)


def _nested_names_ops(
    descendants: Sequence[tuple[tuple[str, ...], dict[str, Any]]], names: list[str | None] | None, n: int
) -> list[_backend.Op]:
    """``node`` ops giving every nested tensordict the leading ``names`` (None: unnamed) of its parent."""
    lead: list[str | None] = list(names) if names is not None else [None] * n
    ops = []
    for path, meta in descendants:
        if meta["k"] != "td":
            continue
        old = meta.get("names") or [None] * len(meta["batch_size"])
        new: list[str | None] | None = lead + list(old[n:])
        if new is not None and all(x is None for x in new):
            new = None
        if new != meta.get("names"):
            ops.append(_backend.Op("node", path, dict(meta, names=new)))
    return ops


def _batch_check(value: TensorDictBase, where: str) -> Callable[[torch.Size], None]:
    """TensorDict's rule for ``td[idx] = value``: the value's batch size is the indexed one, or
    broadcasts to it from the left, or its leaves start with the indexed shape."""
    vb = value.batch_size

    def check(indexed: torch.Size) -> None:
        if vb == indexed or (len(vb) and tuple(vb) == tuple(indexed)[-len(vb) :]):
            return
        leaves = value.values(include_nested=True, leaves_only=True)
        if all(isinstance(x, torch.Tensor) and x.shape[: len(indexed)] == indexed for x in leaves):
            return
        raise RuntimeError(
            f"indexed destination batch size of {where} is {indexed}, which differs from the source "
            f"batch size {vb} (and does not broadcast to it)"
        )

    return check


def _is_leaf_nontensor_cls(cls: type) -> bool:
    return issubclass(cls, (torch.Tensor, NonTensorData, NonTensorStack))
