"""TorchRL's replay-buffer storage and writer on a :class:`~tdstore.TensorDictStore` (see :mod:`tdstore.torchrl`)."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDictBase
from tensordict.utils import is_tensorclass

from tdstore.errors import SchemaError, StoreExistsError, StoreNotFoundError
from tdstore.store import TensorDictStore

try:
    from torchrl.data.replay_buffers.checkpointers import StorageCheckpointerBase
    from torchrl.data.replay_buffers.storages import Storage, TensorStorage
    from torchrl.data.replay_buffers.writers import Writer
except ImportError as exc:  # pragma: no cover - exercised by the main env, which has no torchrl
    raise ImportError(
        "tdstore.torchrl needs TorchRL: pip install 'tdstore[torchrl]' (torchrl>=0.14.1, which "
        f"pins tensordict<0.15,>=0.14.3); importing torchrl failed: {exc}"
    ) from exc

if TYPE_CHECKING:
    from tensordict import NestedKey
    from tensordict.utils import IndexType

__all__ = ["TensorDictStoreStorage", "TensorDictStoreWriter"]


def _as_tensordict(data: Any, what: str) -> TensorDictBase:
    if is_tensorclass(data):
        data = data._tensordict
    if not isinstance(data, TensorDictBase):
        raise TypeError(
            f"TensorDictStoreStorage.{what}() takes a TensorDict (or a tensorclass), got {type(data).__name__}; "
            "wrap tensors as TensorDict(obs=tensor, batch_size=[n])"
        )
    return data


def _is_leaf(cls: type) -> bool:
    return issubclass(cls, (torch.Tensor, NonTensorData, NonTensorStack))


class _StateDictCheckpointer(StorageCheckpointerBase):
    """``rb.dumps(path)`` / ``rb.loads(path)``: the storage's state_dict in ``path/storage.pt``."""

    def dumps(self, storage: Storage, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        torch.save(storage.state_dict(), path / "storage.pt")

    def loads(self, storage: Storage, path: str | os.PathLike[str]) -> None:
        state = torch.load(Path(path) / "storage.pt", weights_only=True)
        storage.load_state_dict(state)


class TensorDictStoreStorage(TensorStorage):
    """A TorchRL storage whose rows live in a :class:`~tdstore.TensorDictStore`.

    The store is a preallocated ring of ``max_size`` rows (``TensorDictStore.from_schema``),
    created from the first data written, or given (``store=``), or found on the server by
    ``td_id=`` (another process's buffer). ``len(storage)`` is read from the server, so every
    process sees the rows that any process appended. Sampling reads the rows in one
    consistent snapshot, and returns an in-memory TensorDict.

    With a :class:`TensorDictStorePrioritizedSampler` or a slice sampler, and with TorchRL's
    ``RandomSampler`` on rows appended by :class:`TensorDictStoreWriter`, the rows that the
    draw read are handed to the next ``get()`` of the same index tensor in the same thread,
    which returns them without reading them again (``handoff_hits`` counts those).

    Use it with :class:`TensorDictStoreWriter`, which appends through the store's atomic
    cursor. With TorchRL's default ``RoundRobinWriter`` the buffer works in one process
    (rows go where that writer's local cursor says), but writers in different processes
    would overwrite each other's rows.

    Args:
        max_size (int, optional): the number of rows. Defaults to the first batch dim of
            ``store``, or of the store found by ``td_id``; required otherwise.

    Keyword Args:
        store (TensorDictStore, optional): an existing store with a batch dim, to use as is.
        td_id (str, optional): the id of the store: connect to it if it exists, else create it
            under that id at the first write. Give the same id in every process that shares
            the buffer.
        device: where sampled rows are placed. Defaults to ``"cpu"``.
        **store_kwargs: connection arguments of :class:`~tdstore.TensorDictStore`
            (``host``, ``port``, ``unix_socket_path``, ``prefix``, ``db``, ...).

    Raises:
        ValueError: for a missing or wrong ``max_size``.
        TypeError: when written data is not a TensorDict or a tensorclass.
        SchemaError: when written data does not match the store's entries.
    """

    _default_checkpointer = _StateDictCheckpointer  # TensorStorage's memmaps the tensors in place
    #: the rows live in a ShardedStore (tdstore/torchrl/sharded.py): samplers of one store refuse it
    _holds_shards: ClassVar[bool] = False

    def __init__(
        self,
        max_size: int | None = None,
        *,
        store: TensorDictStore | None = None,
        td_id: str | None = None,
        device: torch.device | str = "cpu",
        **store_kwargs: Any,
    ) -> None:
        if store is not None and (td_id is not None or store_kwargs):
            raise ValueError("TensorDictStoreStorage: pass either store= or td_id=/connection arguments, not both")
        if store is None and td_id is not None:
            try:
                store = TensorDictStore.from_store(td_id=td_id, **store_kwargs)
            except StoreNotFoundError:
                store = None  # created under td_id at the first write
        if store is not None:
            if not store.batch_dims:
                raise ValueError(f"TensorDictStoreStorage needs a store with a batch dim; {store._where()} has none")
            capacity = store.batch_size[0]
            if max_size is not None and int(max_size) != capacity:
                raise ValueError(
                    f"max_size={max_size} does not match the first batch dim {capacity} of {store._where()}"
                )
            max_size = capacity
        if max_size is None or int(max_size) < 1:
            raise ValueError(f"TensorDictStoreStorage needs max_size >= 1 (or an existing store), got {max_size}")
        Storage.__init__(self, int(max_size))
        self.ndim = 1
        self.device = torch.device(device) if device != "auto" else "auto"
        self._storage = store
        self.initialized = store is not None
        self._td_id = td_id
        self._store_kwargs = dict(store_kwargs)
        self._local_len = 0  # rows written at explicit indices (RoundRobinWriter, write_at) in this process
        self._known_full = False  # the last count read was max_size (see _len)
        self._last_cursor = None
        self.__dict__["_storage_keys"] = None
        self.__dict__["_handoff"] = threading.local()
        #: rb.sample() calls whose rows the prioritized sampler handed over (no second read)
        self.handoff_hits = 0

    # ------------------------------------------------------------------ the store
    @property
    def store(self) -> TensorDictStore:
        """The :class:`~tdstore.TensorDictStore` that holds the rows (after the first write)."""
        if self._storage is None:
            raise RuntimeError("TensorDictStoreStorage holds no store yet: write some data first")
        return self._storage

    def _schema_of(
        self, data: TensorDictBase, batched: bool
    ) -> tuple[dict[NestedKey, tuple[list[int], torch.dtype]], list[int]]:
        """The entries (``{key: (element shape, dtype)}``) and inner batch dims of the store made for ``data``."""
        nb = 1 if batched else 0
        schema: dict[NestedKey, tuple[list[int], torch.dtype]] = {}
        for key, value in data.items(include_nested=True, leaves_only=True, is_leaf=_is_leaf):
            if not isinstance(value, torch.Tensor):
                raise SchemaError(
                    f"{type(self).__name__} stores tensor entries only; entry {key!r} is a {type(value).__name__}"
                )
            schema[key] = (list(value.shape[data.batch_dims :]), value.dtype)
        if not schema:
            raise SchemaError(f"{type(self).__name__}: the first data written has no tensor entry")
        return schema, list(data.batch_size[nb:])

    def _ensure_store(self, data: TensorDictBase, batched: bool) -> TensorDictStore:
        if self._storage is not None:
            return self._storage
        schema, inner = self._schema_of(data, batched)
        kwargs = dict(self._store_kwargs)
        if self._td_id is not None:
            kwargs["td_id"] = self._td_id
        try:
            store = TensorDictStore.from_schema(schema, batch_size=[self.max_size, *inner], **kwargs)
        except StoreExistsError:
            # another process created it first under the same td_id
            assert self._td_id is not None, "from_schema raised StoreExistsError for a td_id of ours"
            store = TensorDictStore.from_store(td_id=self._td_id, **self._store_kwargs)
        self._storage = store
        self.initialized = True
        self._attach_samplers()
        return store

    def _attach_samplers(self) -> None:
        """Lets a prioritized sampler of a buffer of this storage enable the priorities now,
        before the first append: then every row appended carries its generation (and the
        max priority) from the start, as TorchRL's sampler gives every row written one."""
        for entity in self._attached_entities_iter():
            sampler = getattr(entity, "_sampler", None)
            if sampler is not None and getattr(sampler, "_binds_to_store_storage", False):
                sampler._store_of(self)

    # ------------------------------------------------------------------ length
    @property
    def _len(self) -> int:  # type: ignore[override]
        if self._storage is None:
            return self._local_len
        valid = max(self._storage.ring_state().valid, self._local_len)
        # a full ring stays full until _empty(): get() then skips its own read of the count
        self._known_full = valid == self.max_size
        return valid

    @_len.setter
    def _len(self, value: int) -> None:
        self._local_len = int(value)

    def __len__(self) -> int:
        return self._len

    @property
    def _total_shape(self) -> torch.Size | None:  # type: ignore[override]
        return None if self._storage is None else self._storage.batch_size[:1]

    # ------------------------------------------------------------------ writes
    def extend(self, data: Any) -> torch.Tensor:
        """Appends the rows of ``data`` through the store's atomic cursor; returns their indices."""
        data = _as_tensordict(data, "extend")
        store = self._ensure_store(data, batched=True)
        n = data.batch_size[0] if data.batch_dims else 0
        if n > self.max_size:
            # more rows than the ring holds: appended in chunks, the later rows overwrite the
            # earlier ones as in LazyTensorStorage (each chunk is atomic, the whole is not)
            index = torch.cat([store.extend(data[i : i + self.max_size]) for i in range(0, n, self.max_size)])
        else:
            index = store.extend(data)
        self._set_last_cursor(index)
        self._bump_mutation_revision()
        return index

    def set(
        self, cursor: int | slice | list[int] | tuple[int, ...] | torch.Tensor, data: object, *, set_cursor: bool = True
    ) -> None:  # type: ignore[override]
        """Writes ``data`` at rows ``cursor`` (an int, a slice, a sequence or a tensor of rows), atomically."""
        data = _as_tensordict(data, "set")
        single = isinstance(cursor, int) or (isinstance(cursor, torch.Tensor) and cursor.ndim == 0)
        store = self._ensure_store(data, batched=not single)
        if isinstance(cursor, Sequence) and not isinstance(cursor, (str, bytes)):
            cursor = torch.as_tensor(cursor, dtype=torch.long)
        store[cursor] = data
        if set_cursor:
            self._set_last_cursor(cursor)
        rows = torch.arange(self.max_size)[cursor].reshape(-1)
        if rows.numel():
            self._local_len = min(max(self._local_len, int(rows.max()) + 1), self.max_size)
        self._bump_mutation_revision()

    # ------------------------------------------------------------------ reads
    def _hand_over(self, index: torch.Tensor, batch: TensorDictBase) -> None:
        """Holds ``batch`` (the rows at ``index``, just read by a sampler) for the next get()
        of this thread: a get() of that very tensor object returns it instead of reading the
        rows again; any other get() drops it. One slot per thread (threading.local)."""
        slot = self.__dict__["_handoff"]
        slot.index, slot.batch = index, batch

    def _take_handed_over(self, index: object) -> TensorDictBase | None:
        slot = self.__dict__["_handoff"]
        held = getattr(slot, "index", None)
        if held is None:
            return None
        batch = slot.batch
        slot.index = slot.batch = None
        if held is not index:
            return None  # another index: read as usual (never the rows of another draw)
        self.handoff_hits += 1
        return batch

    def get(self, index: IndexType) -> TensorDictBase:
        """Reads rows among the valid ones (as ``storage[:len(storage)][index]``) into memory."""
        if self._storage is None:
            raise RuntimeError("Cannot get elements out of a non-initialized storage.")
        handed = self._take_handed_over(index)
        if handed is not None:
            if self.device != "auto" and torch.device(self.device).type != "cpu":
                handed = handed.to(self.device)
            return handed
        valid = self.max_size if self._known_full else self._readable()
        if valid < self.max_size:
            rows = torch.arange(valid)[index]  # IndexError past the valid rows, as TensorStorage
            index = int(rows) if rows.ndim == 0 else rows
        elif isinstance(index, Sequence) and not isinstance(index, (str, bytes)):
            index = torch.as_tensor(index, dtype=torch.long)
        out = self._storage[index]
        if self.device != "auto" and torch.device(self.device).type != "cpu":
            out = out.to(self.device)
        return out

    def _readable(self) -> int:
        """The rows get() may read: the valid ones, and those appends reserved (rows drawn
        by _rand_given_ndim are among the written ones, which need not come first)."""
        assert self._storage is not None
        state = self._storage.ring_state()
        valid = max(state.valid, self._local_len)
        self._known_full = valid == self.max_size
        return max(valid, min(state.total, self.max_size))

    def _rand_given_ndim(self, batch_size: int) -> torch.Tensor:
        """TorchRL's uniform draw. Rows written by this process's own writer (``storage.set``,
        not flagged) are drawn among the valid ones. Rows written by appends only are drawn
        and read by the store's ``sample()``: among the rows flagged as written, read in one
        snapshot with their flags (a full ring's in one server step), so never a row an
        append reserved and has not written yet, nor one a promoted replica lacks; the rows
        are handed to the ``get()`` of the returned index, which does not read them again."""
        if self._storage is None or self._local_len:
            valid = self.max_size if self._known_full else len(self)
            return torch.randint(0, valid, (batch_size,), generator=self._rng)
        return self._sample_handed_over(batch_size)

    def _sample_handed_over(self, batch_size: int) -> torch.Tensor:
        """The index of ``self._storage.sample(batch_size)``, whose rows are handed to the
        ``get()`` of that index (moved to the storage's device, as the buffer moves it)."""
        assert self._storage is not None
        batch, info = self._storage.sample(int(batch_size), return_info=True, generator=self._rng)
        index = info["index"]
        if self.device != "auto" and torch.device(self.device).type != "cpu":
            index = index.to(self.device)  # (the buffer moves it there before storage.get)
        self._hand_over(index, batch)
        return index

    def contains(self, item: object) -> bool | torch.Tensor:
        valid = len(self)
        if isinstance(item, int):
            item = item + valid if item < 0 else item
            return 0 <= item < valid
        if isinstance(item, torch.Tensor):
            return (item >= 0) & (item < valid)
        raise NotImplementedError(f"type {type(item)} is not supported yet.")

    # ------------------------------------------------------------------ state
    def _empty(self) -> None:
        """Empties the buffer for every process: the server's row count goes back to 0."""
        self._local_len = 0
        self._known_full = False
        if self._storage is not None:
            try:
                self._storage.set_ring_total(0)
            except StoreNotFoundError:
                pass  # a store deleted meanwhile holds no rows: nothing to empty, and nothing is written
        self._bump_mutation_revision()

    def state_dict(self) -> dict[str, object]:
        """The rows (an in-memory snapshot) and the row counter, as TorchRL checkpoints expect."""
        if self._storage is None:
            return {"_storage": {}, "initialized": False, "_len": 0, "total": 0}
        ring = self._storage.ring_state()
        return {
            "_storage": self._storage.to_tensordict().state_dict(),
            "initialized": True,
            "_len": max(ring.valid, self._local_len),
            "total": ring.total,
            "td_id": self._storage.td_id,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Writes the rows of ``state_dict`` into the store and restores its row counter."""
        from tensordict import TensorDict

        self._bind_samplers()
        if not state_dict.get("initialized"):
            self._empty()
            return
        data = TensorDict(batch_size=[self.max_size]).load_state_dict(state_dict["_storage"], strict=False)
        if data.batch_size[:1] != torch.Size([self.max_size]):
            raise SchemaError(
                f"load_state_dict: the saved rows have batch size {list(data.batch_size)}, this storage holds "
                f"{self.max_size} rows"
            )
        store = self._ensure_store(data, batched=True)
        store.update(data, inplace=True)
        store.set_ring_total(int(state_dict.get("total", state_dict["_len"])))
        self._local_len = int(state_dict["_len"])
        self._bump_mutation_revision()

    def _bind_samplers(self) -> None:
        """Before a load: a buffer loads its sampler next, which then finds this storage."""
        for entity in self._attached_entities_iter():
            sampler = getattr(entity, "_sampler", None)
            if sampler is not None and getattr(sampler, "_binds_to_store_storage", False):
                sampler._bind(self)  # (a TensorDictStorePrioritizedSampler)

    def _default_writer(self) -> TensorDictStoreWriter:
        """The writer a buffer built for this storage appends with (prioritized_replay_buffer)."""
        return TensorDictStoreWriter()

    def __getstate__(self) -> dict[str, object]:
        # Storage.__getstate__ swaps the shared counters for plain values; the store pickles by td_id
        state = Storage.__getstate__(self)
        state.pop("_len_value", None)
        state.pop("_handoff", None)
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        Storage.__setstate__(self, state)
        self.__dict__["_handoff"] = threading.local()

    def __repr__(self) -> str:
        where = self._storage._where() if self._storage is not None else "<no store yet>"
        return f"{type(self).__name__}(max_size={self.max_size}, len={len(self)}, store={where})"


class TensorDictStoreWriter(Writer):
    """A TorchRL writer that appends through the store's atomic cursor (multi-process safe).

    Each ``extend`` is one server-side step that reserves the next rows of the ring and
    writes them, so writers in any number of processes never overwrite each other's rows.
    Needs a :class:`TensorDictStoreStorage`.
    """

    def __init__(self) -> None:
        super().__init__()
        self._write_count = 0

    def register_storage(self, storage: Storage) -> None:
        if not isinstance(storage, TensorDictStoreStorage):
            raise TypeError(f"TensorDictStoreWriter needs a TensorDictStoreStorage, got {type(storage).__name__}")
        super().register_storage(storage)

    @property
    def _cursor(self) -> int:
        storage = self._storage
        if storage is None or storage._storage is None:
            return 0
        return storage._storage.ring_state().cursor

    def add(self, data: Any) -> int:
        data = _as_tensordict(data, "add")
        index = self._append(data.unsqueeze(0) if data.batch_dims == 0 else data[None])
        self._write_count += 1
        self._mark_update_entities(index[0])
        return int(index[0])

    def _append(self, data: object) -> torch.Tensor:
        """One append through the storage (ShardedStoreWriter passes its shard)."""
        return self._storage.extend(data)  # type: ignore[no-any-return]

    def extend(self, data: object) -> torch.Tensor:
        index = self._append(data)
        self._write_count += index.numel()
        self._mark_update_entities(index)
        return index

    def write_at(self, index: int | Sequence[int] | torch.Tensor, data: object) -> int | Sequence[int] | torch.Tensor:
        """Writes ``data`` at explicit rows, without moving the shared cursor."""
        self._storage.set(index, data, set_cursor=False)
        n = 1 if isinstance(index, int) else torch.as_tensor(index).numel()
        self._write_count += n
        self._mark_update_entities(index)
        return index

    def _mark_update_entities(self, index: int | Sequence[int] | torch.Tensor) -> None:
        for entity in self._storage._attached_entities_iter():
            entity.mark_update(index)

    def _empty(self, empty_write_count: bool = True) -> None:
        if empty_write_count:
            self._write_count = 0

    def dumps(self, path: str | os.PathLike[str]) -> None:
        return None  # the cursor lives on the server, with the rows

    def loads(self, path: str | os.PathLike[str]) -> None:
        return None

    def state_dict(self) -> dict[str, int]:
        return {"_write_count": self._write_count}

    def load_state_dict(self, state_dict: Mapping[str, int]) -> None:
        self._write_count = int(state_dict.get("_write_count", 0))
