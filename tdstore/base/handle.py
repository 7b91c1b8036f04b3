"""What every store handle does the same way, dense or lazy: the TensorDictBase hooks, making
a handle (``_init_handle``, ``_handle``), ``repr``, the lock, the key list, ``entry_class`` and
the entry lookup of reads, the listing of registry entries (:func:`entries_below`), the checks
of a rename, and the trivial overrides (``is_shared``, ``detach_``, ``close``, ``==``, the
context manager).

:class:`StoreHandle` is a mixin of both :class:`~tdstore.TensorDictStore` and
:class:`~tdstore.LazyStackedTensorDictStore`. What differs between them is asked of the
host class: ``_class_of(meta)`` (the class an entry reads as), ``_nontensors_are_leaves``
(whether ``keys(leaves_only=True)`` lists non-tensor entries when no ``is_leaf`` is given),
and for ``repr`` ``_repr_name``, ``_repr_details()`` and ``_node_batch_size(meta, layout)``.
The methods both refuse are made by :func:`tdstore.base.unsupported.refuse`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from tdstore._backend import ops as _backend
from tdstore._core.keys import as_path as _as_path
from tdstore._core.layout import Entry
from tdstore._core.tdcompat import KeyThroughLeafError
from tdstore._core.values import is_no_default, order_key
from tdstore.base.layout_cache import LayoutCache
from tdstore.base.views import StoreKeysView

if TYPE_CHECKING:
    from tensordict import NestedKey, TensorDictBase
    from typing_extensions import Self

    from tdstore._backend.connection import Connection

__all__ = ["StoreHandle", "entries_below", "snapshot_of"]

_Entries = list[tuple[tuple[str, ...], Entry]]


def entries_below(
    layout: _backend.Layout, path: tuple[str, ...], *, children: bool = False, depth_first: bool = False
) -> _Entries:
    """The ``(path, meta)`` registry entries below ``path`` (only its ``children``), in their
    order of creation (``depth_first``: shallower ones first); kept in the layout's memo."""
    key = ("children" if children else "descendants", path, depth_first)
    memo = layout.memo.get(key)
    if memo is None:
        n = len(path)
        memo = [(p, m) for p, m in layout.entries.items() if len(p) > n and p[:n] == path and (len(p) == n + 1 or not children)]
        if depth_first:
            memo.sort(key=lambda item: (len(item[0]), order_key(item[1])))
        else:
            memo.sort(key=lambda item: order_key(item[1]))
        layout.memo[key] = memo
    return memo

_T = TypeVar("_T")


