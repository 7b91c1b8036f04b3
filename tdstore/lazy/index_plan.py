"""Plans writes at an index of a LazyStackedTensorDictStore: value -> byte runs. No I/O.

The index is applied, in memory, to a lazy stack of *position maps*: for every tensor leaf
the selected elements hold the flat item numbers of their own bytes in the leaf's data
string. Indexing that stack the way the user indexed the store gives, leaf by leaf, the
positions the value's items go to, in the value's order and shape, for any index that
TensorDict accepts (ints, slices, lists, masks, several dims, ragged elements). Sorted and
coalesced, the positions become the byte runs of one atomic write.
"""

from __future__ import annotations

import numbers
from bisect import bisect_right
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict, TensorDictBase
from tensordict.utils import is_tensorclass

from tdstore._backend import ops as _backend
from tdstore._core import codec as _codec
from tdstore._core.indexing import leaf_dims, normalize_index
from tdstore._core.layout import Entry
from tdstore._core.values import decode_stored_non_tensor
from tdstore.base.handle import snapshot_of
from tdstore.errors import (
    CorruptMetadataError,
    ElementShapeError,
    EntryNotFoundError,
    SchemaError,
    UnsupportedOperationError,
)
from tdstore.lazy import plan

if TYPE_CHECKING:
    from typing import TypeAlias

    from tensordict.utils import IndexType

    from tdstore.lazy import LazyStackedTensorDictStore

    #: one leaf's write: its path, the byte runs ``(offset, length)`` and their bytes back to back
    _Group: TypeAlias = "tuple[tuple[str, ...], list[tuple[int, int]], memoryview]"
    #: a non-tensor leaf's new bytes from its old ones (read under WATCH)
    _Update: TypeAlias = "Callable[[Entry | None, bytes | None], tuple[Entry, bytes]]"

__all__ = ["OneLeaf", "plan_index_write"]


def _is_leaf(cls: type) -> bool:
    return issubclass(cls, (torch.Tensor, NonTensorData, NonTensorStack))


class OneLeaf:
    """The value of ``set_at_(key, value, idx)``: one leaf written at an index."""

    def __init__(self, rel: tuple[str, ...], value: torch.Tensor | numbers.Number) -> None:
        self.rel = rel
        self.value = value


