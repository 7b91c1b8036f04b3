"""TorchRL's slice samplers with the slices chosen on the server (``store.sample_slices``).

TorchRL's ``SliceSampler`` finds the episodes in the learner's process: it reads the whole
``end_key`` (or ``traj_key``) column of the storage at every sample, which over a network
means a column read per batch. :class:`TensorDictStoreSliceSampler` asks the server instead:
:meth:`tdstore.TensorDictStore.sample_slices` draws the slices from an episode index that
the appends maintain, and reads their rows in the same call, so ``rb.sample()`` is one
draw and one read, whatever the size of the buffer. :class:`TensorDictStorePrioritizedSliceSampler`
draws the slices by the priority of their start row (``store.enable_priorities``), shared
by every process, and sends ``rb.update_priority`` to the server.

What a sample returns is TorchRL's: ``batch_size`` rows, ``num_slices`` slices of
``batch_size // num_slices`` rows one after the other, and in the info (written into the
batch by a ``TensorDictReplayBuffer``) ``truncated_key`` set on the last row of each slice,
``done`` (the stored one or-ed with it), ``terminated`` and, when the storage holds it,
``init_key`` set on the first row of each slice.

What differs, each refused with a clear error rather than done differently:

* a slice is always ``slice_len`` rows within one episode (TorchRL's ``strict_length=True``,
  its default): ``strict_length=False``, ``pad_output`` and ``span`` are refused;
* the episodes come from one key, ``end_key`` or ``traj_key`` (``end_keys``, ``fragmented``,
  ``ends``, ``trajectories``, ``cache_values``, ``compile`` and ``use_gpu`` are refused:
  the server keeps the index, there is nothing to cache or compile);
* a slice never crosses the ring's write position, and only rows appended through the
  store's cursor (``TensorDictStoreWriter``, ``store.extend``) are in the episode index.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl.data import TensorDictReplayBuffer
    >>> from tdstore.torchrl import TensorDictStoreSliceSampler, TensorDictStoreStorage, TensorDictStoreWriter
    >>> done = torch.zeros(20, 1, dtype=torch.bool)
    >>> done[[4, 9, 19]] = True                      # three episodes: rows 0-4, 5-9, 10-19
    >>> rb = TensorDictReplayBuffer(
    ...     storage=TensorDictStoreStorage(100), writer=TensorDictStoreWriter(),
    ...     sampler=TensorDictStoreSliceSampler(slice_len=4), batch_size=8,
    ... )
    >>> rb.extend(TensorDict(obs=torch.arange(20), next=TensorDict(done=done, batch_size=[20]), batch_size=[20]))
    tensor([ 0,  1,  2,  3,  4,  5,  6,  7,  8,  9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19])
    >>> batch = rb.sample()
    >>> slices = batch["obs"].view(2, 4)
    >>> bool(((slices[:, 1:] - slices[:, :-1]) == 1).all())   # consecutive rows
    True
    >>> batch["next", "truncated"].view(2, 4)[:, -1].all().item()
    True
    >>> rb.storage.store.clear_redis()
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDictBase

from tdstore.replay import priorities as _priorities
from tdstore.store import TensorDictStore
from tdstore.torchrl.prioritized import TensorDictStorePrioritizedSampler
from tdstore.torchrl.storage import TensorDictStoreStorage

try:
    from torchrl.data.replay_buffers.samplers import SliceSampler
    from torchrl.data.replay_buffers.storages import Storage
except ImportError as exc:  # pragma: no cover - exercised by the main env, which has no torchrl
    raise ImportError(
        "tdstore.torchrl needs TorchRL: pip install 'tdstore[torchrl]' (torchrl>=0.14.1, which "
        f"pins tensordict<0.15,>=0.14.3); importing torchrl failed: {exc}"
    ) from exc

if TYPE_CHECKING:
    from tensordict import NestedKey

__all__ = ["TensorDictStoreSliceSampler", "TensorDictStorePrioritizedSliceSampler"]

#: TorchRL's end key and trajectory key when neither is given (``SliceSampler``'s defaults).
DEFAULT_END_KEY: tuple[str, str] = ("next", "done")
DEFAULT_TRAJ_KEY = "episode"

#: TorchRL ``SliceSampler`` arguments the server's slices do not do, and why (the error says so).
_REFUSED: dict[str, tuple[object, str]] = {
    "end_keys": (None, "give one end_key (the server indexes the episodes by one key)"),
    "fragmented": (False, "the server's slices are runs of consecutive appended rows"),
    "ends": (None, "the server keeps the episode index; give end_key or traj_key"),
    "trajectories": (None, "the server keeps the episode index; give end_key or traj_key"),
    "cache_values": (False, "the server keeps the episode index: there is nothing to cache"),
    "compile": (False, "the slices are chosen on the server: there is nothing to compile"),
    "use_gpu": (False, "the slices are chosen on the server"),
    "span": (False, "a slice is always slice_len rows within one episode"),
    "pad_output": (False, "a slice is always slice_len rows within one episode"),
    "strict_length": (True, "a slice is always slice_len rows within one episode (strict_length=True)"),
    "step_key": ("step_count", "it is used by fragmented=True only, which is not supported"),
}


def _key(key: NestedKey) -> str | tuple[str, ...]:
    if isinstance(key, str):
        return key
    parts = tuple(key)
    if not parts or not all(isinstance(part, str) for part in parts):
        raise TypeError(f"a key is a str or a tuple of str, got {key!r}")
    return tuple(str(part) for part in parts)


class _Slices:
    """The slice settings of a sampler and the server call they make (shared by both samplers)."""

    def __init__(
        self,
        who: str,
        num_slices: int | None,
        slice_len: int | None,
        end_key: NestedKey | None,
        traj_key: NestedKey | None,
        truncated_key: NestedKey | None,
        init_key: NestedKey | None,
        refused: Mapping[str, object],
    ) -> None:
        for name, value in refused.items():
            if name not in _REFUSED:
                raise TypeError(f"{who}: unexpected keyword argument {name!r}")
            default, why = _REFUSED[name]
            if value != default:
                raise ValueError(f"{who}: {name}={value!r} is not supported: {why}")
        if (num_slices is None) == (slice_len is None):
            raise TypeError(f"{who}: give exactly one of num_slices= and slice_len=")
        for name, value in (("num_slices", num_slices), ("slice_len", slice_len)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{who}: {name} must be an int >= 1, got {value!r}")
        if end_key is not None and traj_key is not None:
            raise ValueError(f"{who}: give end_key= or traj_key=, not both")
        self.who = who
        self.num_slices = num_slices
        self.slice_len = slice_len
        self.end_key = None if end_key is None else _key(end_key)
        self.traj_key = None if traj_key is None else _key(traj_key)
        self.truncated_key = None if truncated_key is None else _key(truncated_key)
        self.init_key = None if init_key is None else _key(init_key)

    def shape(self, batch_size: int) -> tuple[int, int]:
        """``(num_slices, slice_len)`` of a batch of ``batch_size`` rows (TorchRL's rule)."""
        per, name = (
            (self.num_slices, "number of slices") if self.num_slices is not None else (self.slice_len, "slice length")
        )
        assert per is not None
        if batch_size % per:
            raise RuntimeError(f"{self.who}: the batch size {batch_size} is not divisible by the {name} {per}")
        return (per, batch_size // per) if self.num_slices is not None else (batch_size // per, per)

    def keys(self, store: TensorDictStore) -> tuple[str | tuple[str, ...] | None, str | tuple[str, ...] | None]:
        """``(end_key, traj_key)`` to give ``sample_slices``: the one given, else TorchRL's
        rule (``"episode"`` when the store has it, else ``("next", "done")``)."""
        if self.traj_key is not None or self.end_key is not None:
            return self.end_key, self.traj_key
        if DEFAULT_TRAJ_KEY in store.keys():
            return None, DEFAULT_TRAJ_KEY
        return DEFAULT_END_KEY, None

    def slice_info(self, batch: TensorDictBase, num_slices: int, slice_len: int) -> dict[NestedKey, torch.Tensor]:
        """TorchRL's slice info: truncated / done / terminated, and the init marker."""
        info: dict[NestedKey, torch.Tensor] = {}
        n = num_slices * slice_len
        if self.truncated_key is not None:
            truncated = torch.zeros(n, 1, dtype=torch.bool)
            truncated.view(num_slices, slice_len)[:, -1] = True
            stem = self.truncated_key[:-1] if isinstance(self.truncated_key, tuple) else ()
            done_key = (*stem, "done") if stem else "done"
            terminated_key = (*stem, "terminated") if stem else "terminated"
            done = batch.get(done_key, None)
            done = truncated.clone() if done is None else done.reshape(truncated.shape).bool() | truncated
            terminated = batch.get(terminated_key, None)
            terminated = (
                torch.zeros_like(truncated) if terminated is None else terminated.reshape(truncated.shape).bool()
            )
            info.update({self.truncated_key: truncated, done_key: done, terminated_key: terminated})
        if self.init_key is not None:
            stored = batch.get(self.init_key, None)
            if stored is not None:
                marker = torch.zeros_like(stored, dtype=torch.bool)
                marker[torch.arange(num_slices) * slice_len] = True
                info[self.init_key] = marker | stored.bool()
        return info


def _store_of(who: str, storage: Storage) -> tuple[TensorDictStoreStorage, TensorDictStore]:
    if not isinstance(storage, TensorDictStoreStorage) or storage._holds_shards:
        raise TypeError(f"{who} needs a TensorDictStoreStorage, got {type(storage).__name__}")
    store = storage._storage
    if store is None:
        raise RuntimeError("Cannot sample from an empty storage.")
    return storage, store


def _on_device(storage: TensorDictStoreStorage, index: torch.Tensor) -> torch.Tensor:
    if storage.device != "auto" and torch.device(storage.device).type != "cpu":
        return index.to(storage.device)  # (the buffer moves it there before storage.get)
    return index


class TensorDictStoreSliceSampler(SliceSampler):
    """TorchRL's ``SliceSampler`` (with replacement) with the slices drawn on the server.

    Takes TorchRL's arguments: exactly one of ``num_slices`` and ``slice_len``; ``end_key``
    or ``traj_key`` (neither: ``"episode"`` when the storage has that entry, else
    ``("next", "done")``, as TorchRL); ``truncated_key`` and ``init_key``. The storage must
    be a :class:`~tdstore.torchrl.TensorDictStoreStorage` whose rows were appended through
    the store's cursor (:class:`~tdstore.torchrl.TensorDictStoreWriter`).

    Raises:
        TypeError: an unknown argument, or not exactly one of ``num_slices``/``slice_len``.
        ValueError: an argument TorchRL has that the server's slices do not do (the message
            says why), or both keys.
    """

    def __init__(
        self,
        *,
        num_slices: int | None = None,
        slice_len: int | None = None,
        end_key: NestedKey | None = None,
        traj_key: NestedKey | None = None,
        truncated_key: NestedKey | None = ("next", "truncated"),
        init_key: NestedKey | None = "is_init",
        **refused: object,
    ) -> None:
        # (SliceSampler.__init__ is not called: it sets up the column reads and caches this replaces)
        self._slices = _Slices(
            type(self).__name__, num_slices, slice_len, end_key, traj_key, truncated_key, init_key, refused
        )
        self.num_slices = num_slices
        self.slice_len = slice_len
        self.end_key = self._slices.end_key
        self.traj_key = self._slices.traj_key
        self.truncated_key = self._slices.truncated_key
        self.init_key = self._slices.init_key
        self.strict_length = True
        self.span = (False, False)
        self.fragmented = False
        self._fragmented_index = None
        self._batch_size_multiplier: int | None = None
        self.cache_values = False
        self._cache: dict[str, object] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_slices={self.num_slices}, slice_len={self.slice_len}, end_key={self.end_key}, traj_key={self.traj_key})"

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict[NestedKey, object]]:
        """Draws the slices on the server and reads their rows (handed to ``storage``);
        returns ``(index, info)`` as TorchRL's ``SliceSampler`` does (the index as one 1-D
        tensor of ring rows, where TorchRL's is a tuple of one)."""
        if self._batch_size_multiplier is not None:
            batch_size *= self._batch_size_multiplier
        storage, store = _store_of(type(self).__name__, storage)
        num_slices, slice_len = self._slices.shape(batch_size)
        end_key, traj_key = self._slices.keys(store)
        batch, got = store.sample_slices(
            num_slices, slice_len, end_key=end_key, traj_key=traj_key, generator=self._rng, return_info=True
        )
        index = _on_device(storage, got["index"])
        storage._hand_over(index, batch)
        info: dict[NestedKey, object] = dict(self._slices.slice_info(batch, num_slices, slice_len))
        return index, info

    def extend(self, index: torch.Tensor) -> None:
        return None  # the append updated the server's episode index in its own step

    def add(self, index: torch.Tensor) -> None:
        return None

    def mark_update(self, index: int | torch.Tensor, *, storage: Storage | None = None) -> None:
        return None

    def _sampleable_count(self, storage: Storage, batch_size: int) -> int:
        return 0 if len(storage) == 0 else 1  # (the server knows; a sample of nothing raises ValueError)

    def _empty(self) -> None:
        return None

    def state_dict(self) -> dict[str, object]:
        return {}

    def load_state_dict(self, state_dict: Mapping[str, object]) -> None:
        return None

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state["_rng"] = None
        return state


