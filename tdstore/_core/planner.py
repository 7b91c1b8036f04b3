"""Plans whole-entry writes: values -> commit ops against one layout snapshot. No I/O.

Also holds the value checks shared by the write paths (which tensors can be stored).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDictBase
from tensordict.utils import is_tensorclass

from tdstore._core import chunks as _chunks
from tdstore._core import codec as _codec
from tdstore._core import values as _values
from tdstore._core.layout import Entry, Layout, Op
from tdstore.errors import EntryNotFoundError, InplaceWriteError

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["WritePlanner", "check_tensor", "tensor_like", "flatten_values"]


def tensor_like(value: object) -> bool:
    if isinstance(value, (numbers.Number, torch.Tensor)):
        return True
    try:
        import numpy as np

        if isinstance(value, (np.ndarray, np.generic)):
            return value.dtype != object
    except ImportError:  # pragma: no cover
        pass
    return isinstance(value, (list, tuple))


def flatten_values(value: Iterable[object]) -> Iterator[object]:
    for item in value:
        if isinstance(item, (list, tuple)):
            yield from flatten_values(item)
        else:
            yield item


def check_tensor(value: torch.Tensor, path: tuple[str, ...], where: str) -> None:
    if value.is_sparse or value.layout != torch.strided:
        raise TypeError(f"entry {path!r} of {where}: a {value.layout} tensor cannot be stored; call .to_dense() first")
    if getattr(value, "is_nested", False):
        raise TypeError(f"entry {path!r} of {where}: a nested tensor cannot be stored; store its components")
    if value.device.type == "meta":
        raise TypeError(f"entry {path!r} of {where}: a tensor on the meta device has no data to store; materialize it first")
    _codec.dtype_name(value.dtype)


class WritePlanner:
    """Turns whole-entry writes into commit ops against one layout snapshot."""

    def __init__(
        self, layout: Layout, *, inplace: bool, where: str, pickle_policy: _codec.PicklePolicy, check_entry_size: Callable[..., None],
    ) -> None:
        """``where``: the store, as errors name it; ``pickle_policy``: what non-tensor values may
        be pickled (``tdstore._core.codec``); ``check_entry_size(path, nbytes, where, chunk=)``
        refuses an entry the server cannot hold (the connection's limits)."""
        self.pickle_policy, self.check_entry_size = pickle_policy, check_entry_size
        self.layout = layout
        self.inplace = inplace
        self.ops: list[Op] = []
        self.bump = False
        self.entries = dict(layout.entries)
        self._seq = 0
        self.where = where

    def order(self) -> list[int]:
        self._seq += 1
        return [self.layout.lv + 1, self._seq]

    def owner_bs(self, path: tuple[str, ...]) -> torch.Size:
        if len(path) == 1:
            return torch.Size(self.layout.batch_size)
        node = self.entries.get(path[:-1])
        assert node is not None, f"the parent of {path!r} is registered before its entries"
        return torch.Size(node.batch_size or ())

    def ensure_parents(self, path: tuple[str, ...]) -> None:
        for i in range(1, len(path)):
            parent = path[:i]
            meta = self.entries.get(parent)
            if meta is None:
                if self.inplace:
                    raise EntryNotFoundError(f"key {parent!r} not found in {self.where}")
                node = _values.node_meta(self.owner_bs(parent), None, self.order())
                self.entries[parent] = node
                self.ops.append(Op("node", parent, node))
                self.bump = True
            elif not meta.is_node:
                raise KeyError(f"cannot write {path!r} in {self.where}: {parent!r} is not a nested tensordict")

    def remove(self, path: tuple[str, ...]) -> None:
        # an entry this plan wrote earlier (update({("b", "c"): x, "b": y})) is superseded: its op
        # goes, as a "del" after it would miss bytes it wrote in another chunking
        def under(p: tuple[str, ...]) -> bool:
            return p[: len(path)] == path

        self.ops = [op for op in self.ops if op.op == "del" or not under(op.path)]
        for sub in [p for p in self.entries if under(p)]:
            self.entries.pop(sub)
            meta = self.layout.entries.get(sub)
            if meta is not None:
                self.ops.append(Op("del", sub, has_data=meta.has_data))
            self.bump = True

    def add(self, path: tuple[str, ...], value: Any) -> None:
        self.ensure_parents(path)
        existing = self.entries.get(path)
        owner_bs = self.owner_bs(path)
        if isinstance(value, torch.Tensor):
            self.add_tensor(path, value, existing, owner_bs)
        elif isinstance(value, (NonTensorData, NonTensorStack)):
            if self.inplace and (existing is None or not existing.is_non_tensor):
                raise EntryNotFoundError(f"non-tensor key {path!r} not found in {self.where} for an in-place write")
            try:
                meta, payload = _values.nontensor_parts(
                    value, existing.order if existing else self.order(), self.pickle_policy
                )
            except (TypeError, ValueError) as err:  # unpicklable, or pickle switched off: name the entry
                raise type(err)(f"entry {path!r} of {self.where}: {err}") from err
            self.check_size(path, len(payload))
            if existing is not None and existing != meta:
                self.remove(path)
                self.bump = True
            elif existing is None:
                self.bump = True
            self.entries[path] = meta
            self.ops.append(Op("put", path, meta, payload=payload))
        elif isinstance(value, TensorDictBase):
            self.add_node(path, value, existing, owner_bs)
        else:
            raise TypeError(f"cannot store a {type(value).__name__} at {path!r} in {self.where}")

    def add_tensor(self, path: tuple[str, ...], value: torch.Tensor, existing: Entry | None, owner_bs: torch.Size) -> None:
        if self.inplace:
            if existing is None or not existing.is_tensor:
                raise EntryNotFoundError(f'key "{path[-1]}" not found in {self.where} (in-place writes need an existing entry)')
            shape = torch.Size(existing.shape or ())
            if value.shape != shape:
                try:
                    value = value.expand(shape)
                except RuntimeError:
                    raise InplaceWriteError(
                        f"Failed to update {path!r} in {self.where}: the value of shape {value.shape} "
                        f"does not fit the entry of shape {shape}"
                    ) from None
            value = value.to(_codec.entry_dtype(existing))
            meta = existing
        else:
            if value.shape[: len(owner_bs)] != owner_bs:
                raise RuntimeError(
                    f"batch dimension mismatch, got self.batch_size={owner_bs} and "
                    f"value.shape={value.shape} for key {path!r} in {self.where}"
                )
            meta = _chunks.annotate(_values.tensor_meta(value, existing.order if existing else self.order()), self.layout.meta)
            if existing is not None and not existing.is_tensor:
                self.remove(path)
            if existing is None or existing.dtype != meta.dtype or existing.shape != meta.shape:
                self.bump = True
        keep, view = _codec.tensor_view(value)
        self.check_size(path, len(view), meta.chunk)
        self.entries[path] = meta
        self.ops.append(Op("put", path, meta, payload=view, extra={"keep": keep}))

    def add_node(self, path: tuple[str, ...], value: TensorDictBase, existing: Entry | None, owner_bs: torch.Size) -> None:
        if self.inplace:
            if existing is None or not existing.is_node:
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
        node = _values.node_meta(value.batch_size, names, existing.order if existing else self.order())
        self.entries[path] = node
        self.ops.append(Op("node", path, node))
        self.bump = True
        for key, leaf in value.items(include_nested=False):
            if is_tensorclass(leaf) and not isinstance(leaf, (NonTensorData, NonTensorStack)):
                leaf = leaf._tensordict
            self.add(path + (key,), leaf)

    def check_size(self, path: tuple[str, ...], nbytes: int, chunk: int | None = None) -> None:
        self.check_entry_size(path, nbytes, self.where, chunk=chunk)


def rename_ops(
    entries: Mapping[tuple[str, ...], Entry], old: tuple[str, ...], new: tuple[str, ...], where: str, order_base: int
) -> list[Op]:
    """The commit ops of renaming the entry ``old`` (with all its content) to ``new``.

    The renamed entries move to the end of their parent's keys, as ``TensorDict.rename_key_``
    moves them: they take new insertion orders ``(order_base, i)`` (``order_base`` is the layout
    version the commit makes, as a new key's), in their old order.

    What was at ``new`` is replaced, as ``TensorDict.rename_key_`` replaces it; when ``new`` is
    an ancestor of ``old`` (``("a", "b") -> "a"``), the entries being moved are not part of what
    is replaced. Raises ``KeyError`` (as TensorDict does) when a parent of ``new`` is missing or
    is not a nested tensordict, and ``ValueError`` for a rename into ``old``'s own sub-key.
    """
    if new[: len(old)] == old:
        raise ValueError(f"cannot rename {old!r} into its own sub-key {new!r}")
    for i in range(1, len(new)):
        parent = entries.get(new[:i])
        if parent is None:
            raise KeyError(f"cannot rename {old!r} to {new!r} in {where}: {new[:i]!r} does not exist")
        if not parent.is_node:
            raise KeyError(
                f"cannot rename {old!r} to {new!r} in {where}: {new[:i]!r} is not a nested tensordict"
            )
    moved = {p for p in entries if p[: len(old)] == old}
    ops = [
        Op("del", p, has_data=m.has_data)
        for p, m in entries.items()
        if p[: len(new)] == new and p not in moved
    ]
    fresh = {p: (order_base, i + 1) for i, p in enumerate(sorted(moved, key=lambda p: entries[p].order_key))}
    # shortest first: a source that is also a later target (("a", "b", "b") -> ("a", "b")) has
    # been moved away before it is overwritten
    for p in sorted(moved, key=len):
        m = entries[p]._replace(order=fresh[p])
        target = new + p[len(old) :]
        if m.is_node:
            ops.append(Op("del", p, has_data=False))
            ops.append(Op("node", target, m))
        else:
            ops.append(Op("move", p, m, new_path=target))
    return ops
