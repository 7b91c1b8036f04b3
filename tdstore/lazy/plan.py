"""Pure helpers of LazyStackedTensorDictStore: metadata, upload plans, index split, decoding.

No I/O. A lazy store keeps the ``N`` stacked tensordicts ("elements") of a
``LazyStackedTensorDict`` under one store id, with the usual meta hash, registry and
data keys (see :mod:`tdstore._core.keys`). The meta hash also holds ``kind = "lazy"`` and
``stack_dim``; ``batch_size`` is the full batch size (the stack dim included).

Registry metadata, one :class:`~tdstore._core.layout.Entry` per entry path (its docstring
gives the JSON wire format):

* tensor leaf (kind ``"lt"``): a dtype and a shape when every element has the same shape,
  else one shape per element (ragged leaf). Shapes are the elements' own (the stack dim
  not included). The data key holds the elements' bytes back to back, element 0 first,
  so element ``j`` is one byte span (offsets follow from the shapes).
* nested tensordict (kind ``"td"``): the elements' batch size of that node (the same in
  every element).
* non-tensor leaf (kind ``"lnt"``): an encoding; the data key holds
  one encoded list of ``N`` items ``[stack, value]``: ``stack`` 0 is a ``NonTensorData``
  of the element, ``k > 0`` a ``NonTensorStack`` over its first ``k`` batch dims (nested
  lists).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict, TensorDictBase
from tensordict.utils import is_tensorclass

from tdstore._backend import ops as _backend
from tdstore._core import codec as _codec
from tdstore._core import values as _values
from tdstore._core.layout import Entry
from tdstore.errors import BatchMismatchError, CorruptMetadataError, SchemaError

if TYPE_CHECKING:
    from tensordict.utils import IndexType

__all__ = [
    "KIND",
    "check_lazy_meta",
    "elem_shapes",
    "elem_spans",
    "plan_members",
    "split_index",
    "members_from_value",
    "decode_members",
    "concat_bytes",
    "nontensor_item",
]

#: The ``kind`` field of a lazy store's meta hash.
KIND = "lazy"


# --------------------------------------------------------------------------- metadata
def check_lazy_meta(path: tuple[str, ...], meta: Entry, n: int, where: str) -> Entry:
    """Validates one registry entry of a lazy store (``n`` elements) before it is used (its
    fields were validated when parsed, see :meth:`~tdstore._core.layout.Entry.from_json`)."""
    if meta.kind not in ("lt", "td", "lnt"):
        raise CorruptMetadataError(f"entry {path!r} of lazy store {where} has malformed metadata {meta.to_json()}")
    if meta.kind == "lt" and meta.shape is None and len(meta.shapes or ()) != n:
        raise CorruptMetadataError(
            f"entry {path!r} of lazy store {where} needs a shape or {n} element shapes, got {meta.to_json()}"
        )
    return meta


def elem_shapes(meta: Entry, n: int) -> list[list[int]]:
    """The shape of each of the ``n`` elements of a tensor leaf."""
    if meta.shape is not None:
        return [list(meta.shape)] * n
    return [list(s) for s in meta.shapes or ()]


def elem_spans(meta: Entry, n: int) -> tuple[list[int], list[int]]:
    """Byte offset and byte length of each element of a tensor leaf."""
    item = meta.itemsize
    if meta.shape is not None:
        size = math.prod(meta.shape) * item
        return [j * size for j in range(n)], [size] * n
    sizes = [math.prod(s) * item for s in meta.shapes or ()]
    offsets, pos = [], 0
    for size in sizes:
        offsets.append(pos)
        pos += size
    return offsets, sizes


# --------------------------------------------------------------------------- uploads
def nontensor_item(value: NonTensorData | NonTensorStack) -> list[object]:
    """``[stack, data]`` of one element's non-tensor value."""
    if isinstance(value, NonTensorStack):
        return [value.batch_dims, value.tolist()]
    return [0, value.data]


