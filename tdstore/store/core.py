"""TensorDictStore: a TensorDict whose entries live on a Redis-wire server.

The class itself: its constructors (``__init__``, ``from_dict``, ``from_tensordict``,
``from_schema``, ``from_store``; the work behind them in :mod:`tdstore.store.create`), its
lifecycle (``clear_redis``, pickling), the per-entry semantics, and the documented delegators
of the ring buffer and the lifetime. Its bases are the shared handle,
:class:`~tdstore.store.writes.StoreWrites` and :class:`~tdstore.store.reads.StoreReads`.

All TensorDict semantics live in these modules; every server operation is in :mod:`tdstore._backend.ops`.
The consistency rules (see ``docs/guarantees.md``):

* one logical operation is one atomic server step (the ``commit`` and ``write_runs``
  scripts, or one MULTI/EXEC for reads);
* every layout change bumps a store-wide layout version in the same step; reads get the
  version with the bytes, and writes send the version they assume, so cached metadata
  is never used stale: the client refreshes and retries.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict, TensorDictBase
from tensordict.utils import is_tensorclass

from tdstore._backend import ops as _backend
from tdstore._backend.connect import ConnectSpec
from tdstore._backend.connection import Connection
from tdstore._backend.loop import DEFAULT_TIMEOUT
from tdstore._backend.retry import RetryPolicy
from tdstore._core import chunks as _chunks
from tdstore._core import schema as _schema
from tdstore._core.keys import as_path as _as_path
from tdstore._core.keys import new_td_id
from tdstore._core.layout import Entry
from tdstore._core.values import NO_DEFAULT
from tdstore.base.compat import StoreCompat014
from tdstore.base.handle import StoreHandle, entries_below, snapshot_of
from tdstore.base.unsupported import StoreUnsupported, install
from tdstore.errors import (
    DurabilityError,
    EntryNotFoundError,
    SchemaError,
    StoreExistsError,
    StoreNotFoundError,
)
from tdstore.lazy.core import LazyStackedTensorDictStore
from tdstore.replay import priorities as _priorities
from tdstore.replay import rate_limit as _rate_limit
from tdstore.replay import slices as _slices
from tdstore.store import create as _creation
from tdstore.store import dims as _dims
from tdstore.store import lifetime as _lifetime
from tdstore.store import ring as _ring
from tdstore.store.lifetime import ttl_ms
from tdstore.store.reads import StoreReads
from tdstore.store.ring import RingState
from tdstore.store.writes import StoreWrites, _noop, upload_ops

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["TensorDictStore"]


class TensorDictStore(StoreHandle, StoreWrites, StoreReads, TensorDictBase):
    """A TensorDict whose entries live on a Redis-compatible server.

    See the module docstring and ``docs/`` for the full guide; the public API follows
    ``TensorDictBase`` plus the classmethods ``from_dict``, ``from_tensordict``,
    ``from_schema`` and ``from_store``.

    Examples:
        >>> import torch
        >>> from tdstore import TensorDictStore
        >>> td = TensorDictStore(batch_size=[100])
        >>> td["obs"] = torch.randn(100, 84)
        >>> td["obs"].shape  # fetched from the store
        torch.Size([100, 84])
        >>> td.clear_redis()
        >>> td.close()
    """

    def __init__(
        self,
        *,
        backend: str = "redis",
        host: str = "localhost",
        port: int = 6379,
        db: int = 0,
        unix_socket_path: str | None = None,
        prefix: str = "tensordict",
        batch_size: Sequence[int] | torch.Size | None = None,
        device: torch.device | str | int | None = None,
        client: Any = None,
        td_id: str | None = None,
        cache_metadata: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        names: Sequence[str | None] | None = None,
        allow_pickle: bool | None = None,
        pickle_key: bytes | str | None = None,
        expire: float | None = None,
        progress: bool | None = None,
        retry: RetryPolicy | int | bool | None = None,
        chunk_bytes: int | None = None,
        _create: bool = True,
        _connect: ConnectSpec | None = None,
        **redis_kwargs: Any,
    ) -> None:
        if batch_size is not None and any(not isinstance(d, int) or d < 0 for d in torch.Size(batch_size)):
            raise SchemaError(f"batch_size must hold non-negative ints, got {list(batch_size)}")
        # _connect=: the connection keywords gathered by a constructor that called this one
        connect = _connect if _connect is not None else ConnectSpec(
            host=host, port=port, db=db, unix_socket_path=unix_socket_path, prefix=prefix, client=client,
            timeout=timeout, allow_pickle=allow_pickle, pickle_key=pickle_key, retry=retry, progress=progress,
        )
        conn = connect.with_redis_kwargs(redis_kwargs).open(td_id if td_id is not None else new_td_id())
        device = torch.device(device) if device is not None else None
        self._init_handle(conn, (), device, cache_metadata, backend)
        # expire=: the lifetime given to the store when this call creates it (seconds)
        self._create_ttl_ms = ttl_ms(expire, self._where())
        # chunk_bytes=: the chunking given to the store when this call creates it
        conn.chunk_bytes = _chunks.check_chunk_bytes(
            chunk_bytes if chunk_bytes is not None else _chunks.env_chunk_bytes(), self._where()
        )
        if not _create:
            return
        bs = torch.Size(batch_size) if batch_size is not None else torch.Size([])
        try:
            self._create_store(bs, device, names, [], tensorclass=None)
            return
        except StoreExistsError:
            if td_id is None:
                raise
        # reconnecting (outside the except: its error is the only one shown): never reset what another process stored
        _creation.check_reconnect(self, td_id, bs if batch_size is not None else None, chunk_bytes)

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
            ops = upload_ops(store, td)
            names = td.names if td._has_names() else None
            store._create_store(td.batch_size, store_device, names, ops, tensorclass)
        except DurabilityError:
            raise  # (created on the master: the error holds the open handle, see DurabilityError.store)
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
        bs = _schema.check_batch_size(batch_size if batch_size is not None else [])
        entries = _schema.parse_schema(schema)
        store_device = torch.device(device) if device is not None else None
        connect = ConnectSpec.take(kwargs, host=host, port=port, db=db, unix_socket_path=unix_socket_path, prefix=prefix)
        store = cls(backend=backend, batch_size=bs, device=store_device, _create=False, _connect=connect, **kwargs)
        try:
            ops = _creation.schema_ops(store, bs, entries)
            store._create_store(bs, store_device, None, ops, None)
        except DurabilityError:
            raise  # (created on the master: the error holds the open handle, see DurabilityError.store)
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
        return _creation.resolve_class(store, cls, layout, tensorclass_cls)

    def _conn_max_bulk(self) -> int:
        self._conn.run(_noop)
        return self._conn.max_bulk

    def _init_handle(
        self, conn: Connection, path: tuple[str, ...], device: torch.device | None, cache_metadata: bool, *more: Any
    ) -> None:
        """``more``: the backend label (``backend=``)."""
        StoreHandle._init_handle(self, conn, path, device, cache_metadata)
        self._backend_label = more[0] if more else "redis"

    def _sub(self, path: tuple[str, ...]) -> TensorDictStore:
        return type(self)._handle(
            self._conn, path, self._device_override, self._cache_metadata, self._backend_label
        )

    # ------------------------------------------------------------------ identity
    @property
    def _td_id(self) -> str:
        return self._conn.keys.td_id

    _repr_name = "TensorDictStore"

    def _repr_details(self) -> str:
        return f"batch_size={list(self.batch_size)}, device={self.device}, backend={self._backend_label!r}"

    @staticmethod
    def _node_batch_size(meta: Entry, layout: _backend.Layout) -> list[int]:
        """The batch size of the nested tensordict whose registry metadata is ``meta``."""
        return list(meta.batch_size or ())

    # ------------------------------------------------------------------ layout
    def _check_layout(self, layout: _backend.Layout) -> None:
        _creation.check_layout(self, layout)

    def _not_found(self) -> StoreNotFoundError:
        return StoreNotFoundError(
            f"No TensorDictStore with td_id={self.td_id!r} found under prefix {self.prefix!r} on "
            f"{self._conn.describe()} (deleted with clear_redis(), expired, or a wrong "
            "td_id/prefix/db?)"
        )

    @staticmethod
    def _children(layout: _backend.Layout, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], Entry]]:
        return entries_below(layout, path, children=True)

    @staticmethod
    def _descendants(layout: _backend.Layout, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], Entry]]:
        return entries_below(layout, path, depth_first=True)

    def _node(self, layout: _backend.Layout | None = None) -> Entry:
        layout = layout if layout is not None else self._layout()
        if not self._path:
            root = layout.memo.get("root")
            if root is None:
                meta = layout.meta
                root = layout.memo["root"] = Entry.node(
                    layout.batch_size, json.loads(meta.get("names") or "null"), None
                )
            return root
        node = layout.entries.get(self._path)
        if node is None or not node.is_node:
            # the sub-store was deleted or replaced by another client: refresh once
            layout = self._layout(refresh=True)
            node = layout.entries.get(self._path)
            if node is None or not node.is_node:
                raise EntryNotFoundError(f"nested key {self._path!r} no longer exists in {self._where()}")
        return node

    def _owner_batch_size(self, layout: _backend.Layout, path: tuple[str, ...]) -> torch.Size:
        if len(path) <= 1:
            return torch.Size(self._node(layout).batch_size or ()) if not self._path else torch.Size(
                layout.batch_size
            )
        node = layout.entries.get(path[:-1])
        return torch.Size(node.batch_size or ()) if node else torch.Size([])

    # ------------------------------------------------------------------ properties
    @property
    def batch_size(self) -> torch.Size:
        return torch.Size(self._node().batch_size or ())

    @batch_size.setter
    def batch_size(self, new_size: Sequence[int] | torch.Size) -> None:
        self._change_batch_size(torch.Size(new_size))

    def _change_batch_size(self, new_size: torch.Size) -> None:
        _dims.change_batch_size(self, torch.Size(new_size))

    @property
    def device(self) -> torch.device | None:
        if self._device_override is not None:
            return self._device_override
        layout = self._layout()
        if "device" not in layout.memo:
            dev = layout.meta.get("device") or ""
            layout.memo["device"] = torch.device(dev) if dev else None
        return layout.memo["device"]

    @device.setter
    def device(self, value: Any) -> None:
        raise RuntimeError(
            "the device of a TensorDictStore cannot be set; use store.to(device) for a handle "
            "that reads onto that device"
        )

    @property
    def _td_dim_names(self) -> list[str | None] | None:  # type: ignore[override]
        return self._node().dim_names

    @_td_dim_names.setter
    def _td_dim_names(self, value: Any) -> None:
        self._write_names(None if value is None else list(value))

    def _write_names(self, names: list[str | None] | None) -> None:
        _dims.write_names(self, names)

    def _set_names(self, names: Sequence[str | None] | None) -> None:
        if names is None:
            self._write_names(None)
            return
        names = list(names)
        if len(names) != self.batch_dims:
            raise ValueError(f"expected {self.batch_dims} names, got {len(names)}")
        named = [n for n in names if n is not None]
        if len(set(named)) != len(named):
            raise ValueError(f"dimension names must be unique, got {names}")
        self._write_names(names)

    def _erase_names(self) -> None:
        self._write_names(None)

    def _has_names(self) -> bool:
        return self._node().names is not None

    def _class_of(self, meta: Entry) -> type:
        """The class the entry of registry metadata ``meta`` reads as (``entry_class``)."""
        if meta.is_node:
            return type(self)
        if meta.is_non_tensor:
            return NonTensorStack if meta.stack else NonTensorData
        return torch.Tensor

    # ------------------------------------------------------------------ reads
    def _get_str(self, key: Any, default: Any, **kwargs: Any) -> Any:
        return self._get_path(self._path + _as_path(key), default)

    _get_tuple = _get_str

    def _get_path(self, path: tuple[str, ...], default: Any) -> Any:
        meta = self._entry_or_default(path, default)
        if meta is None:
            return default
        if meta.is_node:
            return self._sub(path)
        return self._read_values([path])[0]

    # ------------------------------------------------------------------ index reads
    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, str) or (isinstance(index, tuple) and index and all(isinstance(i, str) for i in index)):
            value = self._get_path(self._path + _as_path(index), NO_DEFAULT)
            if isinstance(value, NonTensorData):
                return value.data
            if isinstance(value, NonTensorStack):
                return value.tolist()
            return value
        if index is Ellipsis or (isinstance(index, tuple) and index == ()):
            return self
        return self._read_index(index)

    __getitems__ = __getitem__

    def _get_at_str(self, key: Any, idx: Any, default: Any, **kwargs: Any) -> Any:
        path = self._path + _as_path(key)
        meta = self._entry_or_default(path, default)
        if meta is None:
            return default
        if meta.is_node:
            return self._sub(path)[idx]
        return self._read_index(idx, only=path)

    _get_at_tuple = _get_at_str

    # ------------------------------------------------------------------ ring buffer: tdstore/store/ring.py
    def extend(self, td: Any) -> torch.Tensor:
        """Appends the rows of ``td`` along the first batch dim, atomically; returns their indices.

        The rows go to ``(cursor + i) % capacity``: the buffer wraps around its first batch
        dim. ``td`` must hold every tensor entry of the store, with the store's row shapes
        (dtypes are cast). Concurrent ``extend`` calls from any process get disjoint rows.
        Non-tensor entries are not appended: a ``td`` holding one, or a store with a per-row
        non-tensor entry, is refused with a :class:`~tdstore.errors.SchemaError` and nothing
        is written. An append does not conflict with a read-modify-write (``apply_``, ``+=``)
        on a sub-store whose entries it does not write.

        Examples:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> from tdstore import TensorDictStore
            >>> buf = TensorDictStore.from_schema({"x": ([2], torch.float32)}, batch_size=[4])
            >>> buf.extend(TensorDict(x=torch.ones(3, 2), batch_size=[3]))
            tensor([0, 1, 2])
            >>> buf.extend(TensorDict(x=torch.full((2, 2), 2.0), batch_size=[2]))
            tensor([3, 0])
            >>> buf.ring_state()
            RingState(valid=4, total=5, capacity=4, cursor=1)
            >>> buf.clear_redis()
            >>> buf.close()
        """
        return _ring.extend(self, td)

    def ring_state(self) -> RingState:
        """How many rows are valid (written whole by an append), how many were ever reserved, and where the cursor is.

        ``valid`` counts the rows flagged as written: rows reserved by an append still in
        flight, or by an appender that died before writing them, are not valid.
        """
        return _ring.ring_state(self)

    def set_ring_total(self, total: int) -> None:
        """Sets the ring's count of rows ever appended to ``total`` (0 empties the ring), for
        every process, in one step.

        The first ``min(total, capacity)`` rows then count as written (``sample()`` draws
        them), except rows an append still in flight reserved; the next ``extend()`` writes
        at ``total % capacity``. What TorchRL's ``rb.empty()`` and ``load_state_dict()`` do
        (:mod:`tdstore.torchrl`).

        Raises:
            ValueError: ``total`` is not from 0 to 2**52.
            StoreNotFoundError: the store does not exist.
        """
        return _ring.set_ring_total(self, total)

    def sample(
        self, n: int, *, generator: torch.Generator | None = None, prioritized: bool = False, return_info: bool = False
    ) -> Any:
        """Reads ``n`` random rows (with replacement) among the valid ones; one consistent snapshot.

        Only rows flagged as written by an append are drawn (never one reserved by an
        append still in flight, or by an appender that died between its two steps). The
        flags are read first, then the rows in one snapshot: a row once flagged always
        holds a whole appended row, as an append writes its rows in one MULTI.

        ``prioritized=True`` (after :meth:`enable_priorities`): the rows are drawn in
        proportion to their priority values on the server, and each row returned holds the
        bytes of the generation returned with it (docs/replay.md). ``return_info=True``
        returns ``(batch, info)``: ``info["index"]`` the rows, and when prioritized
        ``info["_weight"]`` (TorchRL's importance weights, float32) and ``info["generation"]``.

        Raises:
            ValueError: when no row was appended yet (or, prioritized, priorities are off).
        """
        return _ring.sample(self, n, generator=generator, prioritized=prioritized, return_info=return_info)

    # ------------------------------------------------------------------ prioritized replay: tdstore/replay/priorities.py
    def enable_priorities(self, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-8, *, arity: int = 8) -> None:
        """Turns on proportional prioritized sampling of the ring, for every process, in one step.

        TorchRL's ``PrioritizedSampler`` semantics: a row of priority ``q`` holds
        ``p = (q + eps) ** alpha`` and is drawn with probability ``p / sum(p)``; new rows get
        the max priority given so far (1 while none was). The rows written now get priority 1.
        The settings are kept on the server. Called again with the same ``alpha``, ``eps``
        and ``arity``, only ``beta`` changes (the priorities are kept); else the tree is
        rebuilt. The tree holds doubles where the server's Lua has ``struct`` (Redis,
        Valkey), else text (fakeredis): ``priority_settings().encoding``. See docs/replay.md.

        Raises:
            ValueError: a setting out of range, or a store without a first batch dim.
        """
        _priorities.enable(self, alpha, beta, eps, arity)

    def disable_priorities(self) -> bool:
        """Turns prioritized sampling off (its tree is deleted); False when it was off."""
        return _priorities.disable(self)

    def priority_settings(self) -> _priorities.PrioritySettings | None:
        """The prioritized-replay settings kept on the server, or None when they are off."""
        return _priorities.settings(self)

    def update_priority(
        self, index: torch.Tensor | Sequence[int], priority: torch.Tensor | Sequence[float] | float,
        generation: torch.Tensor | Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Sets the priority of rows ``index`` (one step, from any process); returns which were applied.

        ``priority``: one per row, or one for all (finite, >= 0). ``generation``: the
        ``info["generation"]`` of the sample the rows came from; a row appended to since then
        is left alone (its entry of the returned bool tensor is False). A bad argument
        raises ValueError and changes nothing.
        """
        return _priorities.update(self, index, priority, generation)

    # ------------------------------------------------------------------ trajectory slices: tdstore/replay/slices.py
    def sample_slices(
        self, num_slices: int, slice_len: int, *, end_key: str | tuple[str, ...] | None = None,
        traj_key: str | tuple[str, ...] | None = None, prioritized: bool = False,
        generator: torch.Generator | None = None, return_info: bool = False,
    ) -> TensorDictBase | tuple[TensorDictBase, dict[str, torch.Tensor]]:
        """Reads ``num_slices`` trajectory slices of ``slice_len`` consecutive rows, chosen on the server.

        Returns ``num_slices * slice_len`` rows, slice after slice (a flat batch, as
        TorchRL's ``SliceSampler``). The rows of a slice were appended one after the other
        (a slice may wrap from the ring's last row to its first). A slice crosses neither an
        episode end nor the ring's write position, and holds only rows flagged as written:
        with ``end_key`` (a bool or integer entry, one element per row, non-zero = the row
        ends its episode) only its last row may be an end; with ``traj_key`` (an integer
        entry, one id per row) all its rows have the same id. Starts are drawn uniformly
        among the valid windows, or, ``prioritized=True`` (after :meth:`enable_priorities`),
        by the priority of their start row. The rows are read in one snapshot, and a slice
        appended to meanwhile is drawn again. A slice counts as ``slice_len`` samples for a
        rate limiter. ``return_info=True`` returns ``(batch, info)``: ``info["index"]`` the
        ring row of each row (flat), ``info["start"]`` the start row of each slice,
        ``info["position"]`` its position in append order, and when prioritized
        ``info["_weight"]`` and ``info["generation"]`` per slice (of its start row). See
        docs/replay.md.

        Raises:
            ValueError: a bad count, ``slice_len`` above the capacity, both or neither key
                given, or no valid slice yet (no episode of ``slice_len`` rows); nothing changes.
            SchemaError: the key is missing, or not of a dtype and shape it can be.
        """
        from_server = _slices.sample(
            self, num_slices, slice_len, end_key=end_key, traj_key=traj_key, prioritized=prioritized, generator=generator
        )
        return from_server if return_info else from_server[0]

    # ------------------------------------------------------------------ rate limits: tdstore/replay/rate_limit.py
    def set_rate_limit(
        self,
        min_size: int = 1,
        samples_per_insert: float | None = None,
        error_buffer: float | tuple[float, float] | None = None,
        timeout: float | None = None,
    ) -> None:
        """Keeps the ring's appenders and samplers in step, for every process: DeepMind
        Reverb's rate limiters, kept on the server.

        ``sample(n)`` waits until the ring holds ``min_size`` rows (Reverb's ``MinSize``).
        With ``samples_per_insert`` (Reverb's ``SampleToInsertRatio``), ``sample`` and
        ``extend`` also wait while ``inserts * samples_per_insert - samples`` would leave
        ``samples_per_insert * min_size ± error_buffer`` (or the ``(min_diff, max_diff)``
        pair given as ``error_buffer``). A row appended counts as one insert and a sample of
        n rows as n samples; the counts start at 0 here. A waiting call gives up after
        ``timeout`` seconds (None: it waits as long as it takes) with
        :class:`~tdstore.errors.RateLimitTimeoutError`, having applied nothing.

        Examples:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> from tdstore import TensorDictStore
            >>> from tdstore.errors import RateLimitTimeoutError
            >>> rb = TensorDictStore.from_schema({"x": ([2], torch.float32)}, batch_size=[8])
            >>> rb.set_rate_limit(min_size=2, timeout=0.05)
            >>> try:
            ...     rb.sample(4)
            ... except RateLimitTimeoutError:
            ...     print("held back")
            held back
            >>> _ = rb.extend(TensorDict({"x": torch.ones(2, 2)}, batch_size=[2]))
            >>> rb.sample(4)["x"].shape
            torch.Size([4, 2])
            >>> rb.rate_limit().samples
            4
            >>> rb.clear_redis()

        Raises:
            ValueError: a setting out of range (an error buffer smaller than
                ``max(1, samples_per_insert)``, a ``min_size`` above the capacity, ...);
                nothing is changed then.
        """
        _rate_limit.set_rate_limit(self, min_size, samples_per_insert, error_buffer, timeout)

    def clear_rate_limit(self) -> None:
        """Removes the ring's rate limiter (and its counts): appends and samples no longer wait."""
        _rate_limit.clear_rate_limit(self)

    def rate_limit(self) -> _rate_limit.RateLimit | None:
        """The ring's rate limiter and its counts as the server holds them, or None when there is none."""
        return _rate_limit.rate_limit(self)

    # ------------------------------------------------------------------ lifetime: tdstore/store/lifetime.py
    def expire(self, seconds: float) -> Self:
        """Makes the whole store expire ``seconds`` from now, atomically; returns the store.

        Every key of the store (also on a nested handle: the lifetime is the store's)
        expires at the same time, and entries created later inherit it. Calling it again
        replaces the expiry; :meth:`persist` removes it. The time is the server's clock.

        Examples:
            >>> import torch
            >>> from tdstore import TensorDictStore
            >>> store = TensorDictStore.from_dict({"x": torch.zeros(3)}, batch_size=[3], expire=3600)
            >>> 3590 < store.ttl() <= 3600
            True
            >>> store.persist().ttl() is None
            True
            >>> store.clear_redis()
            >>> store.close()
        """
        return _lifetime.expire(self, seconds)

    def persist(self) -> Self:
        """Removes the store's expiry, from every key at once; returns the store."""
        return _lifetime.persist(self)

    def ttl(self) -> float | None:
        """Seconds until the store expires, or None when it has no expiry.

        Raises:
            StoreNotFoundError: the store does not exist (or has expired).
        """
        return _lifetime.ttl(self)


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


# the methods of TensorDictBase that raise on a store, and (on tensordict 0.14) the 0.15 behaviour
install(TensorDictStore, StoreUnsupported, StoreCompat014)


def _unpickle(cls: Any, state: dict[str, Any]) -> Any:
    self = cls.__new__(cls)
    self.__setstate__(state)
    return self
