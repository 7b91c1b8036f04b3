"""TorchRL replay-buffer storage that keeps its rows in a :class:`~tdstore.TensorDictStore`.

``ReplayBuffer(storage=TensorDictStoreStorage(...), writer=TensorDictStoreWriter())`` keeps
the buffer on a Redis-wire server, so any number of processes (on any machines) can append
to and sample from one buffer. The writer appends through the store's atomic cursor
(:meth:`~tdstore.TensorDictStore.extend`, one server-side step): concurrent writers never
get the same rows, never leave a gap, and the buffer's length is the server's count, the
same in every process.

:class:`TensorDictStorePrioritizedSampler` adds TorchRL's prioritized replay with the
priorities kept on the server (``store.enable_priorities``), shared by every process's
buffer: ``ReplayBuffer(sampler=...)``, ``PrioritizedReplayBuffer(sampler=...)``, and
:class:`TensorDictStorePrioritizedReplayBuffer` for ``TensorDictPrioritizedReplayBuffer``
(:func:`prioritized_replay_buffer` builds either; docs/torchrl.md).

torchrl is an optional dependency: ``pip install 'tdstore[torchrl]'``. This module imports
it; ``import tdstore`` does not.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl.data import ReplayBuffer
    >>> from tdstore.torchrl import TensorDictStoreStorage, TensorDictStoreWriter
    >>> rb = ReplayBuffer(storage=TensorDictStoreStorage(100), writer=TensorDictStoreWriter(), batch_size=4)
    >>> rb.extend(TensorDict(obs=torch.randn(10, 3), batch_size=[10]))
    tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    >>> rb.sample()["obs"].shape
    torch.Size([4, 3])
    >>> rb.storage.store.clear_redis()
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDictBase
from tensordict.utils import is_tensorclass

from tdstore.errors import SchemaError, StoreExistsError, StoreNotFoundError
from tdstore.replay import priorities as _priorities
from tdstore.store import TensorDictStore
from tdstore.store import ring as _ring

try:
    from torchrl.data.replay_buffers.checkpointers import StorageCheckpointerBase
    from torchrl.data.replay_buffers.replay_buffers import (
        PrioritizedReplayBuffer,
        ReplayBuffer,
        TensorDictPrioritizedReplayBuffer,
        TensorDictReplayBuffer,
    )
    from torchrl.data.replay_buffers.samplers import PrioritizedSampler
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

__all__ = [
    "TensorDictStoreStorage", "TensorDictStoreWriter", "TensorDictStorePrioritizedSampler",
    "TensorDictStorePrioritizedReplayBuffer", "prioritized_replay_buffer",
]


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

    With a :class:`TensorDictStorePrioritizedSampler`, the rows that the sampler read are
    handed to the next ``get()`` of the same index tensor in the same thread, which returns
    them without reading them again (``handoff_hits`` counts those).

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

    def _ensure_store(self, data: TensorDictBase, batched: bool) -> TensorDictStore:
        if self._storage is not None:
            return self._storage
        nb = 1 if batched else 0
        schema: dict[NestedKey, tuple[list[int], torch.dtype]] = {}
        for key, value in data.items(include_nested=True, leaves_only=True, is_leaf=_is_leaf):
            if not isinstance(value, torch.Tensor):
                raise SchemaError(
                    f"TensorDictStoreStorage stores tensor entries only; entry {key!r} is a "
                    f"{type(value).__name__}"
                )
            schema[key] = (list(value.shape[data.batch_dims :]), value.dtype)
        if not schema:
            raise SchemaError("TensorDictStoreStorage: the first data written has no tensor entry")
        inner = list(data.batch_size[nb:])
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
        return store

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

    def set(self, cursor: int | slice | list[int] | tuple[int, ...] | torch.Tensor, data: object, *, set_cursor: bool = True) -> None:  # type: ignore[override]
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
        # RandomSampler reads len(storage) just before: a full ring needs no second read
        if self._known_full or self._storage is None or self._local_len:
            valid = self.max_size if self._known_full else len(self)
            return torch.randint(0, valid, (batch_size,), generator=self._rng)
        # rows written by appends only: draw among those flagged as written, never one an
        # append reserved and has not written yet (see TensorDictStore.sample)
        return _ring.draw_written(self._storage, batch_size, self._rng)

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

        for entity in self._attached_entities_iter():  # (a buffer loads its sampler next: it finds this storage)
            sampler = getattr(entity, "_sampler", None)
            if isinstance(sampler, TensorDictStorePrioritizedSampler):
                sampler._bind(self)
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
        index = self._storage.extend(data.unsqueeze(0) if data.batch_dims == 0 else data[None])
        self._write_count += 1
        self._mark_update_entities(index[0])
        return int(index[0])

    def extend(self, data: object) -> torch.Tensor:
        index = self._storage.extend(data)
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


# --------------------------------------------------------------------------- prioritized replay
#: How many recent samples' index tensors a sampler remembers the generations of (update_priority).
_RECENT_SAMPLES = 32


def _read_priorities(store: TensorDictStore) -> tuple[torch.Tensor, float] | None:
    """The priority ``q`` of every row of the ring (NaN for rows not written) and the max
    priority (NaN while none was given), read back from the server's tree; None when off."""
    report = _priorities.tree_report(store)
    if report is None:
        return None
    s: _priorities.PrioritySettings = report["settings"]
    p = torch.as_tensor(report["leaves"], dtype=torch.float64).reshape(-1)
    flags = report["flags"]
    if flags is not None and len(flags) >= p.numel():
        f = torch.frombuffer(bytearray(bytes(flags)[: p.numel()]), dtype=torch.uint8)
        written = (f == 1) | (f == ord("1"))  # (the ring's "written" flags: one byte per row)
    else:
        written = p > 0
    if s.alpha > 0:
        q = (p.clamp_min(0) ** (1.0 / s.alpha) - s.eps).clamp_min(0)
    else:
        q = torch.ones_like(p)  # (alpha 0: every value is 1, the priorities cannot be told apart)
    q[~written] = math.nan
    top = report["max"]
    return q, (math.nan if top is None else float(top))