class MemberPlanner:
    """Turns the elements' values of one key into commit ops (a node, leaves, or one leaf)."""

    def __init__(self, where: str, order_base: int, max_bulk: int, policy: _codec.PicklePolicy) -> None:
        self.where = where
        self.order_base = order_base
        self.seq = 0
        self.max_bulk = max_bulk
        self.policy = policy
        self.ops: list[_backend.Op] = []

    def order(self) -> list[int]:
        self.seq += 1
        return [self.order_base, self.seq]

    def add(self, path: tuple[str, ...], values: list[Any], owner_bs: torch.Size) -> None:
        """Adds the ops of entry ``path`` whose value in element ``j`` is ``values[j]``."""
        values = [v._tensordict if is_tensorclass(v) and not isinstance(v, (NonTensorData, NonTensorStack)) else v for v in values]
        kinds = {_kind(v) for v in values}
        if len(kinds) != 1:
            raise SchemaError(
                f"entry {path!r} of {self.where} holds different kinds of values across the stacked "
                f"elements ({sorted(kinds)}); every element must hold a tensor, a tensordict or a "
                "non-tensor value there"
            )
        kind = kinds.pop()
        if kind == "lazy":
            raise SchemaError(
                f"entry {path!r} of {self.where}: an element holds a LazyStackedTensorDict; nested lazy "
                "stacks are not supported. Call .contiguous() on it, or stack its members at the top level"
            )
        if kind == "other":
            raise SchemaError(
                f"entry {path!r} of {self.where}: cannot store a {type(values[0]).__name__} as an element "
                "value; use a tensor, a tensordict or a NonTensorData"
            )
        if kind == "t":
            self.add_tensor(path, values, owner_bs)
        elif kind == "nt":
            self.add_nontensor(path, values)
        else:
            self.add_node(path, values, owner_bs)

    def add_tensor(self, path: tuple[str, ...], values: list[torch.Tensor], owner_bs: torch.Size) -> None:
        from tdstore._core.planner import check_tensor

        dtypes = {v.dtype for v in values}
        if len(dtypes) != 1:
            raise SchemaError(
                f"entry {path!r} of {self.where} has different dtypes across the stacked elements "
                f"({sorted(map(str, dtypes))}); cast them to one dtype first"
            )
        for j, v in enumerate(values):
            check_tensor(v, path, self.where)
            if v.shape[: len(owner_bs)] != owner_bs:
                raise SchemaError(
                    f"entry {path!r} of element {j} of {self.where} has shape {list(v.shape)}, which does "
                    f"not start with the element batch size {list(owner_bs)}"
                )
        dtype = values[0].dtype
        shapes = [list(v.shape) for v in values]
        uniform = all(s == shapes[0] for s in shapes)
        meta = Entry(
            "lt", tuple(self.order()), dtype=_codec.dtype_name(dtype), shape=tuple(shapes[0]) if uniform else None,
            shapes=None if uniform else tuple(tuple(s) for s in shapes),
        )
        payload = concat_bytes(values)
        self.check_size(path, len(payload))
        self.ops.append(_backend.Op("put", path, meta, payload=payload))

    def add_nontensor(self, path: tuple[str, ...], values: list[NonTensorData | NonTensorStack]) -> None:
        enc, payload = _codec.encode_non_tensor([nontensor_item(v) for v in values], self.policy)
        self.check_size(path, len(payload))
        self.ops.append(_backend.Op("put", path, Entry("lnt", tuple(self.order()), enc=enc), payload=payload))

    def add_node(self, path: tuple[str, ...], values: list[TensorDictBase], owner_bs: torch.Size) -> None:
        sizes = {tuple(v.batch_size) for v in values}
        if len(sizes) != 1:
            raise SchemaError(
                f"nested entry {path!r} of {self.where} has different batch sizes across the stacked "
                f"elements ({sorted(map(list, sizes))}); a lazy store needs one batch size per nested key"
            )
        bs = values[0].batch_size
        if bs[: len(owner_bs)] != owner_bs:
            raise SchemaError(f"nested entry {path!r} of {self.where} has batch size {list(bs)}, not under {list(owner_bs)}")
        keys = list(values[0].keys())
        for j, v in enumerate(values[1:], 1):
            if set(v.keys()) != set(keys):
                diff = sorted(map(str, set(v.keys()) ^ set(keys)))
                raise SchemaError(
                    f"the stacked elements of {self.where} differ in their keys under {path!r}: element {j} "
                    f"and element 0 differ in {diff}; a lazy store needs the same keys in every element"
                )
        if path:
            self.ops.append(_backend.Op("node", path, _values.node_meta(bs, None, self.order())))
        for key in keys:
            self.add(path + (key,), [v._get_str(key, _values.NO_DEFAULT) for v in values], bs)

    def check_size(self, path: tuple[str, ...], nbytes: int) -> None:
        if nbytes > self.max_bulk:
            from tdstore.errors import EntryTooLargeError

            raise EntryTooLargeError(
                f"entry {path!r} of {self.where} needs {nbytes} bytes, more than the server's "
                f"proto-max-bulk-len of {self.max_bulk} bytes for one string. Raise the limit "
                "(CONFIG SET proto-max-bulk-len) or split the stack into several stores."
            )


