"""LazyStackedTensorDictStore: a ``LazyStackedTensorDict`` whose elements live on a server.

A lazy stack keeps ``N`` tensordicts ("elements") side by side along ``stack_dim``; their
entries may differ in shape (ragged leaves). The store keeps them under one store id,
with the meta hash, registry, write version and data keys of :class:`~tdstore.TensorDictStore`
(layout in :mod:`tdstore._lazy_plan`), so the same rules hold:

* the upload, every key change and every write is one atomic server step (the ``commit``
  script, or a WATCH-guarded MULTI / the ``write_runs`` script for element writes);
* every layout change bumps the layout version in that step; reads get the version in the
  same transaction as the bytes and writes send the version they planned with, so cached
  metadata is never used stale;
* no client read-modify-write: element writes land in place (SETRANGE of the element's
  bytes); the only values read before a write are non-tensor lists, under WATCH.

Reads return in-memory objects: ``L[j]`` a ``TensorDict``, ``L[a:b]`` and ``L[[...]]`` a
``LazyStackedTensorDict``, ``L.to_tensordict()`` the whole lazy stack.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict, TensorDictBase
from tensordict.utils import is_tensorclass

from tdstore import _backend, _codec, _io
from tdstore import _lazy_plan as plan
from tdstore._keys import as_path as _as_path
from tdstore._keys import new_td_id
from tdstore._unsupported import StoreUnsupported
from tdstore._values import NO_DEFAULT, is_no_default, order_key
from tdstore._views import StoreKeysView
from tdstore.errors import (
    CorruptMetadataError,
    DataLostError,
    EntryNotFoundError,
    FormatVersionError,
    SchemaError,
    StaleLayoutError,
    StoreNotFoundError,
    UnsupportedOperationError,
)

__all__ = ["LazyStackedTensorDictStore"]

_MAX_RETRIES = _io.MAX_RETRIES


class _Stale(Exception):
    """The bytes were read at another layout version than the one planned with."""


class LazyStackedTensorDictStore(StoreUnsupported, TensorDictBase):
    """A lazy stack of tensordicts kept on a Redis-wire server; elements may differ in shape.

    Create one with :meth:`from_lazy_stack` (or ``TensorDictStore.from_tensordict`` of a
    ``LazyStackedTensorDict``), reconnect with :meth:`from_store`. See ``docs/lazy.md``.
    """

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

    def __init__(self, *, td_id: str, **kwargs: Any) -> None:
        """Connects to the lazy store ``td_id`` (same connection arguments as ``TensorDictStore``)."""
        from tdstore.store import TensorDictStore

        device = kwargs.pop("device", None)
        cache_metadata = kwargs.pop("cache_metadata", True)
        handle = TensorDictStore(td_id=td_id, _create=False, **kwargs)
        self._init_handle(handle._conn, (), torch.device(device) if device is not None else None, cache_metadata)
        try:
            self._layout(refresh=True)
        except BaseException:
            self.close()
            raise

    def _init_handle(self, conn: Any, path: tuple[str, ...], device: torch.device | None, cache_metadata: bool) -> None:
        self._conn = conn
        self._path = path
        self._device_override = device
        self._cache_metadata = bool(cache_metadata)
        self._is_shared = False
        self._is_memmap = False

    @classmethod
    def _handle(cls, conn: Any, path: tuple[str, ...], device: torch.device | None, cache_metadata: bool) -> LazyStackedTensorDictStore:
        self = cls.__new__(cls)
        self._init_handle(conn, path, device, cache_metadata)
        return self

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_lazy_stack(cls, td: LazyStackedTensorDict, *, td_id: str | None = None, device: Any = None, **kwargs: Any) -> LazyStackedTensorDictStore:
        """Uploads a ``LazyStackedTensorDict`` to a new store, every element in one atomic step.

        Keyword arguments are those of ``TensorDictStore`` (``host``, ``port``,
        ``unix_socket_path``, ``prefix``, ``client``, ...).
        """
        from tdstore.store import TensorDictStore

        if not isinstance(td, LazyStackedTensorDict):
            raise TypeError(
                f"from_lazy_stack expects a LazyStackedTensorDict, got {type(td).__name__}; "
                "use TensorDictStore.from_tensordict for other tensordicts"
            )
        cache_metadata = kwargs.pop("cache_metadata", True)
        handle = TensorDictStore(td_id=td_id if td_id is not None else new_td_id(), _create=False, **kwargs)
        store_device = torch.device(device) if device is not None else td.device
        self = cls._handle(handle._conn, (), None, cache_metadata)
        try:
            self._create(td, store_device)
        except BaseException:
            self.close()
            raise
        return self

    @classmethod
    def from_tensordict(cls, td: TensorDictBase, **kwargs: Any) -> LazyStackedTensorDictStore:
        """Same as :meth:`from_lazy_stack`; a store is first read into memory."""
        if isinstance(td, LazyStackedTensorDictStore):
            td = td.to_tensordict()
        return cls.from_lazy_stack(td, **kwargs)  # type: ignore[arg-type]

    @classmethod
    def from_store(cls, *, td_id: str, **kwargs: Any) -> LazyStackedTensorDictStore:
        """Connects to an existing lazy store by its ``td_id`` (from any process)."""
        return cls(td_id=td_id, **kwargs)

    @classmethod
    def from_dict(cls, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedOperationError(
            "LazyStackedTensorDictStore.from_dict is not supported: build a LazyStackedTensorDict "
            "(e.g. LazyStackedTensorDict(*tds, stack_dim=0)) and call from_lazy_stack"
        )

    def _create(self, td: LazyStackedTensorDict, device: torch.device | None) -> None:
        conn = self._conn
        conn.run(_noop)  # sets up the connection: proto-max-bulk-len is known
        members = list(td.tensordicts)
        if not members:
            raise SchemaError("cannot store a lazy stack of no elements")
        elem_bs = members[0].batch_size
        ops = plan.plan_members(
            (), members, elem_bs, where=self._where(), order_base=1, max_bulk=conn.max_bulk, policy=conn.pickle_policy
        )
        meta = {
            "batch_size": json.dumps(list(td.batch_size)),
            "device": str(device) if device is not None else "",
            "names": "null",
            "tensorclass": "",
            "kind": plan.KIND,
            "stack_dim": str(td.stack_dim),
        }
        conn.run(
            lambda c: _backend.commit(
                c, conn.keys, conn.runner, ops, expected="new", bump=True, check_lock=False, meta_updates=meta
            )
        )
        conn.layout = None

    # ------------------------------------------------------------------ identity
    @property
    def td_id(self) -> str:
        """The id of this store on the server: pass it to ``from_store`` in another process."""
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
            return f"LazyStackedTensorDictStore(td_id={self.td_id!r}, closed)"
        try:
            layout = self._layout()
        except Exception as err:  # noqa: BLE001 - repr must not raise
            return f"LazyStackedTensorDictStore(td_id={self.td_id!r}, <{type(err).__name__}>)"
        fields = []
        for path, meta in self._children(layout):
            if meta["k"] == "lt":
                fields.append(f"{path[-1]}: {meta['dtype']}{'' if 'shape' in meta else ' ragged'}")
            elif meta["k"] == "td":
                fields.append(f"{path[-1]}: LazyStackedTensorDictStore")
            else:
                fields.append(f"{path[-1]}: NonTensor")
        return (
            f"LazyStackedTensorDictStore(td_id={self.td_id!r}, batch_size={list(self.batch_size)}, "
            f"stack_dim={self.stack_dim}, fields={{{', '.join(fields)}}})"
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
        where = self._where()
        fmt = layout.meta.get("fmt")
        if fmt != _backend.FORMAT_VERSION:
            raise FormatVersionError(f"store {where} was written in format {fmt!r}; this tdstore reads {_backend.FORMAT_VERSION!r}")
        if layout.meta.get("kind") != plan.KIND:
            raise UnsupportedOperationError(
                f"store {where} is a TensorDictStore, not a lazy stack; connect with "
                "TensorDictStore.from_store(td_id=...)"
            )
        try:
            bs = json.loads(layout.meta.get("batch_size", ""))
            s = int(layout.meta.get("stack_dim", ""))
        except ValueError:
            raise CorruptMetadataError(f"lazy store {where} has a malformed batch size or stack dim") from None
        if not isinstance(bs, list) or not all(isinstance(d, int) and d >= 0 for d in bs) or not 0 <= s < len(bs):
            raise CorruptMetadataError(f"lazy store {where} has batch size {bs!r} and stack dim {s!r}")
        n = bs[s]
        for path, meta in layout.entries.items():
            plan.check_lazy_meta(path, meta, n, where)

    def _not_found(self) -> StoreNotFoundError:
        return StoreNotFoundError(
            f"no LazyStackedTensorDictStore with td_id={self.td_id!r} under prefix {self.prefix!r} on "
            f"{self._conn.describe()} (deleted with clear_redis(), or a wrong td_id/prefix/db?)"
        )

    def _children(self, layout: _backend.Layout) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
        return [(p, m) for p, m in self._descendants(layout) if len(p) == len(self._path) + 1]

    def _descendants(self, layout: _backend.Layout, path: tuple[str, ...] | None = None) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
        path = self._path if path is None else path
        key = ("lazy-desc", path)
        memo = layout.memo.get(key)
        if memo is None:
            n = len(path)
            memo = [(p, m) for p, m in layout.entries.items() if len(p) > n and p[:n] == path]
            memo.sort(key=lambda item: order_key(item[1]))
            layout.memo[key] = memo
        return memo

    def _root(self, layout: _backend.Layout) -> tuple[torch.Size, int]:
        """The full batch size of the whole stack and its stack dim."""
        memo = layout.memo.get("lazy-root")
        if memo is None:
            memo = layout.memo["lazy-root"] = (
                torch.Size(json.loads(layout.meta["batch_size"])), int(layout.meta["stack_dim"])
            )
        return memo

    def _elem_bs(self, layout: _backend.Layout, path: tuple[str, ...] | None = None) -> torch.Size:
        """The elements' batch size of the node at ``path`` (default: this handle)."""
        path = self._path if path is None else path
        bs, s = self._root(layout)
        if not path:
            return bs[:s] + bs[s + 1 :]
        node = layout.entries.get(path)
        if node is None or node["k"] != "td":
            raise EntryNotFoundError(f"nested key {path!r} no longer exists in {self._where()}")
        return torch.Size(node["batch_size"])

    def _full_bs(self, elem_bs: torch.Size, layout: _backend.Layout) -> torch.Size:
        bs, s = self._root(layout)
        return elem_bs[:s] + torch.Size([bs[s]]) + elem_bs[s:]

    # ------------------------------------------------------------------ properties
    @property
    def batch_size(self) -> torch.Size:
        layout = self._layout()
        return self._full_bs(self._elem_bs(layout), layout)

    @batch_size.setter
    def batch_size(self, value: Any) -> None:
        raise UnsupportedOperationError(f"the batch size of the lazy store {self._where()} cannot be changed")

    def _change_batch_size(self, new_size: Any) -> None:
        raise UnsupportedOperationError(f"the batch size of the lazy store {self._where()} cannot be changed")

    @property
    def stack_dim(self) -> int:
        """The dim along which the elements are stacked."""
        return self._root(self._layout())[1]

    @property
    def device(self) -> torch.device | None:
        if self._device_override is not None:
            return self._device_override
        dev = self._layout().meta.get("device") or ""
        return torch.device(dev) if dev else None

    @device.setter
    def device(self, value: Any) -> None:
        raise RuntimeError("the device of a LazyStackedTensorDictStore cannot be set")

    def _has_names(self) -> bool:
        return False

    def _erase_names(self) -> None:
        return None

    def _rename_subtds(self, names: Any) -> None:
        return None

    def _set_names(self, names: Any) -> None:
        raise UnsupportedOperationError(f"dimension names are not supported on the lazy store {self._where()}")

    @property
    def names(self) -> list[None]:  # type: ignore[override]
        return [None] * self.batch_dims

    @property
    def _is_locked(self) -> bool:  # type: ignore[override]
        return self._layout().meta.get("lock") == "1"

    @_is_locked.setter
    def _is_locked(self, value: bool) -> None:
        if getattr(self, "_conn", None) is None or self._conn.closed:
            return
        if (self._fresh_layout().meta.get("lock") == "1") == bool(value):
            return
        conn = self._conn
        conn.run(
            lambda c: _backend.commit(
                c, conn.keys, conn.runner, [], expected="", bump=True, check_lock=False,
                meta_updates={"lock": "1" if value else "0"},
            )
        )
        conn.layout = None

    @property
    def is_locked(self) -> bool:
        return self._fresh_layout().meta.get("lock") == "1"

    @is_locked.setter
    def is_locked(self, value: bool) -> None:
        self._is_locked = bool(value)

    def lock_(self) -> LazyStackedTensorDictStore:
        """Locks the store on the server: writes from every process are refused."""
        self._is_locked = True
        return self

    def unlock_(self) -> LazyStackedTensorDictStore:
        self._is_locked = False
        return self

    def is_contiguous(self) -> bool:
        return False

    def is_shared(self) -> bool:
        return False

    def is_memmap(self) -> bool:
        return False

    def detach_(self) -> LazyStackedTensorDictStore:
        return self

    # ------------------------------------------------------------------ keys
    def keys(self, include_nested: bool = False, leaves_only: bool = False, is_leaf: Any = None, *, sort: bool = False) -> StoreKeysView:
        return StoreKeysView(self, include_nested, leaves_only, is_leaf, sort)  # type: ignore[arg-type]

    def _key_list(self, include_nested: bool, leaves_only: bool, is_leaf: Any) -> list[Any]:
        layout = self._fresh_layout()
        n = len(self._path)
        out = []
        for path, meta in self._descendants(layout):
            if not include_nested and len(path) != n + 1:
                continue
            if leaves_only and meta["k"] == "td":
                continue
            if leaves_only and meta["k"] == "lnt" and (is_leaf is None or not is_leaf(NonTensorStack)):
                continue  # as TensorDict: non-tensor values are leaves only for an is_leaf that says so
            rel = path[n:]
            out.append(rel[0] if len(rel) == 1 else rel)
        return out

    def _entry(self, path: tuple[str, ...]) -> dict[str, Any] | None:
        meta = self._layout().entries.get(path)
        if meta is None and self._cache_metadata:
            meta = self._fresh_layout().entries.get(path)
        return meta

    def _key_error(self, path: tuple[str, ...]) -> EntryNotFoundError:
        rel = path[len(self._path) :]
        shown = rel[0] if len(rel) == 1 else rel
        return EntryNotFoundError(
            f'key "{shown}" not found in LazyStackedTensorDictStore({self._where()}) with keys '
            f"{sorted(map(str, self._key_list(False, False, None)))}"
        )

    def entry_class(self, key: Any) -> type:
        path = self._path + _as_path(key)
        meta = self._entry(path)
        if meta is None:
            raise self._key_error(path)
        return {"td": LazyStackedTensorDictStore, "lnt": NonTensorStack}.get(meta["k"], torch.Tensor)

    # ------------------------------------------------------------------ reads
    def _read_members(
        self, layout: _backend.Layout, paths: list[tuple[str, ...]], members: list[int]
    ) -> dict[tuple[str, ...], dict[int, Any]]:
        """The values of leaves ``paths`` in elements ``members``, read in one snapshot at ``layout``.

        Raises:
            _Stale: the server's layout version is not ``layout.lv``.
        """
        bs, s = self._root(layout)
        n = bs[s]
        conn = self._conn
        plans: list[tuple[tuple[str, ...], list[tuple[int, int | None]]]] = []
        gathers: list[tuple[int, str] | None] = []
        spans: list[Any] = []
        for path in paths:
            meta = layout.entries[path]
            if meta["k"] == "lnt":
                plans.append((path, [(0, None)]))
                gathers.append(None)
                spans.append(None)
                continue
            offsets, sizes = self._spans(layout, path)
            if "shape" in meta and sizes[0] and _backend.choose_read_rows(len(members), sizes[0] * len(members)) == "gather":
                plans.append((path, []))
                gathers.append((sizes[0], " ".join(map(str, members))))
                spans.append("gather")
                continue
            runs: list[tuple[int, int | None]] = []
            for j in members:
                if not sizes[j]:
                    continue
                last = runs[-1] if runs else None
                if last is not None and last[0] + last[1] == offsets[j]:  # type: ignore[operator]
                    runs[-1] = (last[0], last[1] + sizes[j])  # type: ignore[operator]
                else:
                    runs.append((offsets[j], sizes[j]))
            plans.append((path, runs))
            gathers.append(None)
            spans.append(runs)
        lv, replies = conn.run(lambda c: _backend.read_runs(c, conn.keys, conn.runner, plans, gathers))
        if lv is None:
            raise self._not_found()
        if lv != layout.lv:
            raise _Stale()
        device = self.device
        out: dict[tuple[str, ...], dict[int, Any]] = {}
        for (path, _), how, chunks in zip(plans, spans, replies, strict=True):
            meta = layout.entries[path]
            owner = self._elem_bs(layout, path[:-1])
            if how is None:
                if chunks[0] is None or not chunks[0]:
                    raise DataLostError(f"entry {path!r} of {self._where()} is registered but its bytes are gone from the server")
                values = plan.decode_nontensor(meta, chunks[0], n, owner, path, self._where(), conn.pickle_policy, device)
                out[path] = {j: values[j] for j in members}
                continue
            dtype = _codec.dtype_from_name(meta["dtype"])
            shapes = plan.elem_shapes(meta, n)
            offsets, sizes = self._spans(layout, path)
            found: dict[int, Any] = {}
            if how == "gather":
                buf = self._buffer(chunks[0], sizes[0] * len(members), path)
                for k, j in enumerate(members):
                    found[j] = _as_tensor(buf[k * sizes[0] : (k + 1) * sizes[0]], dtype, shapes[j])
            else:
                runs_iter = iter(zip(how, chunks, strict=True))
                run, data = (None, None)
                buf = None
                for j in members:
                    if not sizes[j]:
                        found[j] = torch.empty(shapes[j], dtype=dtype)
                        continue
                    if run is None or not run[0] <= offsets[j] < run[0] + run[1]:
                        run, data = next(runs_iter)
                        buf = self._buffer(data, run[1], path)
                    rel = offsets[j] - run[0]
                    found[j] = _as_tensor(buf[rel : rel + sizes[j]], dtype, shapes[j])  # type: ignore[index]
            if device is not None and device.type != "cpu":
                found = {j: t.to(device) for j, t in found.items()}
            out[path] = found
        return out

    def _buffer(self, data: Any, expected: int, path: tuple[str, ...]) -> torch.Tensor:
        if data is None or len(data) != expected:
            raise DataLostError(
                f"entry {path!r} of {self._where()}: expected {expected} bytes, the server holds "
                f"{0 if data is None else len(data)} (evicted or changed by hand?)"
            )
        if not self._conn.owned_replies or isinstance(data, memoryview) or len(data) <= 1:
            data = bytearray(data)
        return torch.frombuffer(data, dtype=torch.uint8)

    def _spans(self, layout: _backend.Layout, path: tuple[str, ...]) -> tuple[list[int], list[int]]:
        key = ("lazy-spans", path)
        memo = layout.memo.get(key)
        if memo is None:
            bs, s = self._root(layout)
            memo = layout.memo[key] = plan.elem_spans(layout.entries[path], bs[s])
        return memo

    def _memory_stack(self, paths: list[tuple[str, ...]] | None, members: list[int] | None) -> tuple[list[TensorDict], int]:
        """The elements ``members`` (default all) in memory, with leaves ``paths`` (default all)."""
        for attempt in range(_MAX_RETRIES):
            layout = self._layout()
            bs, s = self._root(layout)
            if members is None:
                members = list(range(bs[s]))
            entries = self._descendants(layout)
            leaves = [p for p, m in entries if m["k"] != "td"] if paths is None else paths
            try:
                values = self._read_members(layout, leaves, members)
            except _Stale:
                _io.backoff(attempt)
                self._layout(refresh=True)
                continue
            if paths is not None:
                wanted = set(paths)
                entries = [(p, m) for p, m in entries if p in wanted or (m["k"] == "td" and any(q[: len(p)] == p for q in wanted))]
            tds = plan.decode_members(entries, values, members, self._elem_bs(layout), self._path, self.device)
            return tds, s
        raise StaleLayoutError(f"the layout of {self._where()} kept changing during a read")

    def to_tensordict(self, *, retain_none: bool | None = None) -> LazyStackedTensorDict:
        """Reads the whole stack into memory (one consistent snapshot), ragged leaves included."""
        tds, s = self._memory_stack(None, None)
        return LazyStackedTensorDict(*tds, stack_dim=s)

    def to_local(self) -> LazyStackedTensorDict:
        return self.to_tensordict()

    def contiguous(self) -> TensorDictBase:
        return self.to_tensordict().contiguous()

    @property
    def tensordicts(self) -> list[TensorDict]:
        """The elements, read into memory (one snapshot)."""
        return self._memory_stack(None, None)[0]

    def __len__(self) -> int:
        bs = self.batch_size
        return bs[0] if bs else 0

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, str) or (isinstance(index, tuple) and index and all(isinstance(i, str) for i in index)):
            path = self._path + _as_path(index)
            meta = self._entry(path)
            if meta is None:
                raise self._key_error(path)
            if meta["k"] == "lnt":
                tds, s = self._memory_stack([path], None)
                return LazyStackedTensorDict(*tds, stack_dim=s)[path[len(self._path) :]]
            return self._get_path(path, NO_DEFAULT)
        if index is Ellipsis or (isinstance(index, tuple) and index == ()):
            return self
        return self._read_index(index)

    def _read_index(self, index: Any) -> Any:
        layout = self._layout()
        bs, s = self._root(layout)
        full = self._full_bs(self._elem_bs(layout), layout)
        members, remapped, pick = plan.split_index(index, len(full), s, bs[s])
        tds, _ = self._memory_stack(None, members)
        if isinstance(pick, int):
            return tds[0]
        if pick is not None:
            by_id = dict(zip(members, tds, strict=True))
            return LazyStackedTensorDict(*[by_id[j] for j in pick], stack_dim=s)
        return LazyStackedTensorDict(*tds, stack_dim=s)[remapped]

    def get(self, key: Any, *args: Any, **kwargs: Any) -> Any:
        """``get(key)``; ``as_list``, ``as_padded_tensor`` and ``as_nested_tensor`` read ragged leaves."""
        default = args[0] if args else kwargs.pop("default", None)
        path = self._path + _as_path(key)
        if not kwargs:
            return self._get_path(path, default)
        meta = self._entry(path)
        if meta is None:
            return default
        tds, s = self._memory_stack([p for p, m in self._descendants(self._layout(), path) if m["k"] != "td"] or [path], None)
        return LazyStackedTensorDict(*tds, stack_dim=s).get(path[len(self._path) :], **kwargs)

    def _get_str(self, key: Any, default: Any, **kwargs: Any) -> Any:
        return self._get_path(self._path + _as_path(key), default)

    _get_tuple = _get_str

    def _get_path(self, path: tuple[str, ...], default: Any, fresh: bool = False) -> Any:
        meta = self._entry(path)
        if not fresh and (meta is None or meta["k"] == "td" or (meta["k"] == "lt" and "shape" not in meta)):
            # no bytes are read on these paths to carry the layout version: check it first
            self._fresh_layout()
            return self._get_path(path, default, fresh=True)
        if meta is None:
            if is_no_default(default):
                raise self._key_error(path)
            return default
        if meta["k"] == "td":
            return type(self)._handle(self._conn, path, self._device_override, self._cache_metadata)
        if meta["k"] == "lnt":
            tds, s = self._memory_stack([path], None)
            return LazyStackedTensorDict(*tds, stack_dim=s).get(path[len(self._path) :])
        if "shape" not in meta:
            raise UnsupportedOperationError(
                f"entry {path!r} of {self._where()} is ragged (its elements differ in shape: "
                f"{_shape_summary(meta)}), so it is not one tensor. Read it with "
                f"store.get({path[len(self._path):]!r}, as_list=True) (or as_nested_tensor=True / "
                "as_padded_tensor=True), element by element with store[j], or as a whole with "
                "store.to_tensordict()"
            )
        for attempt in range(_MAX_RETRIES):
            layout = self._layout()
            meta = layout.entries.get(path)
            if meta is None or meta["k"] != "lt" or "shape" not in meta:
                return self._get_path(path, default)
            bs, s = self._root(layout)
            conn = self._conn
            lv, replies = conn.run(lambda c, conn=conn: _backend.read_runs(c, conn.keys, conn.runner, [(path, [(0, None)])]))
            if lv != layout.lv:
                if lv is None:
                    raise self._not_found()
                _io.backoff(attempt)
                self._layout(refresh=True)
                continue
            dtype = _codec.dtype_from_name(meta["dtype"])
            nbytes = _codec.tensor_nbytes(tuple(meta["shape"]), dtype) * bs[s]
            raw = self._buffer(replies[0][0], nbytes, path) if nbytes else torch.empty(0, dtype=torch.uint8)
            tensor = _as_tensor(raw, dtype, [bs[s], *meta["shape"]]).movedim(0, s)
            if s:
                tensor = tensor.contiguous()
            device = self.device
            return tensor.to(device) if device is not None and device.type != "cpu" else tensor
        raise StaleLayoutError(f"the layout of {self._where()} kept changing during a read")

    def _get_at_str(self, key: Any, idx: Any, default: Any = NO_DEFAULT, **kwargs: Any) -> Any:
        return self._read_index(idx)[key]

    _get_at_tuple = _get_at_str

    # ------------------------------------------------------------------ key writes
    def __setitem__(self, index: Any, value: Any) -> None:
        if isinstance(index, str) or (isinstance(index, tuple) and index and all(isinstance(i, str) for i in index)):
            if value is self:
                raise ValueError("a store cannot hold itself")
            self._set_key(self._path + _as_path(index), value)
            return
        self._write_index(index, value)

    def _set_str(self, key: Any, value: Any, *, inplace: Any = False, validated: bool = False, ignore_lock: bool = False, non_blocking: bool = False, **kwargs: Any) -> LazyStackedTensorDictStore:
        self._set_key(self._path + _as_path(key), value)
        return self

    _set_tuple = _set_str

    def _set_at_str(self, key: Any, value: Any, idx: Any, *, validated: bool = False, non_blocking: bool = False, **kwargs: Any) -> LazyStackedTensorDictStore:
        rel = _as_path(key)
        if not isinstance(value, (torch.Tensor, numbers.Number)):
            raise TypeError(f"set_at_ writes a tensor at an index of {rel!r} in {self._where()}, got {type(value).__name__}")
        self._write_index(idx, _OneLeaf(rel, value))
        return self

    _set_at_tuple = _set_at_str

    def update(self, input_dict_or_td: Any = None, clone: bool = False, inplace: bool = False, **kwargs: Any) -> LazyStackedTensorDictStore:
        """Sets every key of a dict or tensordict of the stack's batch size, in one atomic step."""
        source = kwargs if input_dict_or_td is None else input_dict_or_td
        items = list(source.items())
        self._set_keys([(self._path + _as_path(k), v) for k, v in items])
        return self

    def _set_key(self, path: tuple[str, ...], value: Any) -> None:
        self._set_keys([(path, value)])

    def _set_keys(self, items: list[tuple[tuple[str, ...], Any]]) -> None:
        conn = self._conn
        for attempt in range(_MAX_RETRIES):
            layout = self._layout()
            ops: list[_backend.Op] = []
            try:
                for k, (path, value) in enumerate(items):
                    ops.extend(self._key_ops(layout, path, value, k))
            except (SchemaError, KeyError):
                if self._fresh_layout().lv != layout.lv:
                    continue
                raise
            try:
                conn.run(
                    lambda c, ops=ops, lv=str(layout.lv): _backend.commit(
                        c, conn.keys, conn.runner, ops, expected=lv, bump=True, check_lock=True
                    )
                )
            except StaleLayoutError:
                _io.backoff(attempt)
                self._layout(refresh=True)
                continue
            conn.layout = None
            return
        raise StaleLayoutError(f"the layout of {self._where()} kept changing; gave up after {_MAX_RETRIES} tries")

    def _key_ops(self, layout: _backend.Layout, path: tuple[str, ...], value: Any, k: int) -> list[_backend.Op]:
        if isinstance(value, LazyStackedTensorDictStore):
            value = value.to_tensordict()
        if is_tensorclass(value) and not isinstance(value, (NonTensorData, NonTensorStack)):
            value = value._tensordict
        ops: list[_backend.Op] = []
        parent = path[:-1]
        for i in range(len(self._path) + 1, len(parent) + 1):
            node = layout.entries.get(parent[:i])
            if node is None:
                meta = {"k": "td", "batch_size": list(self._elem_bs(layout, parent[: i - 1])), "names": None, "o": [layout.lv + 1, 10**6 * k + i]}
                ops.append(_backend.Op("node", parent[:i], meta))
            elif node["k"] != "td":
                raise SchemaError(f"cannot set {path!r} in {self._where()}: {parent[:i]!r} is a leaf, not a nested tensordict")
        owner = self._elem_bs(layout, parent) if not ops else torch.Size(ops[-1].meta["batch_size"])  # type: ignore[index]
        full = self._full_bs(owner, layout)
        bs, s = self._root(layout)
        members = plan.members_from_value(value, full, s, path, self._where())
        for p, m in layout.entries.items():
            if p[: len(path)] == path:
                ops.append(_backend.Op("del", p, has_data=m["k"] != "td"))
        self._conn.run(_noop)
        ops.extend(
            plan.plan_members(
                path, members, owner, where=self._where(), order_base=layout.lv + 1 + k,
                max_bulk=self._conn.max_bulk, policy=self._conn.pickle_policy,
            )
        )
        return ops

    def del_(self, key: Any) -> LazyStackedTensorDictStore:
        """Deletes an entry (a nested one with all its content) in one atomic step."""
        path = self._path + _as_path(key)

        def ops(layout: _backend.Layout) -> list[_backend.Op]:
            if path not in layout.entries:
                raise self._key_error(path)
            return [_backend.Op("del", p, has_data=m["k"] != "td") for p, m in layout.entries.items() if p[: len(path)] == path]

        self._commit_ops(ops)
        return self

    def _del(self, key: Any) -> None:
        self.del_(key)

    def __delitem__(self, key: Any) -> None:
        self.del_(key)

    def pop(self, key: Any, default: Any = NO_DEFAULT) -> Any:
        path = self._path + _as_path(key)
        if self._entry(path) is None:
            if is_no_default(default):
                raise self._key_error(path)
            return default
        tds, s = self._memory_stack([p for p, m in self._descendants(self._layout(), path) if m["k"] != "td"] or [path], None)
        value = LazyStackedTensorDict(*tds, stack_dim=s).get(path[len(self._path) :])
        self.del_(key)
        return value

    def rename_key_(self, old_key: Any, new_key: Any, safe: bool = False) -> LazyStackedTensorDictStore:
        """Renames an entry on the server (no bytes move through the client), in one atomic step."""
        old = self._path + _as_path(old_key)
        new = self._path + _as_path(new_key)
        if old == new:
            return self

        def ops(layout: _backend.Layout) -> list[_backend.Op]:
            if old not in layout.entries:
                raise self._key_error(old)
            if new[: len(old)] == old:
                raise ValueError(f"cannot rename {old!r} into its own sub-key {new!r}")
            if new in layout.entries and safe:
                raise KeyError(f"key {new!r} already present in {self._where()}")
            if len(new) > 1 and new[:-1] not in layout.entries:
                raise KeyError(f"cannot rename to {new!r}: {new[:-1]!r} does not exist in {self._where()}")
            if self._elem_bs(layout, old[:-1]) != self._elem_bs(layout, new[:-1]):
                raise SchemaError(f"cannot rename {old!r} to {new!r} in {self._where()}: their parents' batch sizes differ")
            out = [_backend.Op("del", p, has_data=m["k"] != "td") for p, m in layout.entries.items() if p[: len(new)] == new]
            for p, m in sorted(layout.entries.items(), key=lambda item: len(item[0])):
                if p[: len(old)] != old:
                    continue
                target = new + p[len(old) :]
                if m["k"] == "td":
                    out.append(_backend.Op("del", p, has_data=False))
                    out.append(_backend.Op("node", target, m))
                else:
                    out.append(_backend.Op("move", p, m, new_path=target))
            return out

        self._commit_ops(ops)
        return self

    def _commit_ops(self, build: Callable[[_backend.Layout], list[_backend.Op]]) -> None:
        conn = self._conn
        for attempt in range(_MAX_RETRIES):
            layout = self._layout()
            try:
                ops = build(layout)
            except (SchemaError, KeyError, ValueError):
                if self._fresh_layout().lv != layout.lv:
                    continue
                raise
            try:
                conn.run(
                    lambda c, ops=ops, lv=str(layout.lv): _backend.commit(
                        c, conn.keys, conn.runner, ops, expected=lv, bump=True, check_lock=True
                    )
                )
            except StaleLayoutError:
                _io.backoff(attempt)
                self._layout(refresh=True)
                continue
            conn.layout = None
            return
        raise StaleLayoutError(f"the layout of {self._where()} kept changing; gave up after {_MAX_RETRIES} tries")

    # ------------------------------------------------------------------ element writes
    def _write_index(self, index: Any, value: Any) -> None:
        from tdstore._lazy_write import plan_index_write

        conn = self._conn
        for attempt in range(_MAX_RETRIES):
            layout = self._layout()
            try:
                groups, nontensor = plan_index_write(self, layout, index, value)
            except (SchemaError, KeyError, UnsupportedOperationError):
                if self._fresh_layout().lv != layout.lv:
                    continue  # planned against a stale layout: plan again
                raise
            if not groups and not nontensor:
                return
            try:
                changed = conn.run(
                    lambda c, groups=groups, lv=str(layout.lv), nontensor=nontensor: _backend.write_runs_watched(
                        c, conn.keys, conn.runner, groups, expected=lv, check_lock=True, nontensor=nontensor
                    )
                )
            except StaleLayoutError:
                _io.backoff(attempt)
                self._layout(refresh=True)
                continue
            if changed:
                conn.layout = None
            return
        raise StaleLayoutError(f"the layout of {self._where()} kept changing; gave up after {_MAX_RETRIES} tries")

    # ------------------------------------------------------------------ whole-store
    def _clone(self, recurse: bool = True, **kwargs: Any) -> Any:
        if not recurse:
            return type(self)._handle(self._conn, self._path, self._device_override, self._cache_metadata)
        td = self.to_tensordict()
        conn = self._conn.sibling(new_td_id())
        store = type(self)._handle(conn, (), self._device_override, self._cache_metadata)
        store._create(td, self.device)
        return store

    def clone(self, recurse: bool = True, **kwargs: Any) -> Any:
        """A new lazy store (new td_id) holding a copy; ``recurse=False``: a new handle."""
        return self._clone(recurse)

    def copy(self) -> Any:
        return self._clone(False)

    def close(self) -> None:
        """Closes the connection; the data stays on the server. Idempotent."""
        self._conn.close()

    def clear_redis(self) -> None:
        """Deletes every key of this store from the server in one atomic step."""
        conn = self._conn
        for attempt in range(_MAX_RETRIES):
            try:
                layout = self._layout(refresh=True)
            except StoreNotFoundError:
                return
            try:
                conn.run(lambda c, layout=layout: _backend.clear(c, conn.keys, conn.runner, layout))
            except StaleLayoutError:
                _io.backoff(attempt)
                continue
            except StoreNotFoundError:
                return
            conn.layout = None
            return
        raise StaleLayoutError(f"the layout of {self._where()} kept changing during clear_redis()")

    def __enter__(self) -> LazyStackedTensorDictStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __reduce__(self) -> Any:
        state = {
            "conn": self._conn.pickle_state(),
            "path": self._path,
            "device": self._device_override,
            "cache_metadata": self._cache_metadata,
        }
        return (_unpickle, (type(self), state))

    def __eq__(self, other: Any) -> Any:  # type: ignore[override]
        return self.to_tensordict() == other

    def __ne__(self, other: Any) -> Any:  # type: ignore[override]
        return self.to_tensordict() != other

    def empty(self, recurse: bool = False, *, batch_size: Any = None, device: Any = None, names: Any = None) -> TensorDictBase:
        """An empty in-memory ``TensorDict`` of this store's batch size."""
        bs = self.batch_size if batch_size is None or is_no_default(batch_size) else batch_size
        dev = self.device if device is None or is_no_default(device) else device
        return TensorDict(batch_size=bs, device=dev)