class StoreHandle(LayoutCache):
    """Mixin: the members the dense and the lazy store classes share."""

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

    #: whether ``keys(leaves_only=True)`` lists non-tensor entries when ``is_leaf`` is None
    _nontensors_are_leaves: bool = True
    #: the class name ``repr`` shows
    _repr_name: str

    # ------------------------------------------------------------------ handles
    def _init_handle(
        self, conn: Connection, path: tuple[str, ...], device: torch.device | None, cache_metadata: bool, *more: Any
    ) -> None:
        """Sets up a handle on ``conn`` at the nested ``path``; ``more``: what the host class adds."""
        self._conn = conn
        self._path = path
        self._device_override = device
        self._cache_metadata = bool(cache_metadata)
        self._is_shared = False
        self._is_memmap = False
        self._cleared_meta: dict[str, str] | None = None

    @classmethod
    def _handle(
        cls, conn: Connection, path: tuple[str, ...], device: torch.device | None, cache_metadata: bool, *more: Any
    ) -> Self:
        """A handle on ``conn`` (no server round trip): what sub-handles, ``to(device)`` and unpickling make."""
        self = cls.__new__(cls)
        self._init_handle(conn, path, device, cache_metadata, *more)
        return self

    # ------------------------------------------------------------------ identity
    def __repr__(self) -> str:
        name = self._repr_name
        ident = f"td_id={self.td_id!r}, prefix={self.prefix!r}"
        if self._conn.closed:
            return f"{name}({ident}, closed)"
        try:
            layout = self._layout()
        except Exception as err:  # noqa: BLE001 - repr must not raise
            return f"{name}({ident}, <{type(err).__name__}>)"
        fields = ", ".join(f"{p[-1]}: {self._repr_field(meta, layout)}" for p, meta in self._children(layout, self._path))
        return f"{name}({ident}, {self._repr_details()}, fields={{{fields}}})"

    def _repr_field(self, meta: Entry, layout: _backend.Layout) -> str:
        if self._class_of(meta) is torch.Tensor:
            return f"{meta.dtype}{list(meta.shape) if meta.shape is not None else ' ragged'}"
        return f"{self._repr_name}{self._node_batch_size(meta, layout)}" if meta.is_node else "NonTensor"

    # ------------------------------------------------------------------ lock
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
        if value:
            self.lock_()
        else:
            self.unlock_()

    def lock_(self) -> Self:
        """Locks the store on the server: every process sees it locked until ``unlock_()``."""
        if self._conn.closed:
            raise self._conn.closed_error()
        self._is_locked = True
        return self  # type: ignore[return-value]

    def unlock_(self) -> Self:
        """Unlocks the store on the server."""
        if self._conn.closed:
            raise self._conn.closed_error()
        self._is_locked = False
        return self  # type: ignore[return-value]

    # ------------------------------------------------------------------ trivial overrides
    def is_contiguous(self) -> bool:
        return False

    def is_shared(self) -> bool:
        return False

    def is_memmap(self) -> bool:
        return False

    def detach_(self) -> Self:
        return self  # type: ignore[return-value]

    def _rename_subtds(self, names: Sequence[str | None] | None) -> None:
        return None

    # ------------------------------------------------------------------ keys
    def keys(
        self, include_nested: bool = False, leaves_only: bool = False, is_leaf: Callable[[type], bool] | None = None, *, sort: bool = False
    ) -> StoreKeysView:
        return StoreKeysView(self, include_nested, leaves_only, is_leaf, sort)  # type: ignore[arg-type]

    def _key_list(
        self, include_nested: bool, leaves_only: bool, is_leaf: Callable[[type], bool] | None
    ) -> list[str | tuple[str, ...]]:
        layout = self._fresh_layout()
        n = len(self._path)
        items = self._descendants(layout, self._path) if include_nested else self._children(layout, self._path)
        out = []
        for path, meta in items:
            if leaves_only and meta.is_node:
                continue
            cls = self._class_of(meta)
            if leaves_only and cls is not torch.Tensor:
                # a non-tensor entry: a leaf when is_leaf says so (none given: _nontensors_are_leaves)
                if not (self._nontensors_are_leaves if is_leaf is None else is_leaf(cls)):
                    continue
            rel = path[n:]
            out.append(rel[0] if len(rel) == 1 else rel)
        return out

    def _entry_or_default(self, path: tuple[str, ...], default: object) -> Entry | None:
        """The registry metadata of ``path``; for a missing entry, None when a ``default`` is
        given (the caller returns it), else the KeyError that names the store's keys."""
        meta = self._entry(path)
        if meta is None:
            self._check_not_through_leaf(path)
            if is_no_default(default):
                raise self._key_error(path)
        return meta

    def _check_not_through_leaf(self, path: tuple[str, ...]) -> None:
        """For a missing ``path``: raises ``KeyThroughLeafError`` when a key on the way to it
        is a leaf (``get(("x", "sub"))`` with ``x`` a tensor), default or not, as TensorDict's
        ``_get_tuple`` does (``TensorDictBase.get`` returns a default passed to it instead).
        Runs on the miss path only, on the cached layout (no round trip)."""
        entries = self._layout().entries
        for end in range(len(self._path) + 1, len(path)):
            meta = entries.get(path[:end])
            if meta is not None and not meta.is_node:
                kind = "non-tensor entry" if meta.is_non_tensor else "Tensor"
                raise KeyThroughLeafError(
                    f"{path[end - 1]!r} is a {kind}, not a tensordict, so it has no entry {path[end]!r} "
                    f"(key {path[len(self._path):]!r} of {self._where()})"
                )

    def entry_class(self, key: NestedKey) -> type:
        path = self._path + _as_path(key)
        meta = self._entry(path)
        if meta is None:
            raise self._key_error(path)
        return self._class_of(meta)

    # ------------------------------------------------------------------ rename
    def _check_rename(self, layout: _backend.Layout, old: tuple[str, ...], new: tuple[str, ...], safe: bool) -> None:
        """What ``rename_key_`` checks before planning: ``old`` exists, and with ``safe`` ``new`` does not."""
        if old not in layout.entries:
            raise self._key_error(old)
        if new in layout.entries and safe:
            raise KeyError(f"key {new!r} already present in {self._where()}")

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Closes the connection; the data stays on the server. Idempotent."""
        self._conn.close()

    def __enter__(self) -> Self:
        return self  # type: ignore[return-value]

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __eq__(self, other: object) -> TensorDictBase:  # type: ignore[override]
        return self.to_tensordict() == other

    def __ne__(self, other: object) -> TensorDictBase:  # type: ignore[override]
        return self.to_tensordict() != other


def snapshot_of(value: _T) -> _T | TensorDictBase:
    """``value``, or, for a store handle (dense or lazy), its in-memory snapshot
    (``to_tensordict()``: one atomic read). A store given as a value to write, an operand or
    a stack member is read once, whole, rather than entry by entry."""
    return value.to_tensordict() if isinstance(value, StoreHandle) else value