def plan_index_write(
    store: LazyStackedTensorDictStore, layout: _backend.Layout, index: IndexType, value: Any
) -> tuple[list[_Group], list[tuple[tuple[str, ...], _Update]]]:
    """The ``write_runs_watched`` groups and non-tensor updates of ``store[index] = value``."""
    bs, s = store._root(layout)
    n = bs[s]
    base = store._path
    elem_bs = store._elem_bs(layout)
    full = store._full_bs(elem_bs, layout)
    if isinstance(value, OneLeaf):
        meta = layout.entries.get(base + value.rel)
        if meta is not None and meta.kind == "lt" and meta.shape is not None:
            if leaf_dims(normalize_index(index), len(full), 1 + len(meta.shape)) > len(full):
                # the index reaches the leaf's own dims, as LazyStackedTensorDict.set_at_ does
                return _leaf_write(store, layout, base + value.rel, value, index, elem_bs, s, n), []
    members, remapped, pick = plan.split_index(index, len(full), s, n)
    where = store._where()

    tensor_targets: dict[tuple[str, ...], object] = {}
    nontensor_targets: list[tuple[str, ...]] = []
    source: object
    if isinstance(value, OneLeaf):
        path = base + value.rel
        meta = layout.entries.get(path)
        if meta is None or meta.kind != "lt":
            raise store._key_error(path) if meta is None else SchemaError(f"{path!r} of {where} is not a tensor entry")
        tensor_targets[path] = value.value
        source = value.value
    elif isinstance(value, (numbers.Number, torch.Tensor)):
        source = value
        for path, meta in store._descendants(layout):
            if meta.kind == "lt":
                tensor_targets[path] = value
    else:
        value = snapshot_of(value)
        if is_tensorclass(value) and not isinstance(value, (NonTensorData, NonTensorStack)):
            value = value._tensordict
        if isinstance(value, dict):
            value = TensorDict.from_dict(value, batch_size=[])
        if not isinstance(value, TensorDictBase):
            raise TypeError(f"cannot write a {type(value).__name__} at an index of {where}")
        source = value
        for key in value.keys(include_nested=True, leaves_only=True, is_leaf=_is_leaf):
            rel = (key,) if isinstance(key, str) else tuple(key)
            path = base + rel
            meta = layout.entries.get(path)
            if meta is None:
                raise EntryNotFoundError(
                    f"key {rel!r} of the value is not in {where}; add it to the whole stack first "
                    "(store[key] = value) and then write elements"
                )
            if meta.kind == "lt":
                tensor_targets[path] = value
            elif meta.kind == "lnt":
                nontensor_targets.append(path)
            else:
                raise SchemaError(f"{path!r} of {where} is a nested tensordict, the value holds a leaf there")

    groups: list[_Group] = []
    if tensor_targets:
        positions = _position_stack(store, layout, list(tensor_targets), members, elem_bs, s, pick, remapped)
        for path in tensor_targets:
            meta = layout.entries[path]
            dtype = _codec.entry_dtype(meta)
            item = dtype.itemsize
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
            offsets, _ = store._spans(layout, path)
            ctx = _Ctx(path, where, [o // item for o in offsets], plan.elem_shapes(meta, n))
            _collect(positions, source, path[len(base) :], pairs, ctx, pick if isinstance(pick, int) else None,
                     pick if isinstance(pick, list) else None)
            group = _runs(path, pairs, dtype, item)
            if group is not None:
                groups.append(group)
    nontensor: list[tuple[tuple[str, ...], _Update]] = []
    for path in nontensor_targets:
        nontensor.append((path, _nontensor_update(store, path, source, pick, s, where)))
    return groups, nontensor


def _leaf_write(
    store: LazyStackedTensorDictStore, layout: _backend.Layout, path: tuple[str, ...], leaf: OneLeaf, index: IndexType,
    elem_bs: torch.Size, s: int, n: int,
) -> list[_Group]:
    """The runs of ``set_at_(key, value, index)`` where ``index`` reaches past the batch dims."""
    meta = layout.entries[path]
    dtype = _codec.entry_dtype(meta)
    members = list(range(n))
    positions = _position_stack(store, layout, [path], members, elem_bs, s, None, (slice(None),))
    rel = path[len(store._path) :]
    pos = positions.get_at(rel[0] if len(rel) == 1 else rel, index)
    value = torch.as_tensor(leaf.value)
    while value.dim() > pos.dim() and value.shape[0] == 1:
        value = value[0]
    try:
        value = value.broadcast_to(pos.shape)
    except RuntimeError:
        raise ElementShapeError(
            f"cannot write a value of shape {list(value.shape)} into key {path!r} of {store._where()} at "
            f"{index!r}, which selects shape {list(pos.shape)}"
        ) from None
    group = _runs(path, [(pos.reshape(-1), value.reshape(-1))], dtype, dtype.itemsize)
    return [group] if group is not None else []


class _Ctx:
    def __init__(self, path: tuple[str, ...], where: str, item_offsets: list[int], shapes: list[list[int]]) -> None:
        self.path = path
        self.where = where
        self.item_offsets = item_offsets
        self.shapes = shapes

    def element_of(self, pos: torch.Tensor) -> str:
        if not pos.numel():
            return "?"
        return str(bisect_right(self.item_offsets, int(pos.reshape(-1)[0])) - 1)


def _position_stack(
    store: LazyStackedTensorDictStore, layout: _backend.Layout, paths: list[tuple[str, ...]], members: list[int], elem_bs: torch.Size,
    s: int, pick: int | list[int] | None, remapped: IndexType,
) -> TensorDictBase:
    bs, _ = store._root(layout)
    n = bs[s]
    values: dict[tuple[str, ...], Mapping[int, object]] = {}
    for path in paths:
        meta = layout.entries[path]
        item = meta.itemsize
        offsets, _ = store._spans(layout, path)
        shapes = plan.elem_shapes(meta, n)
        values[path] = {
            j: torch.arange(offsets[j] // item, offsets[j] // item + int(torch.Size(shapes[j]).numel())).reshape(shapes[j])
            for j in members
        }
    wanted = set(paths)
    entries = [
        (p, m) for p, m in store._descendants(layout)
        if p in wanted or (m.is_node and any(q[: len(p)] == p for q in wanted))
    ]
    tds = plan.decode_members(entries, values, members, elem_bs, store._path, None)
    if isinstance(pick, int):
        return tds[0]
    if pick is not None:
        by_id = dict(zip(members, tds, strict=True))
        return LazyStackedTensorDict(*[by_id[j] for j in pick], stack_dim=s)
    return LazyStackedTensorDict(*tds, stack_dim=s)[remapped]


def _collect(
    positions: TensorDictBase, source: object, rel: tuple[str, ...], out: list[tuple[torch.Tensor, torch.Tensor]], ctx: _Ctx,
    elem: int | None = None, elems: list[int] | None = None,
) -> None:
    """Pairs (positions, values) of one leaf; ``elem``/``elems``: the element(s) written, when known."""
    key = rel[0] if len(rel) == 1 else rel
    try:
        pos = positions.get(key)
    except RuntimeError:
        if not isinstance(positions, LazyStackedTensorDict):
            raise
        # ragged: the elements of the indexed stack one by one, with the value's parts
        for k, sub in enumerate(positions.tensordicts):
            part = source[(slice(None),) * positions.stack_dim + (k,)] if isinstance(source, TensorDictBase) else source
            _collect(sub, part, rel, out, ctx, elems[k] if elems else None)
        return
    if isinstance(source, TensorDictBase):
        try:
            value = source.get(key)
        except RuntimeError:
            value = None
        if value is None or (isinstance(value, torch.Tensor) and value.shape != pos.shape and isinstance(source, LazyStackedTensorDict) and isinstance(positions, LazyStackedTensorDict)):
            if isinstance(source, LazyStackedTensorDict) and isinstance(positions, LazyStackedTensorDict) and len(source.tensordicts) == len(positions.tensordicts) and source.stack_dim == positions.stack_dim:
                for k, (sub_pos, sub_val) in enumerate(zip(positions.tensordicts, source.tensordicts, strict=True)):
                    _collect(sub_pos, sub_val, rel, out, ctx, elems[k] if elems else None)
                return
            if value is None:
                raise _shape_error(ctx, pos, "a ragged value", elem)
    else:
        value = source
    value = torch.as_tensor(value)
    while value.dim() > pos.dim() and value.shape[0] == 1:
        value = value[0]  # extra leading size-1 dims, as torch's setitem accepts them
    if value.shape != pos.shape:
        try:
            value = value.broadcast_to(pos.shape)
        except RuntimeError:
            raise _shape_error(ctx, pos, f"a value of shape {list(value.shape)}", elem) from None
    out.append((pos.reshape(-1), value.reshape(-1)))


def _shape_error(ctx: _Ctx, pos: torch.Tensor, what: str, elem: int | None) -> SchemaError:
    j = str(elem) if elem is not None else ctx.element_of(pos)
    old = ctx.shapes[int(j)] if j != "?" else None
    return ElementShapeError(
        f"cannot write {what} into key {ctx.path!r} at element {j} of {ctx.where}: the target has shape "
        f"{list(pos.shape)} (element {j} has shape {old}). Elements of a lazy store keep their shapes; to "
        "change them, set the whole key (store[key] = new_lazy_stack) or upload a new stack"
    )


def _runs(
    path: tuple[str, ...], pairs: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype, item: int
) -> _Group | None:
    if not pairs:
        return None
    pos = torch.cat([p for p, _ in pairs]) if len(pairs) > 1 else pairs[0][0]
    val = torch.cat([v.to(dtype) for _, v in pairs]) if len(pairs) > 1 else pairs[0][1].to(dtype)
    if not pos.numel():
        return None
    if pos.numel() > 1 and not bool((pos[1:] - pos[:-1] == 1).all()):
        order = torch.argsort(pos, stable=True)
        pos, val = pos[order], val[order]
        keep = torch.ones(pos.numel(), dtype=torch.bool)
        keep[:-1] = pos[1:] != pos[:-1]  # repeated positions: the last write wins
        pos, val = pos[keep], val[keep]
    if pos.numel() > 1:
        cut = ((pos[1:] - pos[:-1]) != 1).nonzero().reshape(-1) + 1
    else:
        cut = torch.empty(0, dtype=torch.long)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), cut])
    ends = torch.cat([cut, torch.tensor([pos.numel()])])
    runs = list(zip((pos[starts] * item).tolist(), ((ends - starts) * item).tolist(), strict=True))
    _, payload = _codec.tensor_view(val.cpu())
    return path, runs, payload