def _write_priorities(store: TensorDictStore, q: torch.Tensor, top: float) -> None:
    """Writes back what :func:`_read_priorities` read (rows written now only), the max first."""
    now = _read_priorities(store)
    if now is None:
        return
    q = torch.as_tensor(q, dtype=torch.float64).reshape(-1)
    n = min(q.numel(), now[0].numel())
    rows = torch.nonzero(~torch.isnan(q[:n]) & ~torch.isnan(now[0][:n])).reshape(-1)
    if not rows.numel():
        return
    if math.isfinite(top):
        store.update_priority(rows[:1], top)  # the max priority given so far comes back too
    store.update_priority(rows, q[rows])


class TensorDictStorePrioritizedSampler(PrioritizedSampler):
    """TorchRL's proportional prioritized sampler, kept on the server of a :class:`TensorDictStoreStorage`.

    The semantics are those of TorchRL's ``PrioritizedSampler``: a row of priority ``q`` is
    drawn with probability ``(q + eps) ** alpha / sum``, comes with the importance weight
    ``(N * P) ** -beta / max``, and a new row gets the max priority given so far. The tree,
    the max priority and the settings live on the server (:meth:`TensorDictStore.enable_priorities`,
    docs/replay.md): every process whose buffer uses the same store (``td_id=``) samples
    from the same priorities, and an update from any of them is seen by all. No TorchRL
    C++ extension is used.

    The first use with a storage (a sample, an update, a load) enables priorities on its
    store with this sampler's ``alpha``, ``beta`` and ``eps``; priorities already enabled
    with the same ``alpha`` and ``eps`` are kept (only ``beta`` is set). Another ``alpha``
    or ``eps`` rebuilds the tree: every row starts again at priority 1.

    ``sample()`` reads the rows together with the draw (one snapshot, checked against the
    rows' generations) and hands them to the storage, so the buffer's ``storage.get(index)``
    that follows does not read them again. ``info`` holds ``"_weight"`` and
    ``"priority_weight"`` (the same float32 weights: TorchRL's losses read the second),
    ``"index"`` and ``"generation"``. ``update_priority(index, priority)`` given the index
    tensor of one of the last 32 samples (as ``rb.update_priority(info["index"], ...)`` and
    ``rb.update_tensordict_priority(batch)`` pass it) uses that sample's generations: a row
    appended to since then keeps the priority of its new data. Any other index (a copy, a
    slice) is updated without that check.

    Args:
        alpha (float): the priority exponent (0: uniform).
        beta (float): the importance-weight exponent. Kept on the server: the weights of
            every process's samples use the ``beta`` last set by any of them.
        eps (float, optional): added to every priority. Defaults to ``1e-8``.

    Keyword Args:
        reduction (str, optional): how ``TensorDictReplayBuffer`` reduces a priority entry
            with more than one value per row (``"max"``, ``"min"``, ``"mean"``, ``"median"``).
        max_priority_within_buffer (bool, optional): only ``False`` (TorchRL's default): the
            max priority is the largest ever given, kept on the server.
        arity (int, optional): children per node of the server's tree. Defaults to 8.
        dtype: accepted for TorchRL's signature; the server keeps float64 values.

    Raises:
        TypeError: when used with a storage that is not a :class:`TensorDictStoreStorage`.
        ValueError: for ``max_priority_within_buffer=True`` or a setting out of range.
    """

    def __init__(
        self,
        alpha: float,
        beta: float,
        eps: float = 1e-8,
        *,
        reduction: str = "max",
        max_priority_within_buffer: bool = False,
        arity: int = _priorities.DEFAULT_ARITY,
        dtype: torch.dtype = torch.float,
    ) -> None:
        # (PrioritizedSampler.__init__ is not called: it builds TorchRL's C++ segment trees)
        if max_priority_within_buffer:
            raise ValueError(
                "TensorDictStorePrioritizedSampler: max_priority_within_buffer=True is not supported; the server "
                "keeps the largest priority ever given (TorchRL's default, False)"
            )
        for name, value in (("alpha", alpha), ("beta", beta), ("eps", eps)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"TensorDictStorePrioritizedSampler: {name} must be a finite number >= 0, got {value!r}")
        self._alpha = float(alpha)
        self._beta = float(beta)
        self._eps = float(eps)
        self._arity = int(arity)
        self.reduction = reduction
        self.dtype = dtype
        self._max_priority_within_buffer = False
        self._device = None
        self._store: TensorDictStore | None = None  # the store priorities were enabled on
        self._pending: dict[str, object] | None = None  # a loaded state, written at the first use
        self._storage_ref: weakref.ref[TensorDictStoreStorage] | None = None
        self._init_local()

    def _init_local(self) -> None:
        self._lock = threading.Lock()
        self._recent: OrderedDict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = OrderedDict()

    def _init(self) -> None:
        return None  # no local tree (TorchRL's _init builds the C++ ones)

    # ------------------------------------------------------------------ settings
    def __repr__(self) -> str:
        where = self._store._where() if self._store is not None else "<no store yet>"
        return f"{type(self).__name__}(alpha={self._alpha}, beta={self._beta}, eps={self._eps}, store={where})"

    @property
    def alpha(self) -> float:
        """The priority exponent. Setting another value rebuilds the server's tree and writes
        the priorities back (read, rebuilt, rewritten: not atomic against other processes)."""
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        if value < 0:
            raise ValueError(f"alpha must be greater or equal than 0, got alpha={value}")
        store, old = self._store, self._alpha
        self._alpha = float(value)
        if store is not None and self._alpha != old:
            saved = _read_priorities(store)
            self._enable(store)
            if saved is not None:
                _write_priorities(store, *saved)

    @property
    def beta(self) -> float:
        """The importance-weight exponent; setting it sets the server's (for every process)."""
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = float(value)
        if self._store is not None:
            self._enable(self._store)  # same alpha and eps: only beta changes, the priorities stay

    @property
    def max_size(self) -> int:
        return 0 if self._store is None else int(self._store.batch_size[0])

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def default_priority(self) -> float:
        """NaN: "the server's default". The server gives a new row the max priority itself
        (in the append's MULTI), and an update whose priorities are all NaN changes nothing,
        so TorchRL's fills with the default priority (a buffer built on a storage that holds
        rows, ``add()`` without a priority entry) keep the priorities on the server."""
        return math.nan

    # ------------------------------------------------------------------ the store
    def _bind(self, storage: TensorDictStoreStorage) -> None:
        """Remembers ``storage`` (no server call): state_dict() and load_state_dict() use its store."""
        self._storage_ref = weakref.ref(storage)

    def _known_store(self) -> TensorDictStore | None:
        if self._store is not None:
            return self._store
        storage = self._storage_ref() if self._storage_ref is not None else None
        return None if storage is None else storage._storage

    def _enable(self, store: TensorDictStore) -> None:
        s = store.priority_settings()
        want = (self._alpha, self._beta, self._eps, self._arity)
        if s is None or (s.alpha, s.beta, s.eps, s.arity) != want:
            store.enable_priorities(self._alpha, self._beta, self._eps, arity=self._arity)

    def _store_of(self, storage: Storage | None) -> TensorDictStore | None:
        """The store of ``storage`` with priorities enabled (None before its first write)."""
        if storage is None:
            return self._store
        if not isinstance(storage, TensorDictStoreStorage):
            raise TypeError(
                f"TensorDictStorePrioritizedSampler needs a TensorDictStoreStorage, got {type(storage).__name__}"
            )
        store = storage._storage
        if store is None or store is self._store:
            return store
        self._attach(store)
        return store

    def _attach(self, store: TensorDictStore) -> None:
        """Enables priorities on ``store`` and writes a loaded state's priorities into it."""
        self._enable(store)
        self._store = store
        pending, self._pending = self._pending, None
        saved = None if pending is None else pending.get("priority")
        if pending is not None and isinstance(saved, torch.Tensor):
            top = pending.get("max_priority", math.nan)
            _write_priorities(store, saved, float(top) if isinstance(top, (int, float)) else math.nan)

    # ------------------------------------------------------------------ sampling
    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Draws ``batch_size`` rows by priority and reads them (handed to ``storage``);
        returns ``(index, info)`` as TorchRL's ``PrioritizedSampler`` does."""
        store = self._store_of(storage)
        if store is None:
            raise RuntimeError("Cannot sample from an empty storage.")
        assert isinstance(storage, TensorDictStoreStorage)
        try:
            batch, info = store.sample(batch_size, prioritized=True, return_info=True, generator=self._rng)
        except ValueError as err:
            if store.priority_settings() is not None:
                if storage._local_len and not store.ring_state().total:
                    raise RuntimeError(
                        f"TensorDictStorePrioritizedSampler: the rows of {store._where()} were written at explicit "
                        "indices (RoundRobinWriter, write_at), which gives them no priority; use TensorDictStoreWriter"
                    ) from err
                raise
            self._enable(store)  # turned off meanwhile (disable_priorities() from another process)
            batch, info = store.sample(batch_size, prioritized=True, return_info=True, generator=self._rng)
        index = info["index"]
        if storage.device != "auto" and torch.device(storage.device).type != "cpu":
            index = index.to(storage.device)  # (the buffer moves it there before storage.get)
        storage._hand_over(index, batch)
        self._remember(index, info["generation"])
        weight = info["_weight"]
        return index, {"_weight": weight, "priority_weight": weight, "generation": info["generation"], "index": index}

    def _remember(self, index: torch.Tensor, generation: torch.Tensor) -> None:
        with self._lock:
            self._recent[id(index)] = (weakref.ref(index), generation)
            while len(self._recent) > _RECENT_SAMPLES:
                self._recent.popitem(last=False)

    def _recall(self, index: object) -> torch.Tensor | None:
        with self._lock:
            got = self._recent.get(id(index))
        if got is None or got[0]() is not index:
            return None
        return got[1]

    def add(self, index: int | torch.Tensor) -> None:
        return None  # the append gave the row the max priority on the server

    def extend(self, index: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        return None

    def mark_update(self, index: int | torch.Tensor, *, storage: Storage | None = None) -> None:
        """Nothing to do: an append gives its rows the max priority in its own step. (Rows
        written at explicit indices keep the priority they had.)"""
        return None

    @torch.no_grad()
    def update_priority(  # type: ignore[override]
        self,
        index: int | torch.Tensor | tuple[torch.Tensor, ...],
        priority: float | torch.Tensor,
        *,
        storage: Storage | None = None,
        generation: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Sets the priority of rows ``index`` on the server; returns which were applied.

        ``generation`` defaults to that of the sample ``index`` came from (when ``index`` is
        the very tensor of one of the last 32 samples): rows appended to since then are left
        alone. Priorities that are all NaN (TorchRL's default-priority fills) change nothing.
        """
        recalled = self._recall(index)
        if isinstance(index, tuple):
            if len(index) != 1:
                raise ValueError(f"TensorDictStorePrioritizedSampler: a 1-D storage takes 1-D indices, got {len(index)}")
            index = index[0]
        rows = torch.as_tensor(index).reshape(-1)
        pri = torch.as_tensor(priority).detach()
        if pri.is_floating_point() and pri.numel() and bool(torch.isnan(pri).all()):
            return torch.zeros(rows.numel(), dtype=torch.bool)
        store = self._store_of(storage)
        if store is None:
            raise RuntimeError("TensorDictStorePrioritizedSampler.update_priority: the storage holds no store yet")
        if generation is None:
            generation = recalled
        if generation is not None and generation.numel() != rows.numel():
            generation = None  # (the buffer reshaped the index: no per-row generation to match)
        return store.update_priority(rows.cpu(), pri, generation=generation)

    # ------------------------------------------------------------------ state
    def _empty(self) -> None:
        """rb.empty(): the storage sets the ring's count to 0, which resets the server's tree."""
        with self._lock:
            self._recent.clear()

    def state_dict(self) -> dict[str, object]:
        """The settings, and (once used with a storage) every row's priority and the max priority."""
        state: dict[str, object] = {"alpha": self._alpha, "beta": self._beta, "eps": self._eps, "arity": self._arity}
        store = self._known_store()
        read = None if store is None else _read_priorities(store)
        if read is not None:
            state["priority"], state["max_priority"] = read
        elif self._pending is not None and "priority" in self._pending:
            state["priority"], state["max_priority"] = self._pending["priority"], self._pending.get("max_priority", math.nan)
        return state

    def load_state_dict(self, state_dict: Mapping[str, object]) -> None:
        """Restores the settings and the priorities (written into the store now, or at the first use)."""
        for name in ("alpha", "beta", "eps"):
            value = state_dict.get(name)
            if isinstance(value, (int, float)):
                setattr(self, f"_{name}", float(value))
        arity = state_dict.get("arity")
        if isinstance(arity, int):
            self._arity = arity
        self._pending = dict(state_dict)
        store, self._store = self._known_store(), None
        if store is not None:
            self._attach(store)  # (the buffer loaded the storage first, which reset the tree)

    def dumps(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), path / "sampler.pt")

    def loads(self, path: str | os.PathLike[str]) -> None:
        self.load_state_dict(torch.load(Path(path) / "sampler.pt", weights_only=True))

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state["_rng"] = None
        state.pop("_lock", None)
        state.pop("_recent", None)
        state["_storage_ref"] = None
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._init_local()


class TensorDictStorePrioritizedReplayBuffer(TensorDictPrioritizedReplayBuffer):
    """TorchRL's ``TensorDictPrioritizedReplayBuffer`` with a :class:`TensorDictStorePrioritizedSampler`.

    TorchRL's class builds its own ``PrioritizedSampler`` (which needs TorchRL's C++
    extension) and takes no ``sampler=``; this subclass takes the same arguments and uses the
    server-side sampler instead, with a :class:`TensorDictStoreWriter` unless ``writer=`` is
    given. ``storage`` must be a :class:`TensorDictStoreStorage`. ``sync=False`` is not
    supported (every process samples from the server's priorities).
    """

    def __init__(
        self,
        *,
        alpha: float,
        beta: float,
        storage: TensorDictStoreStorage,
        priority_key: str = "td_error",
        eps: float = 1e-8,
        reduction: str = "max",
        writer: Writer | None = None,
        **kwargs: object,
    ) -> None:
        if not isinstance(storage, TensorDictStoreStorage):
            raise TypeError(f"{type(self).__name__} needs a TensorDictStoreStorage, got {type(storage).__name__}")
        if kwargs.pop("sync", True) is not True:
            raise ValueError(f"{type(self).__name__}: sync=False is not supported (the priorities live on the server)")
        if kwargs.pop("sampler_device", None) is not None:
            raise ValueError(f"{type(self).__name__}: sampler_device is not supported (the priorities live on the server)")
        self._sync = True
        self._prioritized_sampler = None
        self._prioritized_sampler_write_count = 0
        sampler = TensorDictStorePrioritizedSampler(alpha, beta, eps, reduction=reduction)
        sampler._bind(storage)
        TensorDictReplayBuffer.__init__(
            self, priority_key=priority_key, storage=storage, sampler=sampler,
            writer=writer if writer is not None else TensorDictStoreWriter(), **kwargs,
        )


def prioritized_replay_buffer(
    storage: TensorDictStoreStorage,
    alpha: float,
    beta: float,
    eps: float = 1e-8,
    *,
    tensordict: bool = True,
    priority_key: str = "td_error",
    batch_size: int | None = None,
    **kwargs: object,
) -> ReplayBuffer:
    """A TorchRL prioritized replay buffer on ``storage`` whose priorities live on the server.

    ``tensordict=True``: a :class:`TensorDictStorePrioritizedReplayBuffer` (a
    ``TensorDictPrioritizedReplayBuffer``: samples carry ``"index"``, ``"_weight"``,
    ``"priority_weight"`` and ``"generation"``; ``rb.update_tensordict_priority(batch)`` reads
    ``priority_key``). ``tensordict=False``: TorchRL's ``PrioritizedReplayBuffer`` given a
    :class:`TensorDictStorePrioritizedSampler`. Both append through a :class:`TensorDictStoreWriter`.
    """
    if tensordict:
        return TensorDictStorePrioritizedReplayBuffer(
            alpha=alpha, beta=beta, eps=eps, storage=storage, priority_key=priority_key, batch_size=batch_size,
            **kwargs,  # type: ignore[arg-type]  # (TorchRL's keywords, passed on)
        )
    sampler = TensorDictStorePrioritizedSampler(alpha, beta, eps)
    sampler._bind(storage)
    rb = PrioritizedReplayBuffer(
        alpha=alpha, beta=beta, eps=eps, storage=storage, sampler=sampler, batch_size=batch_size, **kwargs,
    )
    rb.set_writer(TensorDictStoreWriter())
    return rb
