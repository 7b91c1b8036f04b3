"""Whole-entry writes of TensorDictStore (a mixin): ``store[key] = value``, ``store[idx] = td``,
``set``/``set_at_``, the planned commits every key change goes through, and the creation of a store;
the whole-store writes (``update``, ``update_``, ``del_``, ``rename_key_``, ``pop``) and the copies
made on the server (``clone``, ``copy``).

Every write is one atomic server step, planned against the cached layout and sent with the
layout version it assumes (``_commit_planned``, ``_write``): a stale plan is refreshed and
replanned. Index writes are planned in :mod:`tdstore.store.index_write`.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase
from tensordict.utils import is_tensorclass

from tdstore._backend import memory as _memory
from tdstore._backend import ops as _backend
from tdstore._backend import row_writes as _row_writes
from tdstore._backend import transfer as _transfer
from tdstore._backend.optimistic import optimistic
from tdstore._core import values as _values
from tdstore._core.indexing import normalize_index, select_rows
from tdstore._core.keys import as_path as _as_path
from tdstore._core.keys import new_td_id
from tdstore._core.planner import WritePlanner, check_tensor, flatten_values, tensor_like
from tdstore._core.planner import rename_ops as _rename_ops
from tdstore._core.values import is_no_default
from tdstore.base.handle import snapshot_of
from tdstore.base.host import DenseBase
from tdstore.errors import DurabilityError, SchemaError, StoreExistsError
from tdstore.store.index_write import write_index

if TYPE_CHECKING:
    from tensordict import NestedKey
    from tensordict.utils import DeviceType, IndexType
    from typing_extensions import Self

    from tdstore._backend.protocols import AsyncClient
    from tdstore.store.core import TensorDictStore

__all__ = ["StoreWrites", "upload_ops"]

_MISSING = object()


class StoreWrites(DenseBase):
    """Whole-entry writes of :class:`~tdstore.TensorDictStore`."""

    #: the meta hash of a store this handle cleared, to recreate it on the next write
    _cleared_meta: dict[str, str] | None
    #: the lifetime (ms) given to the store when this handle creates it (``expire=``)
    _create_ttl_ms: int | None

    def _set_str(self, key: NestedKey, value: object, *, inplace: object, validated: bool, ignore_lock: bool = False, non_blocking: bool = False, **kwargs: object) -> Self:
        path = self._path + _as_path(key)
        if inplace is not True and inplace is not False and inplace is not None:
            # set(..., inplace=True) arrives as BEST_ATTEMPT_INPLACE: in place into an existing
            # tensor leaf (shape checked, dtype cast), as TensorDict does; a new key is created
            meta = self._layout().entries.get(path)
            inplace = meta is not None and meta.is_tensor
        self._write({path: value}, inplace=inplace is True, ignore_lock=ignore_lock)
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

    def _write(self, items: Mapping[tuple[str, ...], object], *, inplace: bool, ignore_lock: bool = False) -> None:
        """Writes whole entries (tensors, nested tensordicts, non-tensors) in one atomic step."""
        prepared = {path: self._prepare_value(path, value) for path, value in items.items()}

        def check(layout: _backend.Layout) -> None:
            planner = planner_for(_store(self), layout, inplace=inplace)
            for path, value in prepared.items():
                planner.add(path, value)

        self._check_on_cleared(check)
        self._ensure_exists()

        conn = self._conn

        def plan(layout: _backend.Layout) -> WritePlanner:
            planner = planner_for(_store(self), layout, inplace=inplace)
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
                op.op == "put" and op.meta is not None and op.meta.is_tensor
                and layout.entries.get(op.path) == op.meta
                for op in ops
            ):
                # new values of existing tensors, same shapes and dtypes: written in place
                # (SETRANGE at 0 in a WATCH-guarded MULTI), with no tmp key and no rename
                groups = [(op.path, [(0, len(op.payload))], op.payload) for op in ops]
                if sum(len(op.payload) for op in ops) < _memory.GUARD_MIN:
                    # small: one round trip on an armed connection, from the calling thread when
                    # it can (Connection.write_rows); larger writes are checked against the
                    # server's maxmemory first, under the WATCH of the plain way
                    conn.write_rows(groups, str(layout.lv), check_lock=check_lock, whole=True)
                    return
                conn.run(
                    lambda c: _row_writes.write_runs_watched(
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

    def _prepare_value(self, path: tuple[str, ...], value: Any, batch_size: torch.Size | None = None) -> torch.Tensor | TensorDictBase:
        """Validates and converts a value before anything is sent."""
        if batch_size is None and not isinstance(value, (torch.Tensor, TensorDictBase)):
            batch_size = self.batch_size
        if is_tensorclass(value) and not isinstance(value, (NonTensorData, NonTensorStack)):
            value = value._tensordict
        value = snapshot_of(value)
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
        if names_list is not None:
            _values.check_names(names_list, self._where())
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
        try:
            conn.run(
                lambda c: _transfer.commit(
                    c, conn.keys, conn.runner, ops, expected="new", bump=True, check_lock=False, meta_updates=meta,
                    ttl_ms=getattr(self, "_create_ttl_ms", None), progress=_transfer.upload_bar(self, ops),
                ),
                idempotent=False,  # a re-sent create would find its own store and call it taken
            )
        except DurabilityError as err:
            # the store was created on the master: the caller gets its handle with the error
            conn.layout = None
            err.store = _store(self)
            raise
        conn.layout = None

    def _set_at_str(self, key: NestedKey, value: object, idx: IndexType, *, validated: bool = False, non_blocking: bool = False, **kwargs: object) -> Self:
        path = self._path + _as_path(key)
        meta = self._entry(path)
        if meta is None:  # set_at_ is in place: it never creates an entry
            raise self._key_error(path)
        if meta.is_non_tensor and not isinstance(value, (NonTensorData, NonTensorStack)):
            # a plain value, as TensorDict takes it (and refuses for an index that selects nothing)
            owner_bs = self._owner_batch_size(self._layout(), path)
            if len(owner_bs) and select_rows(normalize_index(idx), owner_bs).numel() == 0:
                raise RuntimeError(
                    f"cannot write a value into non-tensor entry {key!r} of {self._where()} at {idx!r}: "
                    "the index selects no element (indexed destination batch size has 0 elements)"
                )
            value = NonTensorData(data=value, batch_size=[])
        write_index(_store(self), idx, {path: value}, leaf=True)
        return self

    _set_at_tuple = _set_at_str

    def __setitem__(self, index: IndexType, value: object) -> None:
        if isinstance(index, str) or (isinstance(index, tuple) and index and all(isinstance(i, str) for i in index)):
            if value is self:
                raise ValueError("a store cannot hold itself")
            self._write({self._path + _as_path(index): value}, inplace=False)
            return
        self._setitem_index(index, value)

    def _setitem_index(self, index: IndexType, value: Any) -> None:
        layout = self._layout()
        if isinstance(value, (numbers.Number, torch.Tensor)):
            targets = {p: value for p, m in self._descendants(layout, self._path) if m.is_tensor}
            self._write_index(index, targets)
            return
        if is_tensorclass(value):
            value = value._tensordict
        value = snapshot_of(value)
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

    def _write_index(
        self, index: IndexType, targets: Mapping[tuple[str, ...], object], check_batch: Callable[[torch.Size], None] | None = None
    ) -> None:
        write_index(_store(self), index, targets, check_batch)


    # ------------------------------------------------------------------ whole-store writes
    def update(
        self,
        input_dict_or_td: Mapping[NestedKey, object] | TensorDictBase | None = None,
        clone: bool = False,
        inplace: bool = False,
        *,
        non_blocking: bool = False,
        keys_to_update: Sequence[NestedKey] | None = None,
        is_leaf: Callable[[type], bool] | None = None,
        update_batch_size: bool = False,
        ignore_lock: bool = False,
        **kwargs: object,
    ) -> Self:
        """Writes every entry of ``input_dict_or_td`` in one atomic step; nested ones merge."""
        if input_dict_or_td is None:
            input_dict_or_td = kwargs
        if not isinstance(input_dict_or_td, (Mapping, TensorDictBase)) and not is_tensorclass(input_dict_or_td):
            raise TypeError(
                f"update() of {self._where()} takes a dict or a TensorDict, got {type(input_dict_or_td).__name__}"
            )
        items = _leaf_items(self, input_dict_or_td, keys_to_update)
        if items:
            self._write(items, inplace=inplace, ignore_lock=ignore_lock)
        return self

    def update_(
        self,
        input_dict_or_td: Mapping[NestedKey, object] | TensorDictBase | None = None,
        clone: bool = False,
        *,
        non_blocking: bool = False,
        keys_to_update: Sequence[NestedKey] | None = None,
        **kwargs: object,
    ) -> Self:
        """Writes into existing entries (shapes checked, dtypes cast), in one atomic step."""
        if input_dict_or_td is None:
            input_dict_or_td = kwargs
        items = _leaf_items(self, input_dict_or_td, keys_to_update)
        if items:
            self._write(items, inplace=True)
        return self

    def del_(self, key: NestedKey) -> Self:
        """Deletes an entry (a nested one with all its content) in one atomic step."""
        path = self._path + _as_path(key)

        def plan(layout: _backend.Layout) -> tuple[list[_backend.Op], None]:
            if path not in layout.entries:
                raise self._key_error(path)
            ops = [
                _backend.Op("del", p, has_data=m.has_data)
                for p, m in layout.entries.items()
                if p[: len(path)] == path
            ]
            return ops, None

        self._commit_planned(plan, check_lock=True)
        return self

    def _del(self, key: NestedKey) -> None:
        self.del_(key)

    def __delitem__(self, key: NestedKey) -> None:
        self.del_(key)

    def rename_key_(self, old_key: NestedKey, new_key: NestedKey, safe: bool = False) -> Self:
        """Renames an entry on the server (no bytes move through the client)."""
        old = self._path + _as_path(old_key)
        new = self._path + _as_path(new_key)
        if old == new:
            return self

        def plan(layout: _backend.Layout) -> tuple[list[_backend.Op], None]:
            self._check_rename(layout, old, new, safe)
            ops = _rename_ops(layout.entries, old, new, self._where(), layout.lv + 1)
            return ops, None

        self._commit_planned(plan, check_lock=True)
        return self

    def pop(self, key: NestedKey, default: object = _MISSING, *args: object) -> object:
        """Reads an entry and deletes it; returns ``default`` (when given) for a missing key."""
        has_default = default is not _MISSING and not is_no_default(default)
        path = self._path + _as_path(key)
        meta = self._entry(path)
        if meta is None:
            if has_default:
                return default
            raise self._key_error(path)
        value = self._sub(path).to_tensordict() if meta.is_node else self._read_values([path])[0]
        self.del_(key)
        return value

    # ------------------------------------------------------------------ copies on the server
    def _sibling_from(
        self, td: TensorDictBase, *, device: DeviceType | None = None, names: Sequence[str | None] | None = None
    ) -> Self:
        cls = type(self)
        conn = self._conn.sibling(new_td_id())
        # the copy keeps the source's chunking: an entry that fits the source's strings fits its own
        conn.chunk_bytes = self.chunk_bytes
        store = cls._handle(conn, (), torch.device(device) if device is not None else None, self._cache_metadata, self._backend_label)
        store._create_store(td.batch_size, store._device_override, names, upload_ops(store, td), None)
        return store

    def _clone(self, recurse: bool = True, **kwargs: object) -> Self:
        """``clone()``: a new store (new td_id) holding a copy; ``recurse=False``: a new handle."""
        if not recurse:
            return type(self)._handle(self._conn, self._path, self._device_override, self._cache_metadata, self._backend_label)
        td = self.to_tensordict()
        return self._sibling_from(td, device=self._device_override, names=td.names if td._has_names() else None)

    def clone(self, recurse: bool = True, **kwargs: object) -> Self:
        return self._clone(recurse, **kwargs)

    def copy(self) -> Self:
        return self._clone(False)


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


def _store(host: StoreWrites) -> TensorDictStore:
    """The host as the class that the planners take (``StoreWrites`` is a mixin of TensorDictStore only)."""
    return cast("TensorDictStore", host)


def planner_for(store: StoreWrites, layout: _backend.Layout, *, inplace: bool) -> WritePlanner:
    """A :class:`~tdstore._core.planner.WritePlanner` with the settings of ``store``: its name
    in errors, its pickle policy, its connection's size limits."""
    conn = store._conn
    return WritePlanner(
        layout, inplace=inplace, where=store._where(), pickle_policy=conn.pickle_policy,
        check_entry_size=conn.check_entry_size,
    )


