"""Writes of a LazyStackedTensorDictStore (a mixin): keys of the whole stack, and elements.

Key changes (add, replace, delete, rename) are one ``commit`` each and bump the layout
version; element writes are byte runs written in one WATCH-guarded MULTI (or the
``write_runs`` script) at the layout version they were planned with (see
:mod:`tdstore.lazy.index_plan`).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDictBase
from tensordict.utils import is_tensorclass

from tdstore._backend import ops as _backend
from tdstore._backend import row_writes as _row_writes
from tdstore._backend.optimistic import Retry, optimistic
from tdstore._core import codec as _codec
from tdstore._core.keys import as_path as _as_path
from tdstore._core.layout import Entry
from tdstore._core.planner import rename_ops as _rename_ops
from tdstore._core.values import NO_DEFAULT, is_no_default
from tdstore.base.handle import snapshot_of
from tdstore.base.host import LazyBase
from tdstore.errors import SchemaError, StaleLayoutError, UnsupportedOperationError
from tdstore.lazy import plan
from tdstore.lazy.index_plan import OneLeaf, plan_index_write

if TYPE_CHECKING:
    from tensordict import NestedKey
    from tensordict.utils import IndexType
    from typing_extensions import Self

    from tdstore._backend.protocols import AsyncClient


__all__ = ["LazyWrites"]

_MAX_CAS_RETRIES = 1000


class LazyWrites(LazyBase):
    """Write methods of :class:`~tdstore.lazy.LazyStackedTensorDictStore`."""

    # ------------------------------------------------------------------ key writes
    def __setitem__(self, index: IndexType, value: object) -> None:
        if isinstance(index, str) or (isinstance(index, tuple) and index and all(isinstance(i, str) for i in index)):
            if value is self:
                raise ValueError("a store cannot hold itself")
            self._set_key(self._path + _as_path(index), value)
            return
        self._write_index(index, value)

    def _set_str(self, key: NestedKey, value: object, *, inplace: bool = False, validated: bool = False, ignore_lock: bool = False, non_blocking: bool = False, **kwargs: object) -> Self:
        self._set_key(self._path + _as_path(key), value)
        return self

    _set_tuple = _set_str

    def _set_at_str(self, key: NestedKey, value: object, idx: IndexType, *, validated: bool = False, non_blocking: bool = False, **kwargs: object) -> Self:
        rel = _as_path(key)
        if not isinstance(value, (torch.Tensor, numbers.Number)):
            raise TypeError(f"set_at_ writes a tensor at an index of {rel!r} in {self._where()}, got {type(value).__name__}")
        self._write_index(idx, OneLeaf(rel, value))
        return self

    _set_at_tuple = _set_at_str

    def update(
        self, input_dict_or_td: Mapping[NestedKey, object] | TensorDictBase | None = None, clone: bool = False, inplace: bool = False, *,
        keys_to_update: Sequence[NestedKey] | None = None, non_blocking: bool = False, **kwargs: object,
    ) -> Self:
        """Sets every key of a dict or tensordict of the stack's batch size, in one atomic step."""
        for option in ("is_leaf", "update_batch_size", "ignore_lock"):
            kwargs.pop(option, None)
        source = kwargs if input_dict_or_td is None else input_dict_or_td
        items: list[tuple[NestedKey, object]]
        if isinstance(source, LazyStackedTensorDict):
            # each key's value in every element (ragged leaves included)
            s = self.stack_dim
            elements = source.tensordicts if source.stack_dim == s else source.unbind(s)
            items = [(k, plan.ElementValues(e._get_str(k, NO_DEFAULT) for e in elements)) for k in source.keys()]
        else:
            items = list(self._merged_items(source, ()))
        if keys_to_update is not None:
            allowed = {_as_path(k) for k in keys_to_update}
            items = [(k, v) for k, v in items if any(_as_path(k)[:i] in allowed for i in range(1, len(_as_path(k)) + 1))]
        if items:
            self._set_keys([(self._path + _as_path(k), v) for k, v in items])
        return self

    def _merged_items(self, source: Mapping[NestedKey, object] | TensorDictBase, prefix: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], object]]:
        """``(relative path, value)`` of an update: a dict or tensordict written onto an existing
        nested tensordict updates its keys (and keeps the others), as ``TensorDict.update`` does."""
        for key, value in source.items():
            path = prefix + _as_path(key)
            nested = isinstance(value, dict) or (
                isinstance(value, TensorDictBase) and not isinstance(value, (NonTensorData, NonTensorStack, LazyStackedTensorDict))
            )
            entry = self._entry(self._path + path) if nested else None
            if nested and entry is not None and entry.is_node:
                yield from self._merged_items(value, path)
            else:
                yield path, value

    def _set_key(self, path: tuple[str, ...], value: object) -> None:
        self._set_keys([(path, value)])

    def _set_keys(self, items: list[tuple[tuple[str, ...], object]]) -> None:
        def build(layout: _backend.Layout) -> list[_backend.Op]:
            ops: list[_backend.Op] = []
            view = layout
            for k, (path, value) in enumerate(items):
                key_ops = self._key_ops(view, path, value, k)
                ops.extend(key_ops)
                if k + 1 < len(items):
                    # the next key is planned against the registry as this one leaves it
                    # ({"b": tensor, ("b", "x"): ...} must not register b as a leaf and a node)
                    entries = dict(view.entries)
                    for op in key_ops:
                        if op.op == "del":
                            entries.pop(op.path, None)
                        elif op.op == "move" and op.new_path is not None:
                            entries.pop(op.path, None)
                            if op.meta is not None:
                                entries[op.new_path] = op.meta
                        elif op.meta is not None:
                            entries[op.path] = op.meta
                    view = _backend.Layout(layout.lv, layout.meta, entries, layout.wv)
            return ops

        self._commit_ops(build)

    def _key_ops(self, layout: _backend.Layout, path: tuple[str, ...], value: Any, k: int) -> list[_backend.Op]:
        value = snapshot_of(value)
        if is_tensorclass(value) and not isinstance(value, (NonTensorData, NonTensorStack)):
            value = value._tensordict
        ops: list[_backend.Op] = []
        parent = path[:-1]
        for i in range(len(self._path) + 1, len(parent) + 1):
            node = layout.entries.get(parent[:i])
            if node is None:
                meta = Entry.node(self._elem_bs(layout, parent[: i - 1]), None, (layout.lv + 1, 10**6 * k + i))
                ops.append(_backend.Op("node", parent[:i], meta))
            elif not node.is_node:
                raise SchemaError(f"cannot set {path!r} in {self._where()}: {parent[:i]!r} is a leaf, not a nested tensordict")
        owner = self._elem_bs(layout, parent) if not ops or ops[-1].meta is None else torch.Size(ops[-1].meta.batch_size or ())
        full = self._full_bs(owner, layout)
        bs, s = self._root(layout)
        members = plan.members_from_value(value, full, s, path, self._where())
        for p, m in layout.entries.items():
            if p[: len(path)] == path:
                ops.append(_backend.Op("del", p, has_data=m.has_data))
        self._conn.run(_noop)
        new_ops = plan.plan_members(
            path, members, owner, where=self._where(), order_base=layout.lv + 1 + k,
            max_bulk=self._conn.max_bulk, policy=self._conn.pickle_policy,
        )
        existing = layout.entries.get(path)
        if existing is not None and new_ops and new_ops[0].path == path and new_ops[0].meta is not None:
            new_ops[0].meta = new_ops[0].meta._replace(order=existing.order)  # a replaced key keeps its place
        ops.extend(new_ops)
        return ops

    def del_(self, key: NestedKey) -> Self:
        """Deletes an entry (a nested one with all its content) in one atomic step."""
        path = self._path + _as_path(key)

        def ops(layout: _backend.Layout) -> list[_backend.Op]:
            if path not in layout.entries:
                raise self._key_error(path)
            return [_backend.Op("del", p, has_data=m.has_data) for p, m in layout.entries.items() if p[: len(path)] == path]

        self._commit_ops(ops)
        return self

    def _del(self, key: NestedKey) -> None:
        self.del_(key)

    def __delitem__(self, key: NestedKey) -> None:
        self.del_(key)

    def pop(self, key: NestedKey, default: object = NO_DEFAULT) -> object:
        path = self._path + _as_path(key)
        if self._entry(path) is None:
            if is_no_default(default):
                raise self._key_error(path)
            return default
        tds, s = self._memory_stack([p for p, m in self._descendants(self._layout(), path) if m.has_data] or [path], None)
        value = LazyStackedTensorDict(*tds, stack_dim=s).get(path[len(self._path) :])
        self.del_(key)
        return value

    def rename_key_(self, old_key: NestedKey, new_key: NestedKey, safe: bool = False) -> Self:
        """Renames an entry on the server (no bytes move through the client), in one atomic step."""
        old = self._path + _as_path(old_key)
        new = self._path + _as_path(new_key)
        if old == new:
            return self

        def ops(layout: _backend.Layout) -> list[_backend.Op]:
            self._check_rename(layout, old, new, safe)
            onto_ancestor = old[: len(new)] == new  # what old holds keeps its (longer) batch dims
            if not onto_ancestor and new[: len(old)] != old and all(
                (node := layout.entries.get(new[:i])) is not None and node.is_node for i in range(1, len(new))
            ):
                if self._elem_bs(layout, old[:-1]) != self._elem_bs(layout, new[:-1]):
                    raise SchemaError(f"cannot rename {old!r} to {new!r} in {self._where()}: their parents' batch sizes differ")
            return _rename_ops(layout.entries, old, new, self._where(), layout.lv + 1)

        self._commit_ops(ops)
        return self

    def _commit_ops(self, build: Callable[[_backend.Layout], list[_backend.Op]]) -> None:
        self._check_on_cleared(build)
        self._ensure_exists()
        conn = self._conn

        def once(_attempt: int) -> None:
            layout = self._layout()
            try:
                ops = build(layout)
            except (SchemaError, KeyError, ValueError):
                if self._fresh_layout().lv != layout.lv:
                    raise Retry() from None  # planned against a stale layout: plan again
                raise
            conn.run(
                lambda c: _backend.commit(
                    c, conn.keys, conn.runner, ops, expected=str(layout.lv), bump=True, check_lock=True
                )
            )
            conn.layout = None

        optimistic(once, where=self._where, what="a write", on_stale=lambda: self._layout(refresh=True))

    # ------------------------------------------------------------------ element writes
    def _write_index(self, index: IndexType, value: object) -> None:
        self._check_on_cleared(lambda layout: plan_index_write(self, layout, index, value))  # type: ignore[arg-type]
        self._ensure_exists()
        conn = self._conn

        def once(_attempt: int) -> None:
            layout = self._layout()
            try:
                groups, nontensor = plan_index_write(self, layout, index, value)  # type: ignore[arg-type]
            except (SchemaError, KeyError, UnsupportedOperationError):
                if self._fresh_layout().lv != layout.lv:
                    raise Retry() from None  # planned against a stale layout: plan again
                raise
            if not groups and not nontensor:
                return
            if not nontensor:
                # tensor bytes only: one round trip on an armed connection, from the calling
                # thread when it can (Connection.write_rows), else the WATCHed MULTI below
                conn.write_rows(groups, str(layout.lv), check_lock=True)
                return
            changed = conn.run(
                lambda c: _row_writes.write_runs_watched(
                    c, conn.keys, conn.runner, groups, expected=str(layout.lv), check_lock=True, nontensor=nontensor
                )
            )
            if changed:
                conn.layout = None

        optimistic(once, where=self._where, what="an indexed write", on_stale=lambda: self._layout(refresh=True))

    # ------------------------------------------------------------------ in-place math
    def _inplace_on_copies(self, method: Callable[..., object], *args: object, **kwargs: object) -> object:
        """In-place methods (``add_``, ``mul_``, ``+=``...): run on a snapshot, written back as one compare-and-set.

        The snapshot carries the store's write version; the commit refuses the write-back if
        any process wrote the store since (no update is lost), and the method is run again
        on a fresh snapshot. Ragged leaves work: the method runs on the in-memory lazy stack.
        """
        from tdstore.errors import WriteConflictError

        self._ensure_exists()
        conn = self._conn

        def once(_attempt: int) -> object:
            local, layout, wv = self._snapshot()
            result = method(local, *args, **kwargs)
            if result is not local:
                return result  # not in place: a new tensordict, nothing to write
            ops = []
            for path, meta in self._descendants(layout):
                if meta.kind != "lt":
                    continue
                rel = path[len(self._path) :]
                values = [td.get(rel) for td in local.tensordicts]
                shapes = self._shapes(layout, path)
                for j, value in enumerate(values):
                    if list(value.shape) != list(shapes[j]) or _codec.dtype_name(value.dtype) != meta.dtype:
                        raise SchemaError(
                            f"{method.__name__} changed entry {path!r} of element {j} of {self._where()} to "
                            f"{value.dtype}{list(value.shape)}; an in-place method must keep dtypes and shapes"
                        )
                ops.append(_backend.Op("put", path, meta, payload=plan.concat_bytes(values)))
            if not ops:
                return self
            conn.run(
                lambda c: _backend.commit(
                    c, conn.keys, conn.runner, ops, expected=str(layout.lv), bump=False, check_lock=True, expected_wv=wv
                )
            )
            return self

        return optimistic(
            once, where=self._where,
            what=f"{getattr(method, '__name__', 'an in-place method')} (its compare-and-set lost to other processes' writes each time; try again)",
            on_stale=lambda: self._layout(refresh=True), tries=_MAX_CAS_RETRIES,
            retry_on=(StaleLayoutError, WriteConflictError), error=WriteConflictError,
        )

    def apply_(self, fn: Callable[..., object], *others: object, **kwargs: object) -> object:
        """``fn`` applied to every tensor leaf in place: one snapshot, written back as one compare-and-set."""
        others = tuple(snapshot_of(o) for o in others)

        def run(td: TensorDictBase) -> TensorDictBase:
            td.apply_(fn, *others, **kwargs)
            return td

        run.__name__ = "apply_"
        return self._inplace_on_copies(run)

    def _inplace_on_nested_copies(self, method: Callable[..., object], *args: object, **kwargs: object) -> object:
        return self._inplace_on_copies(method, *args, **kwargs)


async def _noop(client: AsyncClient) -> None:
    return None
