"""LazyStackedTensorDictStore: a ``LazyStackedTensorDict`` whose elements live on a server.

A lazy stack keeps ``N`` tensordicts ("elements") side by side along ``stack_dim``; their
entries may differ in shape (ragged leaves). The store keeps them under one store id,
with the meta hash, registry, write version and data keys of :class:`~tdstore.TensorDictStore`
(layout in :mod:`tdstore.lazy.plan`), so the same rules hold:

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
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from tensordict import LazyStackedTensorDict, NonTensorStack, TensorDict, TensorDictBase

from tdstore._backend import ops as _backend
from tdstore._backend.connect import ConnectSpec
from tdstore._core.keys import new_td_id
from tdstore._core.layout import Entry
from tdstore._core.values import is_dims, is_no_default
from tdstore.base.compat import StoreCompat014
from tdstore.base.handle import StoreHandle, entries_below
from tdstore.base.unsupported import StoreUnsupported, install, refuse
from tdstore.errors import (
    CorruptMetadataError,
    EntryNotFoundError,
    SchemaError,
    StoreExistsError,
    StoreNotFoundError,
    UnsupportedOperationError,
)
from tdstore.lazy import plan
from tdstore.lazy.reads import LazyReads
from tdstore.lazy.writes import LazyWrites

if TYPE_CHECKING:
    from tensordict.utils import DeviceType
    from typing_extensions import TypedDict

    from tdstore._backend.connection import Connection
    from tdstore._backend.protocols import AsyncClient

    class _PickleState(TypedDict):
        conn: dict[str, object]
        path: tuple[str, ...]
        device: torch.device | None
        cache_metadata: bool

__all__ = ["LazyStackedTensorDictStore"]


class LazyStackedTensorDictStore(StoreHandle, LazyReads, LazyWrites, TensorDictBase):
    """A lazy stack of tensordicts kept on a Redis-wire server; elements may differ in shape.

    Create one with :meth:`from_lazy_stack` (or ``TensorDictStore.from_tensordict`` of a
    ``LazyStackedTensorDict``), reconnect with :meth:`from_store`. See ``docs/lazy.md``.
    """

    _td_dim_names = None
    _nontensors_are_leaves = False  # as TensorDict: non-tensor values are leaves only for an is_leaf that says so

    def __init__(self, *, td_id: str, **kwargs: Any) -> None:
        """Connects to the lazy store ``td_id`` (same connection arguments as ``TensorDictStore``)."""
        device = kwargs.pop("device", None)
        cache_metadata = kwargs.pop("cache_metadata", True)
        kwargs.pop("chunk_bytes", None)  # a dense store's chunking, read from the server; a lazy one has none
        conn = _open(td_id, kwargs)
        self._init_handle(conn, (), torch.device(device) if device is not None else None, cache_metadata)
        try:
            self._layout(refresh=True)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_lazy_stack(cls, td: LazyStackedTensorDict, *, td_id: str | None = None, device: DeviceType | None = None, **kwargs: Any) -> LazyStackedTensorDictStore:
        """Uploads a ``LazyStackedTensorDict`` to a new store, every element in one atomic step.

        Keyword arguments are those of ``TensorDictStore`` (``host``, ``port``,
        ``unix_socket_path``, ``prefix``, ``client``, ...).
        """
        if not isinstance(td, LazyStackedTensorDict):
            raise TypeError(
                f"from_lazy_stack expects a LazyStackedTensorDict, got {type(td).__name__}; "
                "use TensorDictStore.from_tensordict for other tensordicts"
            )
        cache_metadata = kwargs.pop("cache_metadata", True)
        if kwargs.pop("chunk_bytes", None) is not None:
            from tdstore.errors import UnsupportedOperationError

            raise UnsupportedOperationError(
                "a LazyStackedTensorDictStore keeps one string per leaf and takes no chunk_bytes; stack the "
                "elements (torch.stack) into a TensorDictStore to chunk them (see docs/chunked.md)"
            )
        conn = _open(td_id if td_id is not None else new_td_id(), kwargs)
        store_device = torch.device(device) if device is not None else td.device
        self = cls._handle(conn, (), None, cache_metadata)
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
    def from_dict(cls, *args: object, **kwargs: object) -> NoReturn:
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
    _repr_name = "LazyStackedTensorDictStore"

    # read-only names that tensordict.store's lazy store has, for code written against it
    @property
    def _td_id(self) -> str:
        return self._conn.keys.td_id

    @property
    def _stack_dim(self) -> int:
        return self.stack_dim

    @property
    def _count(self) -> int:
        """The number of stacked elements."""
        return int(self.batch_size[self.stack_dim])

    def _repr_details(self) -> str:
        return f"batch_size={list(self.batch_size)}, stack_dim={self.stack_dim}, count={self.batch_size[self.stack_dim]}"

    def _node_batch_size(self, meta: Entry, layout: _backend.Layout) -> list[int]:
        """The batch size of the nested lazy stack whose registry metadata is ``meta`` (its elements' and the stack dim)."""
        return list(self._full_bs(torch.Size(meta.batch_size or ()), layout))

    # ------------------------------------------------------------------ layout
    def _check_layout(self, layout: _backend.Layout) -> None:
        where = self._where()
        self._check_store_meta(layout, f"lazy store {where}")
        if layout.meta.get("kind") != plan.KIND:
            raise UnsupportedOperationError(
                f"store {where} is a TensorDictStore, not a lazy stack; connect with "
                "TensorDictStore.from_store(td_id=...)"
            )
        try:
            bs = json.loads(layout.meta.get("batch_size", ""))
            s = int(layout.meta.get("stack_dim", ""))
        except (ValueError, RecursionError):
            raise CorruptMetadataError(f"lazy store {where} has a malformed batch size or stack dim") from None
        if not is_dims(bs) or not 0 <= s < len(bs):
            raise CorruptMetadataError(f"lazy store {where} has batch size {bs!r} and stack dim {s!r}")
        n = bs[s]
        for path, meta in layout.entries.items():
            plan.check_lazy_meta(path, meta, n, where)

    def _not_found(self) -> StoreNotFoundError:
        return StoreNotFoundError(
            f"No LazyStackedTensorDictStore with td_id={self.td_id!r} found under prefix {self.prefix!r} on "
            f"{self._conn.describe()} (deleted with clear_redis(), or a wrong td_id/prefix/db?)"
        )

    def _children(
        self, layout: _backend.Layout, path: tuple[str, ...] | None = None
    ) -> list[tuple[tuple[str, ...], Entry]]:
        return entries_below(layout, self._path if path is None else path, children=True)

    def _descendants(self, layout: _backend.Layout, path: tuple[str, ...] | None = None) -> list[tuple[tuple[str, ...], Entry]]:
        return entries_below(layout, self._path if path is None else path)

    def _root(self, layout: _backend.Layout) -> tuple[torch.Size, int]:
        """The full batch size of the whole stack and its stack dim."""
        memo = layout.memo.get("lazy-root")
        if memo is None:
            memo = layout.memo["lazy-root"] = (
                torch.Size(layout.batch_size), int(layout.meta["stack_dim"])
            )
        return memo

    def _elem_bs(self, layout: _backend.Layout, path: tuple[str, ...] | None = None) -> torch.Size:
        """The elements' batch size of the node at ``path`` (default: this handle)."""
        path = self._path if path is None else path
        bs, s = self._root(layout)
        if not path:
            return bs[:s] + bs[s + 1 :]
        node = layout.entries.get(path)
        if node is None or not node.is_node:
            raise EntryNotFoundError(f"nested key {path!r} no longer exists in {self._where()}")
        return torch.Size(node.batch_size or ())

    def _full_bs(self, elem_bs: torch.Size, layout: _backend.Layout) -> torch.Size:
        bs, s = self._root(layout)
        return elem_bs[:s] + torch.Size([bs[s]]) + elem_bs[s:]

    # ------------------------------------------------------------------ properties
    @property
    def batch_size(self) -> torch.Size:
        layout = self._layout()
        return self._full_bs(self._elem_bs(layout), layout)

    @batch_size.setter
    def batch_size(self, value: torch.Size) -> None:
        raise UnsupportedOperationError(f"the batch size of the lazy store {self._where()} cannot be changed")

    def _change_batch_size(self, new_size: torch.Size) -> None:
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
    def device(self, value: DeviceType) -> None:
        raise RuntimeError("the device of a LazyStackedTensorDictStore cannot be set")

    def _has_names(self) -> bool:
        return False

    def _erase_names(self) -> None:
        return None

    def _set_names(self, names: Sequence[str | None] | None) -> None:
        raise UnsupportedOperationError(f"dimension names are not supported on the lazy store {self._where()}")

    @property
    def names(self) -> list[None]:  # type: ignore[override]
        return [None] * self.batch_dims

    # ------------------------------------------------------------------ keys
    def _class_of(self, meta: Entry) -> type:
        """The class the entry of registry metadata ``meta`` reads as (``entry_class``)."""
        return {"td": LazyStackedTensorDictStore, "lnt": NonTensorStack}.get(meta.kind, torch.Tensor)

    # ------------------------------------------------------------------ whole-store
    def _clone(self, recurse: bool = True, **kwargs: object) -> LazyStackedTensorDictStore:
        if not recurse:
            return type(self)._handle(self._conn, self._path, self._device_override, self._cache_metadata)
        td = self.to_tensordict()
        conn = self._conn.sibling(new_td_id())
        store = type(self)._handle(conn, (), self._device_override, self._cache_metadata)
        store._create(td, self.device)
        return store

    def clone(self, recurse: bool = True, **kwargs: object) -> LazyStackedTensorDictStore:
        """A new lazy store (new td_id) holding a copy; ``recurse=False``: a new handle."""
        return self._clone(recurse)

    def copy(self) -> LazyStackedTensorDictStore:
        return self._clone(False)

    def clear_redis(self) -> None:
        """Deletes every key of this store from the server in one atomic step."""
        meta = self._clear_store()
        if meta is not None:
            self._cleared_meta = {k: v for k, v in meta.items() if k not in _backend.SCRIPT_META_FIELDS}

    def _ensure_exists(self) -> None:
        """After clear_redis() on this handle, the next write recreates the stack, with no keys."""
        meta, self._cleared_meta = self._cleared_meta, None
        if meta is None or self._path:
            return
        conn = self._conn
        try:
            conn.run(
                lambda c: _backend.commit(
                    c, conn.keys, conn.runner, [], expected="new", bump=True, check_lock=False, meta_updates=meta
                )
            )
        except StoreExistsError:
            pass
        conn.layout = None

    def __reduce__(
        self,
    ) -> tuple[
        Callable[[type[LazyStackedTensorDictStore], _PickleState], LazyStackedTensorDictStore],
        tuple[type[LazyStackedTensorDictStore], _PickleState],
    ]:
        state: _PickleState = {
            "conn": self._conn.pickle_state(),
            "path": self._path,
            "device": self._device_override,
            "cache_metadata": self._cache_metadata,
        }
        return (_unpickle, (type(self), state))

    def empty(self, recurse: bool = False, *, batch_size: Sequence[int] | None = None, device: DeviceType | None = None, names: Sequence[str | None] | None = None) -> TensorDictBase:
        """An empty in-memory ``TensorDict`` of this store's batch size."""
        bs = self.batch_size if batch_size is None or is_no_default(batch_size) else batch_size
        dev = self.device if device is None or is_no_default(device) else device
        return TensorDict(batch_size=bs, device=dev)


# the methods of TensorDictBase that raise on a store, and (on tensordict 0.14) the 0.15 behaviour
install(LazyStackedTensorDictStore, StoreUnsupported, StoreCompat014)

for _name in ("select", "exclude", "apply", "named_apply", "to_dict", "numpy", "flatten_keys", "unflatten_keys", "unbind"):
    def _delegate(self: TensorDictBase, *args: object, _name: str = _name, **kwargs: object) -> object:
        return getattr(self.to_tensordict(), _name)(*args, **kwargs)

    _delegate.__name__ = _name
    _delegate.__doc__ = f"``{_name}`` of the stack read into memory (``to_tensordict().{_name}(...)``)."
    setattr(LazyStackedTensorDictStore, _name, _delegate)

refuse(
    LazyStackedTensorDictStore,
    ("fill_", "copy_", "update_", "update_at_", "_stack_onto_", "where", "masked_select", "set_non_tensor", "batch_size_"),
    lambda name: f"Write elements with store[j] = td, whole keys with store[key] = value, or call "
    f"store.to_tensordict().{name}(...) on an in-memory copy",
    why="is not supported",
)


def _unpickle(cls: type[LazyStackedTensorDictStore], state: _PickleState) -> LazyStackedTensorDictStore:
    from tdstore._backend.connection import Connection

    self = cls.__new__(cls)
    self._init_handle(Connection.from_pickle_state(state["conn"]), state["path"], state["device"], state["cache_metadata"])
    return self


async def _noop(client: AsyncClient) -> None:
    return None


#: Keywords of ``TensorDictStore`` about creating a dense store: a lazy store takes them
#: (code written for either class may pass them) and has no use for them.
_DENSE_ONLY = ("backend", "batch_size", "names", "expire", "_create")


def _open(td_id: str, kwargs: dict[str, object]) -> Connection:
    """The connection of a lazy store handle, from the connection keywords of ``TensorDictStore``."""
    for name in _DENSE_ONLY:
        kwargs.pop(name, None)
    connect = ConnectSpec.take(kwargs)
    return connect.with_redis_kwargs(kwargs).open(td_id)