async def _noop(client: AsyncClient) -> None:
    return None


def _planner(store: StoreWrites, layout: _backend.Layout) -> WritePlanner:
    store._conn.run(_noop)  # sets up the connection: proto-max-bulk-len is known
    return planner_for(store, layout, inplace=False)


def upload_ops(store: StoreWrites, td: TensorDictBase) -> list[_backend.Op]:
    """The operations that write every leaf of ``td`` to the new ``store`` (checked, not sent):
    what ``from_tensordict`` and the copies on the server create a store with."""
    layout = _backend.Layout(0, {"batch_size": json.dumps(list(td.batch_size)), **store._creation_meta()}, {})
    planner = _planner(store, layout)
    for key, value in td.items():
        planner.add(_as_path(key), store._prepare_value(_as_path(key), value, td.batch_size))
    return planner.ops


def _leaf_items(store: StoreWrites, source: Any, keys_to_update: Sequence[NestedKey] | None) -> dict[tuple[str, ...], object]:
    """Flattens a dict or TensorDict into leaf paths (nested tensordicts merge, as update does)."""
    if is_tensorclass(source) and not isinstance(source, (NonTensorData, NonTensorStack)):
        source = source._tensordict
    if source is store:
        return {}
    if isinstance(source, type(store)):
        source = source.to_tensordict()
    allowed = None if keys_to_update is None else {_as_path(k) for k in keys_to_update}
    out: dict[tuple[str, ...], object] = {}

    def visit(prefix: tuple[str, ...], value: object) -> None:
        if isinstance(value, Mapping) and not isinstance(value, TensorDictBase):
            for k, v in value.items():
                visit(prefix + _as_path(k), v)
            return
        if isinstance(value, TensorDictBase) and not isinstance(value, (NonTensorData, NonTensorStack)):
            existing = store._entry(store._path + prefix) if prefix else None
            if existing is not None and existing.is_node and prefix:
                for k, v in value.items():
                    visit(prefix + (k,), v)
                return
            if not prefix:
                for k, v in value.items():
                    visit((k,), v)
                return
        if allowed is not None and not any(prefix[: len(a)] == a for a in allowed):
            return
        out[store._path + prefix] = value

    visit((), source)
    return out
