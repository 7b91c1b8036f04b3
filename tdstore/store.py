"""TensorDictStore: a TensorDict whose entries live on a Redis-wire server.

All TensorDict semantics live here; every server operation is in :mod:`tdstore._backend`.
The consistency rules (see ``docs/guarantees.md``):

* one logical operation is one atomic server step (the ``commit`` and ``write_runs``
  scripts, or one MULTI/EXEC for reads);
* every layout change bumps a store-wide layout version in the same step; reads get the
  version with the bytes, and writes send the version they assume, so cached metadata
  is never used stale: the client refreshes and retries.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase
from tensordict.utils import is_tensorclass

from tdstore import _backend, _codec, _values
from tdstore._connection import Connection
from tdstore._indexing import consumed_dims, normalize_index, row_runs, select_rows
from tdstore._io import DEFAULT_TIMEOUT
from tdstore._keys import new_td_id
from tdstore._ring import RingBufferAPI
from tdstore._store_api import StoreAPI
from tdstore._unsupported import StoreUnsupported
from tdstore.errors import (
    EntryNotFoundError,
    EntryTooLargeError,
    FormatVersionError,
    SchemaError,
    StaleLayoutError,
    StoreExistsError,
    StoreNotFoundError,
    UnsupportedOperationError,
)

__all__ = ["TensorDictStore"]

_MAX_RETRIES = 50
_MAX_CAS_RETRIES = 1000
_NO_DEFAULT = object()


def _as_path(key: Any) -> tuple[str, ...]:
    if isinstance(key, str):
        return (key,)
    if isinstance(key, tuple) and key and all(isinstance(k, str) for k in key):
        return key
    if isinstance(key, tuple) and key:
        out: list[str] = []
        for part in key:
            out.extend(_as_path(part))
        return tuple(out)
    raise TypeError(f"a key must be a str or a non-empty tuple of str, got {key!r}")


class TensorDictStore(StoreAPI, RingBufferAPI, StoreUnsupported, TensorDictBase):
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
    _td_dim_names = None

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
        _create: bool = True,
        **redis_kwargs: Any,
    ) -> None:
        host, port, unix_socket_path = _connection_defaults(host, port, unix_socket_path)
        conn = Connection(
            host=host,
            port=port,
            db=db,
            unix_socket_path=unix_socket_path,
            client=client,
            prefix=prefix,
            td_id=td_id if td_id is not None else new_td_id(),
            timeout=timeout,
            redis_kwargs=redis_kwargs,
        )
        device = torch.device(device) if device is not None else None
        self._init_handle(conn, (), device, cache_metadata, backend)
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
    def td_id(self) -> str:
        """The id of this store on the server: pass it to ``from_store`` in another process."""
        return self._conn.keys.td_id

    @property
    def _td_id(self) -> str:
        return self._conn.keys.td_id

    @property
    def prefix(self) -> str:
        return self._conn.keys.prefix

    def _where(self) -> str:
        where = f"td_id={self.td_id!r}, prefix={self.prefix!r} on {self._conn.describe()}"
        if self._path:
            where += f", nested key {self._path!r}"
        return where

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
    def _layout(self, refresh: bool = False) -> _backend.Layout:
        conn = self._conn
        if refresh or conn.layout is None or not self._cache_metadata:
            layout = conn.run(lambda c: _backend.fetch_layout(c, conn.keys))
            if layout is None:
                conn.layout = None
                raise self._not_found()
            self._check_layout(layout)
            conn.layout = layout
        return conn.layout

    def _fresh_layout(self) -> _backend.Layout:
        """The layout, checked against the server's version (one small round trip)."""
        conn = self._conn
        if self._cache_metadata and conn.layout is not None:
            lv = conn.run(lambda c: _backend.read_layout_version(c, conn.keys))
            if lv is None:
                conn.layout = None
                raise self._not_found()
            if lv == conn.layout.lv:
                return conn.layout
        return self._layout(refresh=True)

    def _check_layout(self, layout: _backend.Layout) -> None:
        fmt = layout.meta.get("fmt")
        if fmt != _backend.FORMAT_VERSION:
            raise FormatVersionError(
                f"store {self._where()} was written in format {fmt!r}; this tdstore reads "
                f"format {_backend.FORMAT_VERSION!r}"
            )
        for path, meta in layout.entries.items():
            _values.check_meta(path, meta, self._where())

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
            if not self._path:
                return [], {"names": json.dumps(names)}
            meta = dict(layout.entries[self._path], names=names)
            return [_backend.Op("node", self._path, meta)], None

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
        self._is_locked = True
        return self

    def unlock_(self) -> TensorDictStore:
        """Unlocks the store on the server."""
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
    ) -> _StoreKeysView:
        return _StoreKeysView(self, include_nested, leaves_only, is_leaf, sort)

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

    def _entry(self, path: tuple[str, ...]) -> dict[str, Any] | None:
        meta = self._layout().entries.get(path)
        if meta is None and self._cache_metadata:
            # another client may have added it since the cache was filled
            meta = self._fresh_layout().entries.get(path)
        return meta

    def _key_error(self, path: tuple[str, ...]) -> EntryNotFoundError:
        rel = path[len(self._path) :]
        shown = rel[0] if len(rel) == 1 else rel
        return EntryNotFoundError(
            f'key "{shown}" not found in {type(self).__name__}({self._where()}) with keys '
            f"{sorted(map(str, self._key_list(False, False, None)))}"
        )

    # ------------------------------------------------------------------ reads
    def _get_str(self, key: Any, default: Any, **kwargs: Any) -> Any:
        return self._get_path(self._path + _as_path(key), default)

    _get_tuple = _get_str

    def _get_path(self, path: tuple[str, ...], default: Any) -> Any:
        meta = self._entry(path)
        if meta is None:
            if default is _NO_DEFAULT or _is_no_default(default):
                raise self._key_error(path)
            return default
        if meta["k"] == "td":
            return self._sub(path)
        return self._read_values([path])[0]

    def _read_values(self, paths: list[tuple[str, ...]]) -> list[Any]:
        conn = self._conn
        for _ in range(_MAX_RETRIES):
            lv, metas, blobs, _ = conn.run(lambda c: _backend.read_entries(c, conn.keys, paths))
            if lv is None:
                raise self._not_found()
            layout = self._layout()
            if lv != layout.lv:
                layout = self._layout(refresh=True)
            out = []
            for path, meta, blob in zip(paths, metas, blobs):
                if meta is None:
                    raise self._key_error(path)
                meta = _values.check_meta(path, meta, self._where())
                if meta["k"] == "td":
                    out.append(self._sub(path))
                    continue
                out.append(
                    _values.decode_value(
                        path,
                        meta,
                        blob,
                        owner_batch_size=self._owner_batch_size(layout, path),
                        device=self.device,
                        owned=conn.owned_replies,
                        where=self._where(),
                    )
                )
            return out
        raise StaleLayoutError(f"the layout of {self._where()} kept changing during a read")

    def to_tensordict(self, *, retain_none: bool | None = None) -> TensorDict:
        """Reads the whole store (or nested sub-store) into memory, in one consistent snapshot."""
        return self._snapshot()[0]

    def _snapshot(self) -> tuple[TensorDict, _backend.Layout]:
        """The store in memory and the layout it was read at (its meta holds the write version)."""
        conn = self._conn
        for _ in range(_MAX_RETRIES):
            layout = self._layout()
            leaves = [(p, m) for p, m in self._descendants(layout, self._path) if m["k"] != "td"]
            paths = [p for p, _ in leaves]
            lv, _, blobs, snap = conn.run(
                lambda c: _backend.read_entries(c, conn.keys, paths, with_layout=True)
            )
            if snap is None:
                raise self._not_found()
            if snap.lv != layout.lv:
                self._check_layout(snap)
                conn.layout = snap
                continue
            return self._build_tensordict(layout, dict(zip(paths, blobs))), snap
        raise StaleLayoutError(f"the layout of {self._where()} kept changing during to_tensordict()")

    def _build_tensordict(self, layout: _backend.Layout, blobs: Mapping[tuple[str, ...], Any]) -> TensorDict:
        node = self._node(layout)
        device = self.device
        root = TensorDict(batch_size=node["batch_size"], device=device, names=node.get("names"))
        n = len(self._path)
        for path, meta in self._descendants(layout, self._path):
            rel = path[n:]
            if meta["k"] == "td":
                sub = TensorDict(batch_size=meta["batch_size"], device=device, names=meta.get("names"))
                root._set_tuple(rel, sub, inplace=False, validated=True, non_blocking=False)
                continue
            value = _values.decode_value(
                path,
                meta,
                blobs.get(path),
                owner_batch_size=self._owner_batch_size(layout, path),
                device=device,
                owned=self._conn.owned_replies,
                where=self._where(),
            )
            root._set_tuple(rel, value, inplace=False, validated=True, non_blocking=False)
        return root

    def to_local(self) -> TensorDict:
        """Deprecated alias of :meth:`to_tensordict`."""
        import warnings

        warnings.warn(
            "TensorDictStore.to_local() is deprecated; use to_tensordict()",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.to_tensordict()

    def contiguous(self) -> TensorDict:
        return self.to_tensordict()

    def apply_(self, fn: Callable[..., Any], *others: Any, **kwargs: Any) -> Any:
        """Applies ``fn`` to every tensor leaf in place, as one compare-and-set (see _inplace_on_copies)."""

        def apply_(td: TensorDictBase) -> TensorDictBase:
            return td.apply_(fn, *others, **kwargs)

        return self._inplace_on_copies(lambda td: (apply_(td), td)[1])

    def _inplace_on_copies(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs an in-place method (``apply_``, ``+=``, ``mul_`` ...) as a compare-and-set.

        The store is read in one snapshot together with its write version; the method runs
        on that copy, and the changed leaves are written back in one commit that the
        server refuses if any process wrote the store in between. The client then reads
        again and retries, so concurrent read-modify-writes never lose an update.
        """
        import random
        import time

        from tdstore.errors import WriteConflictError

        conn = self._conn
        for attempt in range(_MAX_CAS_RETRIES):
            snapshot, snap = self._snapshot()
            leaves = TensorDict(batch_size=snapshot.batch_size, device=snapshot.device)
            for key, value in snapshot.items(True, True):
                if isinstance(value, torch.Tensor):
                    leaves._set_tuple(_as_path(key), value, inplace=False, validated=True, non_blocking=False)
            result = method(leaves, *args, **kwargs)
            if result is not leaves:
                return result
            ops = []
            keep = []
            for key, value in leaves.items(True, True):
                path = self._path + _as_path(key)
                meta = snap.entries[path]
                value = value.to(_codec.dtype_from_name(meta["dtype"]))
                if list(value.shape) != meta["shape"]:
                    raise RuntimeError(f"{method.__name__} changed the shape of {path!r} in {self._where()}")
                flat, view = _codec.tensor_view(value)
                keep.append(flat)
                ops.append(_backend.Op("put", path, meta, payload=view))
            if not ops:
                return self
            try:
                conn.run(
                    lambda c: _backend.commit(
                        c, conn.keys, conn.runner, ops, expected=str(snap.lv), bump=False,
                        check_lock=False, expected_wv=snap.wv,
                    )
                )
            except (WriteConflictError, StaleLayoutError):
                time.sleep(random.uniform(0, 0.002 * min(attempt + 1, 10)))
                continue
            return self
        raise StaleLayoutError(
            f"{getattr(method, '__name__', 'an in-place method')} on {self._where()} kept conflicting with "
            f"other writers; gave up after {_MAX_CAS_RETRIES} tries"
        )

    # ------------------------------------------------------------------ index reads
    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, str) or (isinstance(index, tuple) and index and all(isinstance(i, str) for i in index)):
            value = self._get_path(self._path + _as_path(index), _NO_DEFAULT)
            if isinstance(value, NonTensorData):
                return value.data
            if isinstance(value, NonTensorStack):
                return value.tolist()
            return value
        if index is Ellipsis or (isinstance(index, tuple) and index == ()):
            return self
        return self._read_index(index)

    __getitems__ = __getitem__

    def _read_index(self, index: Any, only: tuple[str, ...] | None = None) -> Any:
        conn = self._conn
        index = normalize_index(index)
        for _ in range(_MAX_RETRIES):
            layout = self._layout()
            batch_size = torch.Size(self._node(layout)["batch_size"])
            if only is not None and layout.entries[only]["k"] == "t":
                # get_at may index past the batch dims, into the entry's own dims
                shape = layout.entries[only]["shape"]
                batch_size = torch.Size(shape[: max(len(batch_size), consumed_dims(index, len(shape)))])
            nb = len(batch_size)
            rows = select_rows(index, batch_size)
            new_bs = rows.shape
            items = [(only, layout.entries[only])] if only is not None else self._descendants(layout, self._path)
            plans: list[tuple[tuple[str, ...], list[tuple[int, int | None]]]] = []
            gathers: list[tuple[int, str] | None] = []
            rows_arg: str | None = None
            for path, meta in items:
                if meta["k"] == "t":
                    dtype = _codec.dtype_from_name(meta["dtype"])
                    row_bytes = _codec.tensor_nbytes(tuple(meta["shape"][nb:]), dtype)
                    runs = row_runs(rows, row_bytes)
                    plans.append((path, runs))
                    if row_bytes and _backend.choose_read(runs) == "gather":
                        if rows_arg is None:
                            rows_arg = " ".join(map(str, rows.reshape(-1).tolist()))
                        gathers.append((row_bytes, rows_arg))
                    else:
                        gathers.append(None)
                elif meta["k"] == "nt":
                    plans.append((path, [(0, None)]))
                    gathers.append(None)
            lv, parts = conn.run(lambda c: _backend.read_runs(c, conn.keys, conn.runner, plans, gathers))
            if lv is None:
                raise self._not_found()
            if lv != layout.lv:
                self._layout(refresh=True)
                continue
            values: dict[tuple[str, ...], Any] = {}
            for (path, _runs), chunks in zip(plans, parts):
                meta = layout.entries[path]
                if meta["k"] == "t":
                    dtype = _codec.dtype_from_name(meta["dtype"])
                    shape = tuple(new_bs) + tuple(meta["shape"][nb:])
                    owned = conn.owned_replies and len(chunks) == 1
                    data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                    tensor = _codec.tensor_from_reply(data, dtype, shape, owned=owned or len(chunks) > 1)
                    if self.device is not None and self.device.type != "cpu":
                        tensor = tensor.to(self.device)
                    values[path] = tensor
                else:
                    full = _values.decode_value(
                        path, meta, chunks[0], owner_batch_size=self._owner_batch_size(layout, path),
                        device=self.device, owned=False, where=self._where(),
                    )
                    if isinstance(full, NonTensorStack):
                        values[path] = full[index]
                    else:
                        values[path] = NonTensorData(data=full.data, batch_size=new_bs, device=self.device)
            if only is not None:
                return values[only]
            return self._assemble(layout, new_bs, nb, values)
        raise StaleLayoutError(f"the layout of {self._where()} kept changing during an indexed read")

    def _assemble(self, layout: _backend.Layout, new_bs: torch.Size, nb: int, values: dict[tuple[str, ...], Any]) -> TensorDict:
        n = len(self._path)
        out = TensorDict(batch_size=new_bs, device=self.device)
        for path, meta in self._descendants(layout, self._path):
            rel = path[n:]
            if meta["k"] == "td":
                sub_bs = tuple(new_bs) + tuple(meta["batch_size"][nb:])
                out._set_tuple(rel, TensorDict(batch_size=sub_bs, device=self.device), inplace=False, validated=True, non_blocking=False)
            else:
                out._set_tuple(rel, values[path], inplace=False, validated=True, non_blocking=False)
        return out

    def _get_at_str(self, key: Any, idx: Any, default: Any, **kwargs: Any) -> Any:
        path = self._path + _as_path(key)
        meta = self._entry(path)
        if meta is None:
            if _is_no_default(default):
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
        for _ in range(_MAX_RETRIES):
            layout = self._layout()
            ops, meta_updates = plan(layout)
            try:
                lv = conn.run(
                    lambda c: _backend.commit(
                        c, conn.keys, conn.runner, ops,
                        expected="" if expected_any else str(layout.lv),
                        bump=bump, check_lock=check_lock, meta_updates=meta_updates,
                    )
                )
            except StaleLayoutError:
                self._layout(refresh=True)
                continue
            if bump or expected_any:
                conn.layout = None
            return lv
        raise StaleLayoutError(f"the layout of {self._where()} kept changing; gave up after {_MAX_RETRIES} tries")

    def _write(self, items: Mapping[tuple[str, ...], Any], *, inplace: bool, ignore_lock: bool = False) -> None:
        """Writes whole entries (tensors, nested tensordicts, non-tensors) in one atomic step."""
        prepared = {path: self._prepare_value(path, value) for path, value in items.items()}
        self._ensure_exists()

        def plan(layout: _backend.Layout) -> tuple[list[_backend.Op], dict[str, str] | None]:
            planner = _WritePlanner(self, layout, inplace=inplace)
            for path, value in prepared.items():
                planner.add(path, value)
            self._last_plan_bumps = planner.bump
            return planner.ops, None

        conn = self._conn
        for _ in range(_MAX_RETRIES):
            layout = self._layout()
            ops, _ = plan(layout)
            if not ops:
                return
            bump = self._last_plan_bumps
            check_lock = not inplace and not ignore_lock
            try:
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
                lv = conn.run(
                    lambda c: _backend.commit(
                        c, conn.keys, conn.runner, ops, expected=str(layout.lv), bump=bump,
                        check_lock=check_lock,
                    )
                )
            except StaleLayoutError:
                self._layout(refresh=True)
                continue
            if bump:
                conn.layout = None
            else:
                layout.lv = lv
            return
        raise StaleLayoutError(f"the layout of {self._where()} kept changing; gave up after {_MAX_RETRIES} tries")

    def _ensure_exists(self) -> None:
        """After clear_redis() on this handle, the next write recreates the store."""
        meta = self._cleared_meta
        if meta is None or self._path:
            return
        self._cleared_meta = None
        bs = torch.Size(json.loads(meta.get("batch_size", "[]")))
        dev = meta.get("device") or None
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
                _check_tensor(value, path, self._where())
            return value
        if isinstance(value, dict):
            return TensorDict.from_dict(value, batch_size=batch_size, device=None)
        if value is None or isinstance(value, (str, bytes)) or not _tensor_like(value):
            return NonTensorData(data=value, batch_size=batch_size)
        if isinstance(value, list) and any(not isinstance(v, numbers.Number) for v in _flatten(value)):
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
        }
        conn = self._conn
        conn.run(
            lambda c: _backend.commit(
                c, conn.keys, conn.runner, ops, expected="new", bump=True, check_lock=False, meta_updates=meta
            )
        )
        conn.layout = None

    def _set_at_str(self, key: Any, value: Any, idx: Any, *, validated: bool = False, non_blocking: bool = False, **kwargs: Any) -> TensorDictStore:
        self._write_index(idx, {self._path + _as_path(key): value})
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
            self._write_index(index, targets, broadcast=True)
            return
        if is_tensorclass(value):
            value = value._tensordict
        if isinstance(value, TensorDictStore):
            value = value.to_tensordict()
        if isinstance(value, dict):
            value = TensorDict.from_dict(value, batch_size=[])
        if not isinstance(value, TensorDictBase):
            raise TypeError(f"cannot write a {type(value).__name__} at an index of {self._where()}")
        targets = {}
        for key, leaf in value.items(include_nested=True, leaves_only=True, is_leaf=_is_leaf_nontensor_cls):
            rel = _as_path(key)
            targets[self._path + rel] = leaf
        self._write_index(index, targets, value_batch=value.batch_size)

    def _write_index(self, index: Any, targets: Mapping[tuple[str, ...], Any], *, broadcast: bool = False, value_batch: torch.Size | None = None) -> None:
        from tdstore._index_write import write_index

        write_index(self, index, targets, broadcast=broadcast, value_batch=value_batch)


def _is_no_default(default: Any) -> bool:
    return default is _NO_DEFAULT or type(default).__name__ == "_NoDefault" or repr(default) == "NO_DEFAULT"


def _is_leaf_nontensor_cls(cls: type) -> bool:
    return issubclass(cls, (torch.Tensor, NonTensorData, NonTensorStack))


def _tensor_like(value: Any) -> bool:
    if isinstance(value, (numbers.Number, torch.Tensor)):
        return True
    try:
        import numpy as np

        if isinstance(value, (np.ndarray, np.generic)):
            return value.dtype != object
    except ImportError:  # pragma: no cover
        pass
    return isinstance(value, (list, tuple))


def _flatten(value: Any) -> Iterator[Any]:
    for item in value:
        if isinstance(item, (list, tuple)):
            yield from _flatten(item)
        else:
            yield item


def _check_tensor(value: torch.Tensor, path: tuple[str, ...], where: str) -> None:
    if value.is_sparse or value.layout != torch.strided:
        raise TypeError(f"entry {path!r} of {where}: a {value.layout} tensor cannot be stored; call .to_dense() first")
    if getattr(value, "is_nested", False):
        raise TypeError(f"entry {path!r} of {where}: a nested tensor cannot be stored; store its components")
    _codec.dtype_name(value.dtype)


def _connection_defaults(host: str, port: int, unix_socket_path: str | None) -> tuple[str, int, str | None]:
    """Applies TDSTORE_URL when the caller kept the documented defaults.

    ``TDSTORE_URL=redis://127.0.0.1:6400/0`` or ``unix:///path/to.sock`` points every
    store created with default connection arguments at another server, so the same code
    (and the docs' examples) runs against a private test server.
    """
    import os
    from urllib.parse import urlparse

    url = os.environ.get("TDSTORE_URL")
    if not url or host != "localhost" or port != 6379 or unix_socket_path is not None:
        return host, port, unix_socket_path
    parsed = urlparse(url)
    if parsed.scheme == "unix":
        return host, port, parsed.path
    return parsed.hostname or host, parsed.port or port, None


class _WritePlanner:
    """Turns whole-entry writes into commit ops against one layout snapshot."""

    def __init__(self, store: TensorDictStore, layout: _backend.Layout, *, inplace: bool) -> None:
        self.store = store
        self.layout = layout
        self.inplace = inplace
        self.ops: list[_backend.Op] = []
        self.bump = False
        self.entries = dict(layout.entries)
        self._seq = 0
        self.where = store._where()

    def order(self) -> list[int]:
        self._seq += 1
        return [self.layout.lv + 1, self._seq]

    def owner_bs(self, path: tuple[str, ...]) -> torch.Size:
        if len(path) == 1:
            return torch.Size(json.loads(self.layout.meta.get("batch_size", "[]")))
        node = self.entries.get(path[:-1])
        return torch.Size(node["batch_size"])

    def ensure_parents(self, path: tuple[str, ...]) -> None:
        for i in range(1, len(path)):
            parent = path[:i]
            meta = self.entries.get(parent)
            if meta is None:
                if self.inplace:
                    raise EntryNotFoundError(f"key {parent!r} not found in {self.where}")
                node = _values.node_meta(self.owner_bs(parent), None, self.order())
                self.entries[parent] = node
                self.ops.append(_backend.Op("node", parent, node))
                self.bump = True
            elif meta["k"] != "td":
                raise KeyError(f"cannot write {path!r} in {self.where}: {parent!r} is not a nested tensordict")

    def remove(self, path: tuple[str, ...]) -> None:
        for sub in [p for p in self.entries if p[: len(path)] == path]:
            meta = self.entries.pop(sub)
            self.ops.append(_backend.Op("del", sub, has_data=meta["k"] != "td"))
            self.bump = True

    def add(self, path: tuple[str, ...], value: Any) -> None:
        self.ensure_parents(path)
        existing = self.entries.get(path)
        owner_bs = self.owner_bs(path)
        if isinstance(value, torch.Tensor):
            self.add_tensor(path, value, existing, owner_bs)
        elif isinstance(value, (NonTensorData, NonTensorStack)):
            if self.inplace and (existing is None or existing["k"] != "nt"):
                raise EntryNotFoundError(f"non-tensor key {path!r} not found in {self.where} for an in-place write")
            meta, payload = _values.nontensor_parts(value, existing["o"] if existing else self.order())
            self.check_size(path, len(payload))
            if existing is not None and existing != meta:
                self.remove(path)
                self.bump = True
            elif existing is None:
                self.bump = True
            self.entries[path] = meta
            self.ops.append(_backend.Op("put", path, meta, payload=payload))
        elif isinstance(value, TensorDictBase):
            self.add_node(path, value, existing, owner_bs)
        else:
            raise TypeError(f"cannot store a {type(value).__name__} at {path!r} in {self.where}")

    def add_tensor(self, path: tuple[str, ...], value: torch.Tensor, existing: dict[str, Any] | None, owner_bs: torch.Size) -> None:
        if self.inplace:
            if existing is None or existing["k"] != "t":
                raise EntryNotFoundError(f'key "{path[-1]}" not found in {self.where} (in-place writes need an existing entry)')
            shape = torch.Size(existing["shape"])
            if value.shape != shape:
                try:
                    value = value.expand(shape)
                except RuntimeError:
                    raise RuntimeError(
                        f"Failed to update {path!r} in {self.where}: the value of shape {value.shape} "
                        f"does not fit the entry of shape {shape}"
                    ) from None
            value = value.to(_codec.dtype_from_name(existing["dtype"]))
            meta = existing
        else:
            if value.shape[: len(owner_bs)] != owner_bs:
                raise RuntimeError(
                    f"batch dimension mismatch, got self.batch_size={owner_bs} and "
                    f"value.shape={value.shape} for key {path!r} in {self.where}"
                )
            meta = _values.tensor_meta(value, existing["o"] if existing else self.order())
            if existing is not None and existing["k"] != "t":
                self.remove(path)
            if existing is None or existing.get("dtype") != meta["dtype"] or existing.get("shape") != meta["shape"]:
                self.bump = True
        keep, view = _codec.tensor_view(value)
        self.check_size(path, len(view))
        self.entries[path] = meta
        self.ops.append(_backend.Op("put", path, meta, payload=view, extra={"keep": keep}))

    def add_node(self, path: tuple[str, ...], value: TensorDictBase, existing: dict[str, Any] | None, owner_bs: torch.Size) -> None:
        if self.inplace:
            if existing is None or existing["k"] != "td":
                raise EntryNotFoundError(f"nested key {path!r} not found in {self.where} for an in-place write")
            for key, leaf in value.items(include_nested=False):
                self.add(path + (key,), leaf)
            return
        if value.batch_size[: len(owner_bs)] != owner_bs:
            raise RuntimeError(
                f"batch dimension mismatch, got self.batch_size={owner_bs} and "
                f"value.batch_size={value.batch_size} for key {path!r} in {self.where}"
            )
        if existing is not None:
            self.remove(path)
        names = value.names if value._has_names() else None
        node = _values.node_meta(value.batch_size, names, existing["o"] if existing else self.order())
        self.entries[path] = node
        self.ops.append(_backend.Op("node", path, node))
        self.bump = True
        for key, leaf in value.items(include_nested=False):
            if is_tensorclass(leaf) and not isinstance(leaf, (NonTensorData, NonTensorStack)):
                leaf = leaf._tensordict
            self.add(path + (key,), leaf)

    def check_size(self, path: tuple[str, ...], nbytes: int) -> None:
        limit = self.store._conn.max_bulk
        if nbytes > limit:
            raise EntryTooLargeError(
                f"entry {path!r} of {self.where} is {nbytes} bytes, more than the server's "
                f"proto-max-bulk-len of {limit} bytes for one string. Raise the limit on the "
                "server (CONFIG SET proto-max-bulk-len), or split the entry into smaller ones."
            )


class _StoreKeysView:
    """What ``keys()`` returns: a live view over the store's registry."""

    def __init__(self, store: TensorDictStore, include_nested: bool, leaves_only: bool, is_leaf: Any, sort: bool) -> None:
        self.tensordict = store
        self.include_nested = include_nested
        self.leaves_only = leaves_only
        self.is_leaf = is_leaf
        self.sort = sort

    def _keys(self) -> list[Any]:
        keys = self.tensordict._key_list(self.include_nested, self.leaves_only, self.is_leaf)
        if self.sort:
            keys.sort(key=lambda k: ".".join(k) if isinstance(k, tuple) else k)
        return keys

    def __iter__(self) -> Iterator[Any]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def __contains__(self, key: Any) -> bool:
        if isinstance(key, tuple) and len(key) == 1:
            key = key[0]
        if isinstance(key, tuple) and not self.include_nested:
            store = self.tensordict
            path = store._path + _as_path(key)
            meta = store._entry(path)
            return meta is not None and not (self.leaves_only and meta["k"] == "td")
        return key in self._keys()

    def __repr__(self) -> str:
        return f"_StoreKeysView({self._keys()})"

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other)  # type: ignore[call-overload]