class TensorDictStorePrioritizedSliceSampler(TensorDictStorePrioritizedSampler):
    """Slices drawn by the priority of their start row, the priorities on the server.

    Takes the prioritized sampler's ``alpha``, ``beta``, ``eps`` (and ``arity``) and the
    slice sampler's arguments (:class:`TensorDictStoreSliceSampler`). A slice starting at
    row ``i`` is drawn with probability ``(q_i + eps) ** alpha / sum``; its importance
    weight (``info["_weight"]``, TorchRL's formula, normalized by the max weight) is given to
    each of its rows. ``rb.update_priority(info["index"], priority)`` sets the priority of
    every row of the slices (each one the start of the slices that may be drawn from it),
    left alone on the rows appended to since the sample. TorchRL's ``PrioritizedSliceSampler``
    draws by the priority of every row instead; with one priority per episode the two agree.
    """

    def __init__(
        self,
        alpha: float,
        beta: float,
        eps: float = 1e-8,
        *,
        num_slices: int | None = None,
        slice_len: int | None = None,
        end_key: NestedKey | None = None,
        traj_key: NestedKey | None = None,
        truncated_key: NestedKey | None = ("next", "truncated"),
        init_key: NestedKey | None = "is_init",
        arity: int = _priorities.DEFAULT_ARITY,
        max_capacity: int | None = None,
        max_priority_within_buffer: bool = False,
        **refused: object,
    ) -> None:
        super().__init__(alpha, beta, eps, arity=arity, max_priority_within_buffer=max_priority_within_buffer)
        self._slices = _Slices(
            type(self).__name__, num_slices, slice_len, end_key, traj_key, truncated_key, init_key, refused
        )
        self.num_slices = num_slices
        self.slice_len = slice_len
        self._max_capacity = max_capacity  # (TorchRL's tree size; the server's tree spans the ring)

    def __repr__(self) -> str:
        where = self._store._where() if self._store is not None else "<no store yet>"
        return (
            f"{type(self).__name__}(alpha={self._alpha}, beta={self._beta}, eps={self._eps}, "
            f"num_slices={self.num_slices}, slice_len={self.slice_len}, store={where})"
        )

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict[NestedKey, object]]:  # type: ignore[override]
        """Draws the slices by priority on the server and reads their rows (handed to
        ``storage``); returns ``(index, info)`` with TorchRL's slice info and the weights."""
        who = type(self).__name__
        storage, _ = _store_of(who, storage)
        store = self._store_of(storage)
        assert store is not None
        num_slices, slice_len = self._slices.shape(batch_size)
        end_key, traj_key = self._slices.keys(store)
        draw = dict(end_key=end_key, traj_key=traj_key, prioritized=True, generator=self._rng, return_info=True)
        try:
            batch, got = store.sample_slices(num_slices, slice_len, **draw)
        except ValueError:
            if store.priority_settings() is not None:
                raise
            self._enable(store)  # turned off meanwhile (disable_priorities() from another process)
            batch, got = store.sample_slices(num_slices, slice_len, **draw)
        index = flat = _on_device(storage, got["index"])
        storage._hand_over(index, batch)
        generation = self._generations(store, got["generation"], flat.cpu(), slice_len)
        self._remember(flat, generation)
        weight = got["_weight"].repeat_interleave(slice_len)
        info: dict[NestedKey, object] = dict(self._slices.slice_info(batch, num_slices, slice_len))
        info.update({"_weight": weight, "priority_weight": weight, "generation": generation})
        return index, info

    @staticmethod
    def _generations(
        store: TensorDictStore, start_gens: torch.Tensor, rows: torch.Tensor, slice_len: int
    ) -> torch.Tensor:
        """The generation of every row of the slices (for ``update_priority``). A row appended
        with priorities on holds generation ``position + 1`` (lua/prio_new.lua), and a slice's
        rows were appended one after the other: ``start's + k``. A start of generation 0 was
        appended before priorities were enabled, and its later rows may or may not have been:
        those slices' generations are read from the server (one more read, only until the
        ring has come round once since enabling)."""
        steps = torch.arange(slice_len, dtype=torch.long)
        gens = (start_gens.to(torch.long).unsqueeze(1) + steps).clone()
        unknown = start_gens == 0
        if bool(unknown.any()):
            grid = rows.reshape(-1, slice_len)
            gens[unknown] = _priorities.generations(store, grid[unknown]).reshape(-1, slice_len)
        return gens.reshape(-1)

    def _sampleable_count(self, storage: Storage, batch_size: int) -> int:
        return 0 if len(storage) == 0 else 1
