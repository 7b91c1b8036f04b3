"""What the mixins of the store classes need of the class they are mixed into.

``TensorDictStore`` derives from ``StoreHandle`` (:mod:`tdstore.base.handle`, with its layout
cache), ``StoreWrites`` and ``StoreReads``, and ``LazyStackedTensorDictStore`` from
``StoreHandle``, ``LazyReads`` and ``LazyWrites``; the ring buffer and the lifetime are modules
that take a store (:mod:`tdstore.store.ring`, :mod:`tdstore.store.lifetime`), and the refused and
compatibility methods are tables installed on both classes (:func:`tdstore.base.unsupported.install`).
A mixin calls methods and reads attributes that its host defines.
The protocols here declare them, so that the type checker checks each mixin against them instead
of taking every attribute on trust.

At run time the mixins derive from ``object``: the protocols are used only by the type checker
(``if TYPE_CHECKING``), through :data:`DenseBase` and :data:`LazyBase`. The members that come from
``tensordict.TensorDictBase`` (``batch_size``, ``device``, ``to_tensordict``...) are declared too,
loosely typed: tensordict is not followed by the type checker (see ``pyproject.toml``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import torch
    from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase
    from typing_extensions import Self

    from tdstore._backend.connection import Connection
    from tdstore._backend.ops import Layout, Op
    from tdstore._core.layout import Entry
    from tdstore.errors import EntryNotFoundError, StoreNotFoundError

_T = TypeVar("_T")


class StoreHost(Protocol):
    """The members every store handle has (dense and lazy): connection, path, layout cache."""

    _conn: Connection
    _path: tuple[str, ...]
    _device_override: torch.device | None
    _cache_metadata: bool

    @property
    def td_id(self) -> str: ...

    @property
    def prefix(self) -> str: ...

    @property
    def batch_size(self) -> torch.Size: ...

    @property
    def device(self) -> torch.device | None: ...

    @property
    def batch_dims(self) -> int: ...

    def to_tensordict(self, *args: Any, **kwargs: Any) -> TensorDictBase: ...

    def _where(self) -> str: ...

    def _layout(self, refresh: bool = False) -> Layout: ...

    def _fresh_layout(self) -> Layout: ...

    def _check_layout(self, layout: Layout) -> None: ...

    def _not_found(self) -> StoreNotFoundError: ...

    def _key_error(self, path: tuple[str, ...]) -> EntryNotFoundError: ...

    def _entry(self, path: tuple[str, ...]) -> Entry | None: ...

    def _entry_or_default(self, path: tuple[str, ...], default: object) -> Entry | None: ...

    def _check_not_through_leaf(self, path: tuple[str, ...]) -> None: ...

    def _init_handle(
        self, conn: Connection, path: tuple[str, ...], device: torch.device | None, cache_metadata: bool, *more: Any
    ) -> None: ...

    @classmethod
    def _handle(
        cls, conn: Connection, path: tuple[str, ...], device: torch.device | None, cache_metadata: bool, *more: Any
    ) -> Self: ...

    def _key_list(
        self, include_nested: bool, leaves_only: bool, is_leaf: Callable[[type], bool] | None
    ) -> list[str | tuple[str, ...]]: ...

    def _clear_store(self) -> dict[str, str] | None: ...

    def _check_on_cleared(self, check: Callable[[Layout], object]) -> None: ...

    def _replan_if_stale(self, plan: Callable[[Layout], _T], layout: Layout) -> tuple[_T, Layout]: ...

    def _descendants(self, layout: Layout, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], Entry]]: ...

    def _children(self, layout: Layout, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], Entry]]: ...

    def _class_of(self, meta: Entry) -> type: ...

    def _check_rename(self, layout: Layout, old: tuple[str, ...], new: tuple[str, ...], safe: bool) -> None: ...

    def close(self) -> None: ...

    def _repr_details(self) -> str: ...

    def _node_batch_size(self, meta: Entry, layout: Layout) -> list[int]: ...


class DenseHost(StoreHost, Protocol):
    """What the mixins of :class:`~tdstore.TensorDictStore` need beyond :class:`StoreHost`."""

    _backend_label: str

    def __init__(self, **kwargs: Any) -> None: ...

    @staticmethod
    def _descendants(layout: Layout, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], Entry]]: ...

    @property
    def names(self) -> Any: ...

    def _sub(self, path: tuple[str, ...]) -> Self: ...

    def _node(self, layout: Layout | None = None) -> Entry: ...

    def _owner_batch_size(self, layout: Layout, path: tuple[str, ...]) -> torch.Size: ...

    def _has_names(self) -> bool: ...

    def _ensure_exists(self) -> None: ...

    def _creation_meta(self) -> dict[str, str]: ...

    def _prepare_value(
        self, path: tuple[str, ...], value: Any, batch_size: torch.Size | None = None
    ) -> torch.Tensor | TensorDictBase: ...

    def _read_values(self, paths: list[tuple[str, ...]]) -> list[object]: ...

    def _write(self, items: Mapping[tuple[str, ...], object], *, inplace: bool, ignore_lock: bool = False) -> None: ...

    def _commit_planned(
        self,
        plan: Callable[[Layout], tuple[list[Op], dict[str, str] | None]],
        *,
        check_lock: bool,
        bump: bool = True,
        expected_any: bool = False,
    ) -> int: ...

    def _create_store(
        self,
        batch_size: torch.Size,
        device: torch.device | None,
        names: Sequence[str | None] | None,
        ops: list[Op],
        tensorclass: str | None,
    ) -> None: ...


class LazyHost(StoreHost, Protocol):
    """What the mixins of :class:`~tdstore.LazyStackedTensorDictStore` need beyond :class:`StoreHost`."""

    @property
    def stack_dim(self) -> int: ...

    def _root(self, layout: Layout) -> tuple[torch.Size, int]: ...

    def _descendants(
        self, layout: Layout, path: tuple[str, ...] | None = None
    ) -> list[tuple[tuple[str, ...], Entry]]: ...

    def _elem_bs(self, layout: Layout, path: tuple[str, ...] | None = None) -> torch.Size: ...

    def _full_bs(self, elem_bs: torch.Size, layout: Layout) -> torch.Size: ...

    def _shapes(self, layout: Layout, path: tuple[str, ...]) -> list[list[int]]: ...

    def _snapshot(self) -> tuple[LazyStackedTensorDict, Layout, str]: ...

    def _memory_stack(self, paths: list[tuple[str, ...]] | None, members: list[int] | None) -> tuple[list[TensorDict], int]: ...

    def _ensure_exists(self) -> None: ...


if TYPE_CHECKING:
    DenseBase = DenseHost
    LazyBase = LazyHost
    SharedBase = StoreHost
else:
    DenseBase = LazyBase = SharedBase = object