def concat_bytes(values: list[torch.Tensor]) -> bytes | memoryview:
    """The elements' bytes back to back: one torch.cat and one view (no copy per element)."""
    flat = [(v.detach() if v.requires_grad else v).reshape(-1) for v in values]
    if any(f.device.type != "cpu" or f.is_conj() or f.is_neg() for f in flat):
        return b"".join(_codec.tensor_view(v)[1] for v in values)
    joined = torch.cat(flat) if len(flat) > 1 else flat[0]
    return _codec.tensor_view(joined)[1]


def _kind(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return "t"
    if isinstance(value, (NonTensorData, NonTensorStack)):
        return "nt"
    if isinstance(value, LazyStackedTensorDict):
        return "lazy"
    if isinstance(value, TensorDictBase):
        return "td"
    return "other"


def plan_members(
    path: tuple[str, ...], values: list[Any], owner_bs: torch.Size, *, where: str, order_base: int, max_bulk: int,
    policy: _codec.PicklePolicy,
) -> list[_backend.Op]:
    """Commit ops that store ``values`` (one per element) at ``path`` (``()``: the whole stack)."""
    planner = MemberPlanner(where, order_base, max_bulk, policy)
    if path:
        planner.add(path, values, owner_bs)
    else:
        planner.add_node((), values, owner_bs)
    return planner.ops


class ElementValues(list):  # type: ignore[type-arg]
    """The values of one key in every element, in element order (e.g. a ragged leaf's tensors)."""


def members_from_value(value: object, batch_size: torch.Size, stack_dim: int, path: tuple[str, ...], where: str) -> list[Any]:
    """Splits a value written at a key of the whole stack into the elements' values."""
    n = batch_size[stack_dim]
    if isinstance(value, ElementValues):
        if len(value) != n:
            raise SchemaError(f"cannot set {path!r} of {where} from {len(value)} elements' values; the stack has {n}")
        return list(value)
    if isinstance(value, LazyStackedTensorDict):
        if value.batch_size != batch_size:
            raise SchemaError(
                f"cannot set {path!r} of {where} (batch size {list(batch_size)}) to a lazy stack of batch "
                f"size {list(value.batch_size)}"
            )
        if value.stack_dim == stack_dim:
            return list(value.tensordicts)
        return list(value.unbind(stack_dim))
    if isinstance(value, (NonTensorData, NonTensorStack)):
        if isinstance(value, NonTensorStack) and value.batch_size[: len(batch_size)] == batch_size:
            return list(value.unbind(stack_dim))
        elem_bs = batch_size[:stack_dim] + batch_size[stack_dim + 1 :]
        return [NonTensorData(data=value.data if isinstance(value, NonTensorData) else value.tolist(), batch_size=elem_bs)] * n
    if isinstance(value, torch.Tensor) or (isinstance(value, TensorDictBase) and not is_tensorclass(value)):
        if value.shape[: len(batch_size)] != batch_size if isinstance(value, torch.Tensor) else value.batch_size[: len(batch_size)] != batch_size:
            shape = value.shape if isinstance(value, torch.Tensor) else value.batch_size
            raise BatchMismatchError(
                f"cannot set {path!r} of {where}: the value's shape {list(shape)} does not start with the "
                f"batch size {list(batch_size)}"
            )
        return list(value.unbind(stack_dim))
    if isinstance(value, dict):
        return members_from_value(TensorDict.from_dict(value, batch_size=batch_size), batch_size, stack_dim, path, where)
    elem_bs = batch_size[:stack_dim] + batch_size[stack_dim + 1 :]
    from tdstore._core.planner import tensor_like

    if tensor_like(value) and not isinstance(value, (str, bytes)):
        try:
            return members_from_value(torch.as_tensor(value), batch_size, stack_dim, path, where)
        except (TypeError, ValueError, RuntimeError):
            pass
    return [NonTensorData(data=value, batch_size=elem_bs)] * n


# --------------------------------------------------------------------------- indices
def split_index(index: IndexType, batch_ndim: int, stack_dim: int, n: int) -> tuple[list[int], IndexType, int | list[int] | None]:
    """Splits an index of the stack into the elements it needs and the same index over them.

    Returns:
        ``(members, remapped, pick)``: the sorted element numbers to read; the index to apply
        to a lazy stack of just those elements (same result as ``index`` on the whole stack);
        and, when the index selects whole elements and nothing else, the element number
        (int) or the element numbers in result order (list), else None.
    """
    items = list(index) if isinstance(index, tuple) else [index]
    items = [_as_index_item(i) for i in items]
    if len(items) == 1 and isinstance(items[0], int) and stack_dim == 0:
        # the common case first: one element
        j = items[0] + n if items[0] < 0 else items[0]
        if not 0 <= j < n:
            raise IndexError(f"index {items[0]} is out of bounds for the stack dim of size {n}")
        return [j], (0,), j
    everything = _Everything(n, index)
    if sum(1 for i in items if i is Ellipsis) > 1:
        return everything.value()
    consumed = sum(_dims_of(i) for i in items if i is not Ellipsis)
    if consumed > batch_ndim:
        raise IndexError(f"too many indices for a lazy store of {batch_ndim} batch dims: {index!r}")
    expanded: list[object] = []
    for item in items:
        if item is Ellipsis:
            expanded.extend([slice(None)] * (batch_ndim - consumed))
        else:
            expanded.append(item)
    dim = 0
    pos = None
    for k, item in enumerate(expanded):
        if item is None:
            continue
        width = _dims_of(item)
        if dim <= stack_dim < dim + width:
            if width != 1:
                return everything.value()
            pos = k
            break
        dim += width
    others_full = all(isinstance(i, slice) and i == slice(None) for k, i in enumerate(expanded) if k != pos)
    if pos is None:
        return list(range(n)), tuple(expanded), (list(range(n)) if others_full else None)
    entry = expanded[pos]
    members: list[int]
    new_entry: object
    picked: int | list[int]
    if isinstance(entry, int):
        j = entry + n if entry < 0 else entry
        if not 0 <= j < n:
            raise IndexError(f"index {entry} is out of bounds for the stack dim of size {n}")
        members, new_entry, picked = [j], 0, j
    elif isinstance(entry, slice):
        members = list(range(n)[entry])
        if not members:
            return everything.value()
        new_entry, picked = slice(None), members
    elif isinstance(entry, torch.Tensor) and entry.dtype == torch.bool:
        if entry.shape != (n,):
            return everything.value()
        members = entry.nonzero().reshape(-1).tolist()
        if not members:
            return everything.value()
        new_entry, picked = torch.ones(len(members), dtype=torch.bool), members
    elif isinstance(entry, torch.Tensor) and not entry.is_floating_point() and entry.ndim == 1:
        picked = [j + n if j < 0 else j for j in entry.tolist()]
        if not picked or not all(0 <= j < n for j in picked):
            return everything.value()  # empty, or out of bounds: torch raises its own error
        members = sorted(set(picked))
        new_entry = torch.tensor([bisect_left(members, j) for j in picked], dtype=torch.long)
    else:
        return everything.value()
    remapped = list(expanded)
    remapped[pos] = new_entry
    return members, tuple(remapped), (picked if others_full else None)


class _Everything:
    """The answer "read every element and apply the index as it is", built only when needed."""

    def __init__(self, n: int, index: IndexType) -> None:
        self.n = n
        self.index = index

    def value(self) -> tuple[list[int], IndexType, None]:
        return list(range(self.n)), self.index, None


def _as_index_item(item: object) -> object:
    if isinstance(item, (list, range)):
        try:
            return torch.as_tensor(list(item))
        except (TypeError, ValueError, RuntimeError):
            return item
    if hasattr(item, "__index__") and not isinstance(item, (bool, torch.Tensor)):
        return int(item.__index__())
    if isinstance(item, torch.Tensor) and item.ndim == 0 and not item.dtype == torch.bool and not item.is_floating_point():
        return int(item)
    return item


def _dims_of(item: object) -> int:
    if item is None:
        return 0
    if isinstance(item, torch.Tensor) and item.dtype == torch.bool:
        return max(item.ndim, 1)
    return 1


# --------------------------------------------------------------------------- decoding
def decode_members(
    layout_entries: list[tuple[tuple[str, ...], Entry]],
    values: Mapping[tuple[str, ...], Mapping[int, object]],
    members: list[int],
    root_bs: torch.Size,
    base: tuple[str, ...],
    device: torch.device | None,
) -> list[TensorDict]:
    """Builds the element tensordicts ``members`` from decoded leaf values.

    ``layout_entries`` are the descendants of ``base`` in insertion order (nodes before
    their children); ``values[path][j]`` is the value of leaf ``path`` in element ``j``.
    """
    # the tree of keys, once: children of each node in insertion order
    children: dict[tuple[str, ...], list[tuple[tuple[str, ...], Entry]]] = {base: []}
    for path, meta in layout_entries:
        if meta.is_node or path in values:
            children.setdefault(path[:-1], []).append((path, meta))
            if meta.is_node:
                children.setdefault(path, [])

    def build(node: tuple[str, ...], bs: Sequence[int] | None, j: int) -> TensorDict:
        source: dict[str, object] = {}
        for path, meta in children.get(node, ()):
            if meta.is_node:
                source[path[-1]] = build(path, meta.batch_size, j)
            else:
                source[path[-1]] = values[path][j]
        return _new_td(source, bs, device)

    return [build(base, root_bs, j) for j in members]


def _new_td(source: dict[str, object], batch_size: Any, device: torch.device | None) -> TensorDict:
    """A TensorDict of already checked values (skips TensorDict's per-value validation)."""
    try:
        return TensorDict._new_unsafe(source=source, batch_size=torch.Size(batch_size), device=device)
    except (AttributeError, TypeError):  # pragma: no cover - a tensordict without _new_unsafe
        return TensorDict(source, batch_size=batch_size, device=device)


def decode_nontensor(meta: Entry, data: bytes | torch.Tensor, n: int, owner_bs: torch.Size, path: tuple[str, ...], where: str, policy: _codec.PicklePolicy, device: torch.device | None) -> list[object]:
    """The ``n`` elements' values of a non-tensor leaf."""
    items = _codec.decode_non_tensor(meta.enc or "", bytes(data), policy)
    if not isinstance(items, list) or len(items) != n:
        raise CorruptMetadataError(f"non-tensor entry {path!r} of lazy store {where} does not hold {n} elements")
    out: list[object] = []
    for item in items:
        stack, value = item
        if stack:
            out.append(NonTensorStack.from_list(value))
        else:
            out.append(NonTensorData(data=value, batch_size=owner_bs, device=device))
    return out

