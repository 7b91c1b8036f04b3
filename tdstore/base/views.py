"""The live keys view that ``keys()`` of a dense or lazy store returns."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from tdstore._core.keys import as_path

if TYPE_CHECKING:
    from tdstore.base.host import StoreHost

__all__ = ["StoreKeysView"]


class StoreKeysView:
    """What ``keys()`` returns: a live view over the store's registry."""

    def __init__(
        self, store: StoreHost, include_nested: bool, leaves_only: bool, is_leaf: Callable[[type], bool] | None, sort: bool
    ) -> None:
        self.tensordict = store
        self.include_nested = include_nested
        self.leaves_only = leaves_only
        self.is_leaf = is_leaf
        self.sort = sort

    def _keys(self) -> list[str | tuple[str, ...]]:
        keys = self.tensordict._key_list(self.include_nested, self.leaves_only, self.is_leaf)
        if self.sort:
            keys.sort(key=lambda k: ".".join(k) if isinstance(k, tuple) else k)
        return keys

    def __iter__(self) -> Iterator[str | tuple[str, ...]]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def __contains__(self, key: object) -> bool:
        if isinstance(key, tuple) and len(key) == 1:
            key = key[0]
        if isinstance(key, tuple) and not self.include_nested:
            store = self.tensordict
            path = store._path + as_path(key)
            meta = store._entry(path)
            return meta is not None and not (self.leaves_only and meta.is_node)
        return key in self._keys()

    def __repr__(self) -> str:
        return f"StoreKeysView({self._keys()})"

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other)  # type: ignore[call-overload]