def _nontensor_update(
    store: LazyStackedTensorDictStore, path: tuple[str, ...], source: TensorDictBase, pick: int | list[int] | None, s: int, where: str
) -> _Update:
    rel = path[len(store._path) :]
    key = rel[0] if len(rel) == 1 else rel
    if pick is None:
        raise UnsupportedOperationError(
            f"non-tensor entry {path!r} of {where} can only be written for whole elements (store[j] = td, "
            "store[[j, k]] = lazy_stack); the index selects parts of elements"
        )
    new: dict[int, list[object]] = {}
    if isinstance(pick, int):
        new[pick] = plan.nontensor_item(source.get(key))
    else:
        parts = list(source.tensordicts) if isinstance(source, LazyStackedTensorDict) and source.stack_dim == s else list(source.unbind(s))
        if len(parts) != len(pick):
            raise SchemaError(f"cannot write {len(parts)} elements' values of {path!r} into {len(pick)} elements of {where}")
        for j, part in zip(pick, parts, strict=True):
            new[j] = plan.nontensor_item(part.get(key))
    policy = store._conn.pickle_policy

    def update(old_meta: Entry | None, old: bytes | None) -> tuple[Entry, bytes]:
        if old_meta is None or old_meta.kind != "lnt" or old is None:
            raise CorruptMetadataError(f"non-tensor entry {path!r} of {where} changed or lost its bytes during a write")
        items = decode_stored_non_tensor(old_meta, old, policy, path, where)
        if not isinstance(items, list) or any(not 0 <= j < len(items) for j in new):
            raise CorruptMetadataError(f"non-tensor entry {path!r} of {where} holds no list of its elements' values")
        for j, item in new.items():
            items[j] = item
        enc, payload = _codec.encode_non_tensor(items, policy)
        return Entry("lnt", old_meta.order, enc=enc), payload

    return update
