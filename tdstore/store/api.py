"""The store's constructors, lifecycle and whole-store methods (a mixin of TensorDictStore).

Kept apart from ``store/core.py`` so that each module stays small: this one holds what a
TensorDict user calls on the store as a whole (``from_*``, ``update``, ``pop``,
``rename_key_``, ``clone``, ``clear_redis``, pickling), ``core.py`` the per-entry
semantics, ``writes.py`` the whole-entry writes and ``handle.py`` what the lazy store shares.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict, TensorDictBase
from tensordict.utils import is_tensorclass

from tdstore._backend import ops as _backend
from tdstore._backend.connect import ConnectSpec
from tdstore._core import chunks as _chunks
from tdstore._core import codec as _codec
from tdstore._core import values as _values
from tdstore._core.keys import new_td_id
from tdstore._core.layout import Entry
from tdstore._core.planner import rename_ops as _rename_ops
from tdstore._core.values import is_no_default
from tdstore.base.handle import snapshot_of
from tdstore.base.host import DenseBase
from tdstore.errors import (
    SchemaError,
)
from tdstore.lazy.core import LazyStackedTensorDictStore
from tdstore.store.writes import planner_for

if TYPE_CHECKING:
    from typing_extensions import Self


__all__ = ["StoreAPI"]

_MISSING = object()


from tdstore._core.keys import as_path as _as_path  # noqa: E402


class StoreAPI(DenseBase):
    """Whole-store methods of :class:`~tdstore.TensorDictStore`."""

    #: the meta hash of a store this handle cleared, to recreate it on the next write
    _cleared_meta: dict[str, str] | None

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_dict(
        cls,
        input_dict: Any,
        *,
        backend: str = "redis",
        host: str = "localhost",
        port: int = 6379,
        db: int = 0,
        unix_socket_path: str | None = None,
        prefix: str = "tensordict",
        auto_batch_size: bool = False,
        batch_size: Sequence[int] | torch.Size | None = None,
        device: Any = None,
        batch_dims: int | None = None,
        names: Sequence[str | None] | None = None,
        **kwargs: Any,
    ) -> Self:
        """Creates a store from a dict or TensorDict, in one atomic upload.

        Examples:
            >>> import torch
            >>> from tdstore import TensorDictStore
            >>> store = TensorDictStore.from_dict({"a": torch.zeros(5, 3)}, batch_size=[5])
            >>> store.batch_size
            torch.Size([5])
            >>> store.clear_redis()
            >>> store.close()
        """
        if batch_size is not None and batch_dims is not None:
            raise ValueError("batch_size and batch_dims are exclusive")
        if isinstance(input_dict, TensorDictBase) and batch_size is None and batch_dims is None and not auto_batch_size:
            td = input_dict
        else:
            td = TensorDict.from_dict(
                input_dict,
                batch_size=batch_size,
                auto_batch_size=auto_batch_size or batch_dims is not None,
                batch_dims=batch_dims,
            )
        if names is not None:
            td = td.clone(False)
            td.names = list(names)
        connect = ConnectSpec.take(kwargs, host=host, port=port, db=db, unix_socket_path=unix_socket_path, prefix=prefix)
        return cls.from_tensordict(td, backend=backend, device=device, _connect=connect, **kwargs)

    @classmethod
    def from_tensordict(
        cls,
        td: TensorDictBase,
        *,
        backend: str = "redis",
        host: str = "localhost",
        port: int = 6379,
        db: int = 0,
        unix_socket_path: str | None = None,
        prefix: str = "tensordict",
        device: Any = None,
        **kwargs: Any,
    ) -> Self:
        """Uploads a TensorDict (or tensorclass) to a new store: every leaf in one atomic step.

        Examples:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> from tdstore import TensorDictStore
            >>> local = TensorDict({"obs": torch.randn(10, 84)}, [10])
            >>> remote = TensorDictStore.from_tensordict(local)
            >>> remote["obs"].shape
            torch.Size([10, 84])
            >>> remote.clear_redis()
            >>> remote.close()
        """
        tensorclass = None
        if is_tensorclass(td) and not isinstance(td, (NonTensorData, NonTensorStack)):
            tensorclass = f"{type(td).__module__}.{type(td).__qualname__}"
            td = td._tensordict
        td = snapshot_of(td)
        connect = ConnectSpec.take(kwargs, host=host, port=port, db=db, unix_socket_path=unix_socket_path, prefix=prefix)
        if isinstance(td, LazyStackedTensorDict):
            # entries of different shapes (ragged leaves) are kept as they are
            return LazyStackedTensorDictStore.from_lazy_stack(  # type: ignore[return-value]
                td, backend=backend, device=device, _connect=connect, **kwargs
            )
        if not isinstance(td, TensorDictBase):
            raise TypeError(f"from_tensordict expects a TensorDictBase, got {type(td).__name__}")
        if isinstance(td, cls):
            td = td.to_tensordict()
        store_device = torch.device(device) if device is not None else td.device
        store = cls(
            backend=backend, batch_size=td.batch_size, device=store_device, _create=False, _connect=connect, **kwargs
        )
        try:
            planner = _planner(store, _backend.Layout(0, {"batch_size": json.dumps(list(td.batch_size)), **store._creation_meta()}, {}))
            for key, value in td.items():
                planner.add(_as_path(key), store._prepare_value(_as_path(key), value, td.batch_size))
            names = td.names if td._has_names() else None
            store._create_store(td.batch_size, store_device, names, planner.ops, tensorclass)
        except BaseException:
            store.close()
            raise
        return store

    @classmethod
    def from_schema(
        cls,
        schema: Mapping[Any, tuple[Sequence[int] | torch.Size, torch.dtype]],
        *,
        batch_size: Sequence[int] | torch.Size | None = None,
        backend: str = "redis",
        host: str = "localhost",
        port: int = 6379,
        db: int = 0,
        unix_socket_path: str | None = None,
        prefix: str = "tensordict",
        device: Any = None,
        **kwargs: Any,
    ) -> Self:
        """Creates a store of zero-filled entries, allocated on the server; no tensor bytes are sent.

        The whole schema is checked before anything is written, and the store, its
        registry and every zero-filled entry appear in one atomic step.

        Examples:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> from tdstore import TensorDictStore
            >>> store = TensorDictStore.from_schema(
            ...     {"obs": ([84, 84, 3], torch.uint8),
            ...      "action": ([4], torch.float32),
            ...      "reward": ([], torch.float32)},
            ...     batch_size=[1000],
            ... )
            >>> store["obs"].shape
            torch.Size([1000, 84, 84, 3])
            >>> store[0] = TensorDict(
            ...     obs=torch.ones(84, 84, 3, dtype=torch.uint8),
            ...     action=torch.ones(4),
            ...     reward=torch.ones(()),
            ...     batch_size=[],
            ... )
            >>> store["action"][:2]
            tensor([[1., 1., 1., 1.],
                    [0., 0., 0., 0.]])
            >>> store.clear_redis()
            >>> store.close()
        """
        bs = _check_batch_size(batch_size if batch_size is not None else [])
        if not isinstance(schema, Mapping):
            raise SchemaError(f"schema must be a mapping of key -> (shape, dtype), got {type(schema).__name__}")
        entries: list[tuple[tuple[str, ...], list[int], torch.dtype]] = []
        for key, spec in schema.items():
            try:
                path = _as_path(key)
            except TypeError as err:
                raise SchemaError(f"schema key {key!r}: {err}") from None
            if not isinstance(spec, (tuple, list)) or len(spec) != 2:
                raise SchemaError(f"schema entry {key!r} must be (shape, dtype), got {spec!r}")
            shape, dtype = spec
            if not isinstance(dtype, torch.dtype):
                raise SchemaError(f"schema entry {key!r}: dtype must be a torch.dtype, got {dtype!r}")
            try:
                _codec.dtype_name(dtype)
            except TypeError as err:
                raise SchemaError(f"schema entry {key!r}: {err}") from None
            try:
                shape = list(shape)
            except TypeError:
                raise SchemaError(f"schema entry {key!r}: shape must be a sequence of ints, got {shape!r}") from None
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                raise SchemaError(f"schema entry {key!r}: shape must hold non-negative ints, got {shape!r}")
            entries.append((path, shape, dtype))
        paths = [p for p, _, _ in entries]
        for p in paths:
            for q in paths:
                if len(q) > len(p) and q[: len(p)] == p:
                    raise SchemaError(f"schema key {p!r} is both an entry and the parent of {q!r}")
        if len(set(paths)) != len(paths):
            raise SchemaError("schema has duplicate keys")
        store_device = torch.device(device) if device is not None else None
        connect = ConnectSpec.take(kwargs, host=host, port=port, db=db, unix_socket_path=unix_socket_path, prefix=prefix)
        store = cls(backend=backend, batch_size=bs, device=store_device, _create=False, _connect=connect, **kwargs)
        try:
            ops: list[_backend.Op] = []
            seq = 0
            nodes: set[tuple[str, ...]] = set()
            for path, shape, dtype in entries:
                for i in range(1, len(path)):
                    if path[:i] not in nodes:
                        nodes.add(path[:i])
                        seq += 1
                        ops.append(_backend.Op("node", path[:i], _values.node_meta(bs, None, [1, seq])))
                full = list(bs) + shape
                nbytes = math.prod(full) * _codec.tensor_nbytes((), dtype)
                store._conn_max_bulk()  # sets up the connection: proto-max-bulk-len is known
                seq += 1
                meta = _chunks.annotate(Entry.tensor(_codec.dtype_name(dtype), full, (1, seq)), store._creation_meta())
                # zero-filled on the server: no command carries the bytes
                store._conn.check_entry_size(path, nbytes, store._where(), "schema entry", chunk=meta.chunk, sent=False)
                ops.append(_backend.Op("zero", path, meta, nbytes=nbytes))
            store._create_store(bs, store_device, None, ops, None)
        except BaseException:
            store.close()
            raise
        return store

    @classmethod
    def from_store(
        cls,
        *,
        backend: str = "redis",
        host: str = "localhost",
        port: int = 6379,
        db: int = 0,
        unix_socket_path: str | None = None,
        prefix: str = "tensordict",
        td_id: str,
        device: Any = None,
        tensorclass_cls: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Connects to an existing store by its ``td_id``; reads batch size, device and tensorclass."""
        if kwargs.get("expire") is not None:
            raise TypeError(
                f"from_store(td_id={td_id!r}) connects to an existing store and takes no expire=; "
                "call .expire(seconds) on the store it returns to set its lifetime"
            )
        connect = ConnectSpec.take(kwargs, host=host, port=port, db=db, unix_socket_path=unix_socket_path, prefix=prefix)
        store = cls(backend=backend, td_id=td_id, device=device, _create=False, _connect=connect, **kwargs)
        try:
            layout = store._layout(refresh=True)
        except BaseException:
            store.close()
            raise
        if tensorclass_cls is None:
            tensorclass_cls = layout.meta.get("tensorclass") or None
        if isinstance(tensorclass_cls, str):
            try:
                tensorclass_cls = _import_class(tensorclass_cls, store._where())
            except ImportError:
                store.close()
                raise
        if isinstance(tensorclass_cls, type) and issubclass(tensorclass_cls, cls):
            return store
        if tensorclass_cls is not None:
            return tensorclass_cls._from_tensordict(store)
        return store

    def _conn_max_bulk(self) -> int:
        self._conn.run(_noop)
        return self._conn.max_bulk

    # ------------------------------------------------------------------ whole-store writes
    def update(
        self,
        input_dict_or_td: Any = None,
        clone: bool = False,
        inplace: bool = False,
        *,
        non_blocking: bool = False,
        keys_to_update: Sequence[Any] | None = None,
        is_leaf: Any = None,
        update_batch_size: bool = False,
        ignore_lock: bool = False,
        **kwargs: Any,
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
        input_dict_or_td: Any = None,
        clone: bool = False,
        *,
        non_blocking: bool = False,
        keys_to_update: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> Self:
        """Writes into existing entries (shapes checked, dtypes cast), in one atomic step."""
        if input_dict_or_td is None:
            input_dict_or_td = kwargs
        items = _leaf_items(self, input_dict_or_td, keys_to_update)
        if items:
            self._write(items, inplace=True)
        return self

    def del_(self, key: Any) -> Self:
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

    def _del(self, key: Any) -> None:
        self.del_(key)

    def __delitem__(self, key: Any) -> None:
        self.del_(key)

    def rename_key_(self, old_key: Any, new_key: Any, safe: bool = False) -> Self:
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

    def pop(self, key: Any, default: Any = _MISSING, *args: Any) -> Any:
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

    def empty(self, recurse: bool = False, *, batch_size: Any = None, device: Any = None, names: Any = None) -> TensorDictBase:
        """An empty in-memory ``TensorDict`` with this store's batch size, device and names.

        The results of ``apply``, arithmetic (``store + 1``) and the other methods that
        build a new tensordict are filled into it, so they are in-memory ``TensorDict``
        objects: nothing is created on the server behind the user's back. Use
        ``clone()`` for a copy on the server.
        """
        from tensordict import TensorDict as _TD

        if is_no_default(device) or device is None:
            device = self.device
        if is_no_default(names):
            names = None
        if is_no_default(batch_size) or batch_size is None:
            batch_size = self.batch_size
        if names is None and batch_size == self.batch_size and self._has_names():
            names = self.names
        out = _TD(batch_size=batch_size, device=device, names=names)
        if recurse:
            layout = self._layout()
            n = len(self._path)
            for path, meta in self._descendants(layout, self._path):
                if meta.is_node:
                    out._set_tuple(path[n:], _TD(batch_size=meta.batch_size, device=device), inplace=False, validated=True, non_blocking=False)
        return out

    def _sibling_from(self, td: TensorDictBase, *, device: Any = None, names: Any = None) -> Self:
        cls = type(self)
        conn = self._conn.sibling(new_td_id())
        store = cls._handle(conn, (), torch.device(device) if device is not None else None, self._cache_metadata, self._backend_label)
        planner = _planner(store, _backend.Layout(0, {"batch_size": json.dumps(list(td.batch_size))}, {}))
        for key, value in td.items():
            planner.add(_as_path(key), store._prepare_value(_as_path(key), value, td.batch_size))
        store._create_store(td.batch_size, store._device_override, names, planner.ops, None)
        return store

    def _clone(self, recurse: bool = True, **kwargs: Any) -> Self:
        """``clone()``: a new store (new td_id) holding a copy; ``recurse=False``: a new handle."""
        if not recurse:
            return type(self)._handle(self._conn, self._path, self._device_override, self._cache_metadata, self._backend_label)
        td = self.to_tensordict()
        return self._sibling_from(td, device=self._device_override, names=td.names if td._has_names() else None)

    def clone(self, recurse: bool = True, **kwargs: Any) -> Self:
        return self._clone(recurse, **kwargs)

    def copy(self) -> Self:
        return self._clone(False)

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """``to(device)`` gives a handle that reads onto ``device``; other casts give a TensorDict."""
        device = kwargs.pop("device", None)
        rest = []
        for arg in args:
            if isinstance(arg, (str, torch.device, int)) and device is None and not isinstance(arg, bool):
                device = torch.device(arg)
            else:
                rest.append(arg)
        if rest or kwargs:
            return self.to_tensordict().to(*rest, **({"device": device} if device is not None else {}), **kwargs)
        if device is None:
            return self
        return type(self)._handle(self._conn, self._path, torch.device(device), self._cache_metadata, self._backend_label)

    def flatten_keys(self, separator: str = ".", inplace: bool = False, is_leaf: Any = None) -> TensorDictBase:
        """An in-memory copy with nested keys joined by ``separator`` (read with to_tensordict())."""
        if inplace:
            raise ValueError(
                "flatten_keys(inplace=True) is not supported on a TensorDictStore; "
                "use store.to_tensordict().flatten_keys(...)"
            )
        return self.to_tensordict().flatten_keys(separator, is_leaf=is_leaf)

    def unflatten_keys(self, separator: str = ".", inplace: bool = False, is_leaf: Any = None) -> TensorDictBase:
        """An in-memory copy with keys split on ``separator`` into nested ones."""
        if inplace:
            raise ValueError(
                "unflatten_keys(inplace=True) is not supported on a TensorDictStore; "
                "use store.to_tensordict().unflatten_keys(...)"
            )
        return self.to_tensordict().unflatten_keys(separator)

    # ------------------------------------------------------------------ lifecycle
    def clear_redis(self) -> None:
        """Deletes every key of this store from the server in one atomic step.

        The handle stays open; a later write recreates the store with the same batch
        size, device and names.
        """
        meta = self._clear_store()
        if meta is not None:
            self._cleared_meta = {str(k): str(v) for k, v in meta.items()}

    def __getstate__(self) -> dict[str, Any]:
        return {
            "conn": self._conn.pickle_state(),
            "path": self._path,
            "device": self._device_override,
            "cache_metadata": self._cache_metadata,
            "backend": self._backend_label,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        from tdstore._backend.connection import Connection

        conn = Connection.from_pickle_state(state["conn"])
        self._init_handle(conn, state["path"], state["device"], state["cache_metadata"], state["backend"])

    def __reduce__(self) -> Any:
        return (_unpickle, (type(self), self.__getstate__()))


def _unpickle(cls: Any, state: dict[str, Any]) -> Any:
    self = cls.__new__(cls)
    self.__setstate__(state)
    return self


async def _noop(client: Any) -> None:
    return None


def _planner(store: Any, layout: _backend.Layout) -> Any:
    store._conn.run(_noop)  # sets up the connection: proto-max-bulk-len is known
    return planner_for(store, layout, inplace=False)


def _check_batch_size(batch_size: Any) -> torch.Size:
    try:
        bs = torch.Size(batch_size)
    except (TypeError, ValueError):
        raise SchemaError(f"batch_size must be a sequence of non-negative ints, got {batch_size!r}") from None
    if any(d < 0 for d in bs):
        raise SchemaError(f"batch_size must hold non-negative ints, got {list(bs)}")
    return bs


def _import_class(path: str, where: str = "the store") -> type:
    module_name, _, name = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
        obj: Any = module
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj
    except (ImportError, AttributeError, ValueError) as err:
        raise ImportError(
            f"{where} was written from the tensorclass {path!r}, which cannot be imported here "
            f"({err}); make its module importable, or pass tensorclass_cls=TensorDictStore to "
            "from_store to get the plain store"
        ) from err


def _leaf_items(store: Any, source: Any, keys_to_update: Sequence[Any] | None) -> dict[tuple[str, ...], Any]:
    """Flattens a dict or TensorDict into leaf paths (nested tensordicts merge, as update does)."""
    if is_tensorclass(source) and not isinstance(source, (NonTensorData, NonTensorStack)):
        source = source._tensordict
    if source is store:
        return {}
    if isinstance(source, type(store)):
        source = source.to_tensordict()
    allowed = None if keys_to_update is None else {_as_path(k) for k in keys_to_update}
    out: dict[tuple[str, ...], Any] = {}

    def visit(prefix: tuple[str, ...], value: Any) -> None:
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
