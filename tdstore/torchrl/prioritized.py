"""TorchRL's prioritized sampler and buffer with the priorities on the server (see :mod:`tdstore.torchrl`)."""

from __future__ import annotations

import math
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

import torch
from tensordict import TensorDictBase

from tdstore.replay import priorities as _priorities
from tdstore.sharded import ShardedStore
from tdstore.store import TensorDictStore
from tdstore.torchrl.storage import TensorDictStoreStorage

try:
    from torchrl.data.replay_buffers.replay_buffers import (
        PrioritizedReplayBuffer,
        ReplayBuffer,
        TensorDictPrioritizedReplayBuffer,
        TensorDictReplayBuffer,
    )
    from torchrl.data.replay_buffers.samplers import PrioritizedSampler
    from torchrl.data.replay_buffers.storages import Storage
    from torchrl.data.replay_buffers.writers import Writer
except ImportError as exc:  # pragma: no cover - exercised by the main env, which has no torchrl
    raise ImportError(
        "tdstore.torchrl needs TorchRL: pip install 'tdstore[torchrl]' (torchrl>=0.14.1, which "
        f"pins tensordict<0.15,>=0.14.3); importing torchrl failed: {exc}"
    ) from exc

__all__ = ["TensorDictStorePrioritizedSampler", "TensorDictStorePrioritizedReplayBuffer", "prioritized_replay_buffer"]

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

    The first use with a storage (its store made by the first write, before the rows are
    appended; or a sample, an update, a load) enables priorities on its
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

    #: a storage that loads a state dict binds itself to this sampler (TensorDictStoreStorage)
    _binds_to_store_storage = True

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
                raise ValueError(
                    f"TensorDictStorePrioritizedSampler: {name} must be a finite number >= 0, got {value!r}"
                )
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
            saved = self._read(store)
            self._enable(store)
            if saved is not None:
                self._write(store, *saved)

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
    #: what this sampler's storage must be (named in the TypeError of another one)
    _storage_name = "TensorDictStoreStorage"

    def _accepts(self, storage: Storage) -> bool:
        return isinstance(storage, TensorDictStoreStorage) and not storage._holds_shards

    def _read(self, store: TensorDictStore) -> tuple[torch.Tensor, float] | None:
        """Every row's priority and the max priority (:func:`_read_priorities`); None when off."""
        return _read_priorities(store)

    def _write(self, store: TensorDictStore, q: torch.Tensor, top: float) -> None:
        """Writes back what :meth:`_read` read (:func:`_write_priorities`)."""
        _write_priorities(store, q, top)

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
        if not self._accepts(storage):
            raise TypeError(f"{type(self).__name__} needs a {self._storage_name}, got {type(storage).__name__}")
        assert isinstance(storage, TensorDictStoreStorage)
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
            self._write(store, saved, float(top) if isinstance(top, (int, float)) else math.nan)

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
        return self._pass_rows(storage, batch, info)

    def _pass_rows(
        self, storage: TensorDictStoreStorage, batch: TensorDictBase, info: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Hands the rows read with the draw to ``storage`` (its next ``get`` of ``index`` returns
        them), remembers their generations; returns ``(index, info)`` as TorchRL's sampler does."""
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
                raise ValueError(
                    f"TensorDictStorePrioritizedSampler: a 1-D storage takes 1-D indices, got {len(index)}"
                )
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
        read = None if store is None else self._read(store)
        if read is not None:
            state["priority"], state["max_priority"] = read
        elif self._pending is not None and "priority" in self._pending:
            state["priority"], state["max_priority"] = (
                self._pending["priority"],
                self._pending.get("max_priority", math.nan),
            )
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
    given. ``storage`` must be a :class:`TensorDictStoreStorage`, or a
    :class:`~tdstore.torchrl.ShardedStoreStorage` (then the sampler is a
    :class:`~tdstore.torchrl.ShardedStorePrioritizedSampler` and the writer a
    :class:`~tdstore.torchrl.ShardedStoreWriter`). ``sync=False`` is not supported (every
    process samples from the server's priorities).
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
            raise ValueError(
                f"{type(self).__name__}: sampler_device is not supported (the priorities live on the server)"
            )
        self._sync = True
        self._prioritized_sampler = None
        self._prioritized_sampler_write_count = 0
        sampler = _sampler_for(storage, alpha, beta, eps, reduction)
        TensorDictReplayBuffer.__init__(
            self,
            priority_key=priority_key,
            storage=storage,
            sampler=sampler,
            writer=writer if writer is not None else storage._default_writer(),
            **kwargs,
        )


#: The sampler and the storage of a ShardedStore, registered by tdstore/torchrl/sharded.py
#: (which imports this module: importing it back would be a cycle). Importing this module
#: runs ``tdstore/torchrl/__init__.py`` first, which imports both, so they are always set.
_SHARDED: dict[str, type] = {}


def register_sharded(sampler: type[TensorDictStorePrioritizedSampler], storage: type[TensorDictStoreStorage]) -> None:
    """Called by tdstore/torchrl/sharded.py: the classes :func:`prioritized_replay_buffer` uses for a ShardedStore."""
    _SHARDED["sampler"], _SHARDED["storage"] = sampler, storage


def _sharded(what: str) -> type:
    return _SHARDED[what]  # (importing this module runs tdstore/torchrl/__init__.py, which imports sharded.py)


def _sampler_for(
    storage: TensorDictStoreStorage, alpha: float, beta: float, eps: float, reduction: str = "max"
) -> TensorDictStorePrioritizedSampler:
    """The prioritized sampler of ``storage``'s kind (one store, or a ShardedStore), bound to it."""
    kind = _sharded("sampler") if storage._holds_shards else TensorDictStorePrioritizedSampler
    sampler = kind(alpha, beta, eps, reduction=reduction)
    sampler._bind(storage)
    return sampler


def prioritized_replay_buffer(
    storage: TensorDictStoreStorage | ShardedStore,
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

    ``storage`` may also be a :class:`~tdstore.torchrl.ShardedStoreStorage` or a
    :class:`~tdstore.ShardedStore` (wrapped in one): the buffer then samples the union of
    the shards with a :class:`~tdstore.torchrl.ShardedStorePrioritizedSampler` and appends
    through a :class:`~tdstore.torchrl.ShardedStoreWriter`.
    """
    if isinstance(storage, ShardedStore):
        storage = _sharded("storage")(store=storage)
    if not isinstance(storage, TensorDictStoreStorage):
        raise TypeError(
            "prioritized_replay_buffer() needs a TensorDictStoreStorage, a ShardedStoreStorage or a ShardedStore, "
            f"got {type(storage).__name__}"
        )
    if tensordict:
        return TensorDictStorePrioritizedReplayBuffer(
            alpha=alpha,
            beta=beta,
            eps=eps,
            storage=storage,
            priority_key=priority_key,
            batch_size=batch_size,
            **kwargs,  # type: ignore[arg-type]  # (TorchRL's keywords, passed on)
        )
    sampler = _sampler_for(storage, alpha, beta, eps)
    rb = PrioritizedReplayBuffer(
        alpha=alpha,
        beta=beta,
        eps=eps,
        storage=storage,
        sampler=sampler,
        batch_size=batch_size,
        **kwargs,
    )
    rb.set_writer(storage._default_writer())
    return rb