for _name in ("select", "exclude", "apply", "named_apply", "to_dict", "numpy", "flatten_keys", "unflatten_keys", "unbind"):
    def _delegate(self: Any, *args: Any, _name: str = _name, **kwargs: Any) -> Any:
        return getattr(self.to_tensordict(), _name)(*args, **kwargs)

    _delegate.__name__ = _name
    _delegate.__doc__ = f"``{_name}`` of the stack read into memory (``to_tensordict().{_name}(...)``)."
    setattr(LazyStackedTensorDictStore, _name, _delegate)

for _name in ("apply_", "zero_", "fill_", "masked_fill_", "copy_", "update_", "update_at_", "_stack_onto_", "where", "masked_select", "set_non_tensor", "batch_size_"):
    def _refuse(self: Any, *args: Any, _name: str = _name, **kwargs: Any) -> Any:
        raise UnsupportedOperationError(
            f"LazyStackedTensorDictStore.{_name}() is not supported ({self._where()}). Write elements with "
            f"store[j] = td, whole keys with store[key] = value, or call store.to_tensordict().{_name}(...) "
            "on an in-memory copy"
        )

    _refuse.__name__ = _name
    setattr(LazyStackedTensorDictStore, _name, _refuse)


class _OneLeaf:
    """The value of ``set_at_(key, value, idx)``: one leaf written at an index."""

    def __init__(self, rel: tuple[str, ...], value: Any) -> None:
        self.rel = rel
        self.value = value


def _as_tensor(raw: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    if math.prod(shape) == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return (raw.view(dtype) if dtype != torch.uint8 else raw).reshape(tuple(shape))


def _shape_summary(meta: dict[str, Any]) -> str:
    shapes = meta["shapes"]
    shown = ", ".join(str(s) for s in shapes[:4])
    return shown + (f", ... ({len(shapes)} elements)" if len(shapes) > 4 else "")


def _unpickle(cls: type, state: dict[str, Any]) -> Any:
    from tdstore._connection import Connection

    self = cls.__new__(cls)
    self._init_handle(Connection.from_pickle_state(state["conn"]), state["path"], state["device"], state["cache_metadata"])
    return self


async def _noop(client: Any) -> None:
    return None
