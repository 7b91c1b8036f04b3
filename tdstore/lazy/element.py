"""``L[i]`` of a lazy store: an element that reads and writes through to the server.

:class:`LazyElement` is a ``TensorDict`` (what ``LazyStackedTensorDict[i]`` returns) for
element ``i`` of the store. Reading a key through it (``elem["k"]``, ``elem.get(...)``,
``elem["sub"]["k"]``) reads the element from the server first, in one step, so the view shows
the server's state, writes of other handles and processes included; ``elem.to_tensordict()``
reads the whole element in one step (its entries never mix two writes). Its writes go to the
server, each as one element write of the store (one atomic step): ``elem["k"] = v``, ``set``,
``set_``, ``elem[j] = v``, ``masked_fill_``, ``update`` and the same on a nested view
(``elem["sub"]["k"] = v``). Like every element write of a lazy store, they write existing keys
and keep the element's shapes (see docs/lazy.md). Other methods (``items()``, ``clone``,
``apply``, in-place math on the view) act on the copy read last.

Tensordicts that TensorDict's own methods build from a view (``clone``, ``apply``, indexing...)
are plain copies: they have no store, and act like any ``TensorDict``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from tdstore._core.keys import as_path as _as_path
from tdstore.errors import UnsupportedOperationError

if TYPE_CHECKING:
    from tensordict import NestedKey
    from tensordict.utils import IndexType
    from typing_extensions import Self

    from tdstore.lazy.reads import LazyReads

__all__ = ["LazyElement"]


def _is_key(index: object) -> bool:
    return isinstance(index, str) or (isinstance(index, tuple) and bool(index) and all(isinstance(i, str) for i in index))


class LazyElement(TensorDict):
    """Element ``member`` of the lazy store ``store`` (nested key ``rel`` inside it), read and written on the server."""

    _tds_store: Any = None  # None: a plain TensorDict (made by a TensorDict method from a view)
    _tds_member: int = 0
    _tds_rel: tuple[str, ...] = ()

    @classmethod
    def _attach(cls, snapshot: TensorDictBase, store: LazyReads | None, member: int, rel: tuple[str, ...] = ()) -> LazyElement:
        view = cls(batch_size=snapshot.batch_size, device=snapshot.device)
        object.__setattr__(view, "_tds_store", store)
        object.__setattr__(view, "_tds_member", member)
        object.__setattr__(view, "_tds_rel", rel)
        view._take(snapshot)
        return view

    def _take(self, snapshot: TensorDictBase) -> None:
        """Replaces the copy by ``snapshot`` (nested tensordicts become nested views)."""
        items = {}
        for key, value in snapshot.items():
            if isinstance(value, TensorDictBase) and not isinstance(value, (NonTensorData, NonTensorStack)):
                value = LazyElement._attach(value, self._tds_store, self._tds_member, self._tds_rel + (key,))
            items[key] = value
        self._tensordict.clear()
        self._tensordict.update(items)

    def _refresh(self) -> None:
        if self._tds_store is None:
            return
        element = self._tds_store._read_index(self._element_index(), view=False)
        self._take(element.get(self._tds_rel) if self._tds_rel else element)

    # ------------------------------------------------------------------ reads
    def _get_str(self, key: str, *args: object, **kwargs: object) -> object:
        if self._tds_store is not None:
            self._refresh()  # read through: the server's state, not the copy made earlier
        return super()._get_str(key, *args, **kwargs)

    def _get_tuple(self, key: tuple[str, ...], *args: object, **kwargs: object) -> object:
        if self._tds_store is not None and len(key) > 1:
            self._refresh()
            first = TensorDict._get_str(self, key[0], *args, **kwargs)  # the fresh copy: no second read
            return first._get_tuple(key[1:], *args, **kwargs) if hasattr(first, "_get_tuple") else first
        return super()._get_tuple(key, *args, **kwargs)

    def to_tensordict(self, *args: object, **kwargs: object) -> TensorDict:
        """The element read from the server in one step, as a plain ``TensorDict``."""
        if self._tds_store is not None:
            self._refresh()
        return TensorDict.to_tensordict(self, *args, **kwargs)

    # ------------------------------------------------------------------ indices
    def _element_index(self, index: IndexType = None) -> IndexType:
        """The store index of this element, or of ``index`` inside it."""
        store = self._tds_store
        s = store.stack_dim
        parts: tuple[object, ...] = () if index is None else (index if isinstance(index, tuple) else (index,))
        if s == 0:
            return (self._tds_member, *parts) if parts else self._tds_member
        if any(p is Ellipsis or p is None for p in parts):
            raise UnsupportedOperationError(
                f"an index with ... or None into an element of {store._where()}, stacked along dim {s}: "
                "index the store instead"
            )
        parts = parts + (slice(None),) * max(0, s - len(parts))
        return (*parts[:s], self._tds_member, *parts[s:])

    # ------------------------------------------------------------------ writes
    def _write(self, index: IndexType, value: object) -> None:
        self._tds_store[self._element_index(index)] = value
        self._refresh()

    def _write_leaves(self, leaves: Mapping[tuple[str, ...], object]) -> None:
        """Writes ``{path relative to this view: value}`` into the element, as one step."""
        root = self._tds_store._read_index(self._element_index(), view=False)
        value = TensorDict({}, batch_size=root.batch_size)
        for path, leaf in leaves.items():
            full = self._tds_rel + path
            for i in range(1, len(full)):
                if full[:i] not in value.keys(include_nested=True):
                    value.set(full[:i], TensorDict({}, batch_size=root.get(full[:i]).batch_size))
            value.set(full, leaf)
        self._write(None, value)

    def _set_str(self, key: str, value: object, *, inplace: bool, validated: bool, ignore_lock: bool = False, non_blocking: bool = False) -> Self:
        if self._tds_store is None:
            return super()._set_str(key, value, inplace=inplace, validated=validated, ignore_lock=ignore_lock, non_blocking=non_blocking)
        self._write_leaves({_as_path(key): value})
        return self

    def _set_tuple(self, key: tuple[str, ...], value: object, *, inplace: bool, validated: bool, non_blocking: bool = False) -> Self:
        if self._tds_store is None:
            return super()._set_tuple(key, value, inplace=inplace, validated=validated, non_blocking=non_blocking)
        self._write_leaves({_as_path(key): value})
        return self

    def __setitem__(self, index: IndexType, value: object) -> None:
        if self._tds_store is None or _is_key(index):
            super().__setitem__(index, value)
            return
        if self._tds_rel:
            # a nested view: only its own leaves change, as the same index on every one of them
            if isinstance(value, TensorDictBase):
                value = TensorDict({self._tds_rel: value}, batch_size=value.batch_size)
            else:
                paths = [p for p in self.keys(include_nested=True, leaves_only=True)]
                value = TensorDict({self._tds_rel + _as_path(p): value for p in paths}, batch_size=[])
        self._write(index, value)

    def update(
        self, input_dict_or_td: Mapping[NestedKey, object] | TensorDictBase | None = None, clone: bool = False, inplace: bool = False, **kwargs: Any
    ) -> Self:
        if self._tds_store is None:
            return super().update(input_dict_or_td, clone=clone, inplace=inplace, **kwargs)
        source = input_dict_or_td if input_dict_or_td is not None else {}
        keys_to_update = kwargs.get("keys_to_update")
        leaves: dict[tuple[str, ...], object] = {}

        def walk(node: Mapping[NestedKey, object] | TensorDictBase, prefix: tuple[str, ...]) -> None:
            for key, value in node.items():
                path = prefix + _as_path(key)
                if isinstance(value, dict) or (isinstance(value, TensorDictBase) and not isinstance(value, (NonTensorData, NonTensorStack))):
                    walk(value, path)
                elif keys_to_update is None or path in {_as_path(k) for k in keys_to_update}:
                    leaves[path] = value

        walk(source, ())
        if leaves:
            self._write_leaves(leaves)
        return self

    def masked_fill_(self, mask: torch.Tensor, value: float | bool) -> Self:
        if self._tds_store is None:
            return super().masked_fill_(mask, value)
        paths = [
            _as_path(p) for p, leaf in self.items(include_nested=True, leaves_only=True)
            if isinstance(leaf, torch.Tensor)
        ]
        if paths:
            fill = TensorDict({self._tds_rel + p: torch.as_tensor(value) for p in paths}, batch_size=[])
            self._write(mask, fill)
        return self
