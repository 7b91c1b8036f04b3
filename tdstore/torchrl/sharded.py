"""TorchRL's storage, writer and prioritized sampler over a :class:`~tdstore.ShardedStore`.

A :class:`~tdstore.ShardedStore` splits one buffer into shards (blocks of ``block_rows`` rows,
each a store with a hash tag of its own, so the shards spread over a Redis Cluster's
masters); its ring (tdstore/sharded_ring.py) appends to one shard per call and samples the
union of the shards on the servers. The classes here put that ring behind TorchRL's
interfaces:

* :class:`ShardedStoreStorage`: ``len()`` is the valid rows of all shards, ``get(index)``
  reads rows by their index in the whole buffer, and the uniform draw of TorchRL's
  ``RandomSampler`` is the ring's union sample (``ShardedStore.sample``): the rows it read
  are handed to the ``get()`` that follows, which does not read them again.
* :class:`ShardedStoreWriter`: ``extend`` appends through ``ShardedStore.extend`` (the shards
  in turn, or the one ``pin_shard=`` names) and returns indices in the whole buffer.
* :class:`ShardedStorePrioritizedSampler`: TorchRL's proportional prioritized sampler with
  the priorities on the shards; ``sample`` draws from the union (the union's importance
  weights) and ``update_priority`` routes each row to its shard, with the generations of
  the sample it came from.

Examples:
    The classes need a :class:`~tdstore.ShardedStore` on the server (one server here; a
    cluster's ``cluster_nodes=`` spreads the shards over its masters):

    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl.data import ReplayBuffer
    >>> from tdstore.torchrl import ShardedStoreStorage, ShardedStoreWriter
    >>> rb = ReplayBuffer(storage=ShardedStoreStorage(30, shards=3), writer=ShardedStoreWriter(pin_shard=1),
    ...                   batch_size=4)
    >>> rb.extend(TensorDict(obs=torch.arange(4.0)[:, None], batch_size=[4]))    # shard 1: rows 10 to 19
    tensor([10, 11, 12, 13])
    >>> set(rb.sample()["obs"][:, 0].tolist()) <= {0.0, 1.0, 2.0, 3.0}
    True
    >>> rb.storage.store.clear_redis()
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, cast

import torch
from tensordict import TensorDict, TensorDictBase

from tdstore.errors import SchemaError, StoreExistsError, StoreNotFoundError
from tdstore.sharded import ShardedStore
from tdstore.torchrl.prioritized import (
    TensorDictStorePrioritizedSampler,
    _read_priorities,
    _write_priorities,
    register_sharded,
)
from tdstore.torchrl.storage import TensorDictStoreStorage, TensorDictStoreWriter, _as_tensordict

if TYPE_CHECKING:
    from tensordict.utils import IndexType
    from torchrl.data.replay_buffers.storages import Storage

__all__ = ["ShardedStoreStorage", "ShardedStoreWriter", "ShardedStorePrioritizedSampler"]


def _positive(value: object, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ValueError(f"ShardedStoreStorage: {name} must be an int >= 1, got {value!r}")
    return int(value)


class ShardedStoreStorage(TensorDictStoreStorage):
    """A TorchRL storage whose rows live in a :class:`~tdstore.ShardedStore` (see :mod:`tdstore.torchrl.sharded`).

    The ShardedStore is given (``store=``), found on the server by ``td_id=``, or created from
    the first data written: ``max_size`` rows split into shards of ``block_rows`` rows (or
    into ``shards`` shards of equal size), with the connection arguments given (for a
    cluster, ``cluster_nodes=[(host, port)]``). ``len(storage)`` is the valid rows of all
    shards, read from the servers. Rows are written by appends only (:class:`ShardedStoreWriter`):
    each append fills rows of one shard, which wrap inside that shard.

    Args:
        max_size (int, optional): the rows of the whole buffer. Defaults to those of ``store``,
            or of the ShardedStore found by ``td_id``; required otherwise.

    Keyword Args:
        store (ShardedStore, optional): an existing sharded buffer, used as is.
        td_id (str, optional): the buffer's id: connect to it if it exists, else create it
            under that id at the first write.
        block_rows (int, optional): rows per shard of a buffer created here.
        shards (int, optional): the number of shards of a buffer created here (``block_rows``
            is then ``ceil(max_size / shards)``). One of ``block_rows`` and ``shards`` is needed
            to create a buffer.
        device: where sampled rows are placed. Defaults to ``"cpu"``.
        **conn: connection arguments of every shard (``host``, ``port``, ``cluster_nodes``, ...).

    Raises:
        TypeError: ``store`` is not a ShardedStore, or written data is not a TensorDict.
        ValueError: a missing or inconsistent ``max_size``, ``block_rows`` or ``shards``.
        IndexError: ``get()`` of rows out of range or not appended yet.
    """

    _holds_shards: ClassVar[bool] = True
    _storage: ShardedStore | None  # type: ignore[assignment]

    def __init__(
        self,
        max_size: int | None = None,
        *,
        store: ShardedStore | None = None,
        td_id: str | None = None,
        block_rows: int | None = None,
        shards: int | None = None,
        device: torch.device | str = "cpu",
        **conn: object,
    ) -> None:
        if store is not None and not isinstance(store, ShardedStore):
            raise TypeError(f"ShardedStoreStorage: store= takes a ShardedStore, got {type(store).__name__}")
        if store is not None and (td_id is not None or conn):
            raise ValueError("ShardedStoreStorage: pass either store= or td_id=/connection arguments, not both")
        rows, per_block, count = (
            _positive(max_size, "max_size"),
            _positive(block_rows, "block_rows"),
            _positive(shards, "shards"),
        )
        if store is None and td_id is not None:
            try:
                store = ShardedStore.from_store(td_id=td_id, **self._conn_of(conn))
            except StoreNotFoundError:
                store = None  # created under td_id at the first write
        if store is not None:
            for name, want, got in (
                ("max_size", rows, len(store)),
                ("block_rows", per_block, store.block_rows),
                ("shards", count, store.num_blocks),
            ):
                if want is not None and want != got:
                    raise ValueError(
                        f"ShardedStoreStorage: {name}={want} does not match {store._where()}, which has {got}"
                    )
            rows, per_block = len(store), store.block_rows
        else:
            if rows is None:
                raise ValueError("ShardedStoreStorage needs max_size >= 1 (or an existing ShardedStore)")
            if per_block is None and count is None:
                raise ValueError(
                    f"ShardedStoreStorage({rows}): give block_rows= (rows per shard) or shards= (how many) to "
                    "create the ShardedStore"
                )
            if count is not None:
                if count > rows:
                    raise ValueError(f"ShardedStoreStorage: shards={count} is more than max_size={rows}")
                need = -(-rows // count)
                if per_block is not None and -(-rows // per_block) != count:
                    raise ValueError(
                        f"ShardedStoreStorage: block_rows={per_block} gives {-(-rows // per_block)} shards of "
                        f"{rows} rows, not shards={count}"
                    )
                per_block = per_block if per_block is not None else need
        super().__init__(rows, device=device)
        self._storage = store
        self.initialized = store is not None
        self._td_id = td_id
        self._store_kwargs = dict(conn)
        self._block_rows = per_block
        #: the ShardedStore was made by this storage (at the first write): its prioritized
        #: sampler enables the priorities; a given one must have them on already
        self._created = False

    @staticmethod
    def _conn_of(conn: Mapping[str, object]) -> dict[str, int]:
        # (typed for mypy only: the connection arguments are passed on to every shard's store as given)
        return cast("dict[str, int]", dict(conn))

    # ------------------------------------------------------------------ the store
    @property
    def store(self) -> ShardedStore:  # type: ignore[override]
        """The :class:`~tdstore.ShardedStore` that holds the rows (after the first write)."""
        if self._storage is None:
            raise RuntimeError("ShardedStoreStorage holds no ShardedStore yet: write some data first")
        return self._storage

    def _ensure_store(self, data: TensorDictBase, batched: bool) -> ShardedStore:  # type: ignore[override]
        if self._storage is not None:
            return self._storage
        schema, inner = self._schema_of(data, batched)
        assert self._block_rows is not None, "a storage without a ShardedStore knows its block_rows"
        try:
            store = ShardedStore.from_schema(
                schema,
                batch_size=[self.max_size, *inner],
                block_rows=self._block_rows,
                td_id=self._td_id,
                **self._conn_of(self._store_kwargs),
            )
        except StoreExistsError:
            # another process created it first under the same td_id
            assert self._td_id is not None, "from_schema raised StoreExistsError for a td_id of ours"
            store = ShardedStore.from_store(td_id=self._td_id, **self._conn_of(self._store_kwargs))
        self._storage = store
        self._created = True
        self.initialized = True
        self._attach_samplers()
        return store

    def _default_writer(self) -> ShardedStoreWriter:
        return ShardedStoreWriter()

    # ------------------------------------------------------------------ writes
    def extend(self, data: object, *, shard: int | None = None) -> torch.Tensor:  # type: ignore[override]
        """Appends the rows of ``data`` to one shard (``shard``, or the ShardedStore's next);
        returns their indices in the whole buffer. More rows than the shard holds go in
        chunks of its size, each one append (the later rows overwrite the earlier ones)."""
        td = _as_tensordict(data, "extend")
        store = self._ensure_store(td, batched=True)
        n = td.batch_size[0] if td.batch_dims else 0
        target = shard if shard is not None else store.pin_shard
        if target is not None and isinstance(target, numbers.Integral) and 0 <= int(target) < store.num_blocks:
            room = int(store.blocks[int(target)].batch_size[0])
        else:
            room = min(int(b.batch_size[0]) for b in store.blocks)  # (a bad shard: extend() names it)
        if n > room:
            index = torch.cat([store.extend(td[i : i + room], shard=shard) for i in range(0, n, room)])
        else:
            index = store.extend(td, shard=shard)
        self._set_last_cursor(index)
        self._bump_mutation_revision()
        return index

    def set(
        self, cursor: int | slice | list[int] | tuple[int, ...] | torch.Tensor, data: object, *, set_cursor: bool = True
    ) -> None:  # type: ignore[override]
        """Not supported: rows of a sharded ring are written by appends (rows written at an
        index would not count as appended in their shard's ring)."""
        where = self._storage._where() if self._storage is not None else "its ShardedStore"
        raise NotImplementedError(
            f"ShardedStoreStorage of {where} is written by appends only: use ShardedStoreWriter (rb.extend, "
            "rb.add); rows written at explicit indices (RoundRobinWriter, write_at, rb[index] = data) are not "
            "supported. Nothing was written"
        )

    # ------------------------------------------------------------------ reads
    def _appended(self) -> torch.Tensor:
        """A mask over the whole buffer's rows: those appended to (each shard's ring, read now)."""
        store = self.store
        mask = torch.zeros(len(store), dtype=torch.bool)
        for shard, state in enumerate(store.ring_state().shards):
            lo = shard * store.block_rows
            mask[lo : lo + min(state.total, state.capacity)] = True
        return mask

    def _rows_of(self, index: IndexType) -> int | torch.Tensor:
        """The buffer's row numbers that ``index`` names, each checked to be an appended row."""
        store = self.store
        readable = self._appended()
        if isinstance(index, slice) or index is Ellipsis:
            return readable.nonzero().squeeze(1)[index]  # (the appended rows, in order)
        if isinstance(index, numbers.Integral) and not isinstance(index, bool):
            rows = torch.tensor([int(index)])
        else:
            if isinstance(index, (Sequence, range)) and not isinstance(index, (str, bytes)):
                index = torch.as_tensor(index, dtype=torch.long) if len(index) else torch.empty(0, dtype=torch.long)
            if not isinstance(index, torch.Tensor) or index.dtype.is_floating_point or index.dtype == torch.bool:
                raise TypeError(
                    f"ShardedStoreStorage.get() of {store._where()} takes rows of the whole buffer: an int, a "
                    f"slice, or a sequence or integer tensor of rows; got {type(index).__name__}"
                    + (f" of dtype {index.dtype}" if isinstance(index, torch.Tensor) else "")
                )
            rows = index.reshape(-1).to(torch.long)
        out = (rows < 0) | (rows >= len(store))
        if bool(out.any()):
            raise IndexError(
                f"row {int(rows[out][0])} is out of range for {store._where()}: rows are 0 to {len(store) - 1}"
            )
        missing = ~readable[rows]
        if bool(missing.any()):
            row = int(rows[missing][0])
            shard, lo = row // store.block_rows, row // store.block_rows * store.block_rows
            held = int(readable[lo : lo + store.block_rows].sum())
            raise IndexError(
                f"row {row} of {store._where()} holds no appended data yet: shard {shard} has {held} rows "
                f"appended (rows {lo} to {lo + held - 1})"
            )
        if isinstance(index, numbers.Integral):
            return int(rows[0])
        return rows.reshape(index.shape) if isinstance(index, torch.Tensor) and index.ndim == 1 else rows

    def get(self, index: IndexType) -> TensorDictBase:
        """Reads rows (the whole buffer's numbering) among those appended, into memory."""
        if self._storage is None:
            raise RuntimeError("Cannot get elements out of a non-initialized storage.")
        handed = self._take_handed_over(index)
        if handed is None:
            handed = self._storage[self._rows_of(index)]
        if self.device != "auto" and torch.device(self.device).type != "cpu":
            handed = handed.to(self.device)
        return handed

    def _rand_given_ndim(self, batch_size: int) -> torch.Tensor:
        """TorchRL's uniform draw: the ShardedStore's union sample, on the servers; the rows it
        read are handed to the ``get()`` of the returned index (no second read)."""
        if self._storage is None:
            raise RuntimeError("Cannot sample from an empty storage.")
        return self._sample_handed_over(batch_size)

    def contains(self, item: object) -> bool | torch.Tensor:
        if self._storage is None:
            return False if isinstance(item, int) else torch.zeros(torch.as_tensor(item).shape, dtype=torch.bool)
        readable = self._appended()
        if isinstance(item, int):
            return 0 <= item < readable.numel() and bool(readable[item])
        if isinstance(item, torch.Tensor):
            inside = (item >= 0) & (item < readable.numel())
            return inside & readable[item.clamp(0, readable.numel() - 1)]
        raise NotImplementedError(f"type {type(item)} is not supported yet.")

    # ------------------------------------------------------------------ state
    def _empty(self) -> None:
        """Empties the buffer for every process: every shard's row count goes back to 0."""
        self._local_len = 0
        self._known_full = False
        if self._storage is not None:
            for block in self._storage.blocks:
                try:
                    block.set_ring_total(0)
                except StoreNotFoundError:
                    pass  # a shard deleted meanwhile holds no rows
        self._bump_mutation_revision()

    def state_dict(self) -> dict[str, object]:
        """The rows (an in-memory snapshot) and every shard's row counter."""
        if self._storage is None:
            return {"_storage": {}, "initialized": False, "_len": 0, "total": 0, "totals": []}
        ring = self._storage.ring_state()
        return {
            "_storage": self._storage.to_tensordict().state_dict(),
            "initialized": True,
            "_len": ring.valid,
            "total": ring.total,
            "totals": [state.total for state in ring.shards],
            "block_rows": self._storage.block_rows,
            "td_id": self._storage.td_id,
        }

    def load_state_dict(self, state_dict: Mapping[str, object]) -> None:
        """Writes the rows of ``state_dict`` into the shards and restores their row counters."""
        self._bind_samplers()
        if not state_dict.get("initialized"):
            self._empty()
            return
        totals = state_dict.get("totals")
        if not isinstance(totals, (list, tuple)) or not all(isinstance(t, int) for t in totals):
            raise SchemaError(
                "ShardedStoreStorage.load_state_dict: the state has no per-shard row counts ('totals'); it was not "
                "saved by a ShardedStoreStorage"
            )
        saved = state_dict["_storage"]
        assert isinstance(saved, Mapping)
        data = TensorDict(batch_size=[self.max_size]).load_state_dict(saved, strict=False)
        if data.batch_size[:1] != torch.Size([self.max_size]):
            raise SchemaError(
                f"load_state_dict: the saved rows have batch size {list(data.batch_size)}, this storage holds "
                f"{self.max_size} rows"
            )
        store = self._ensure_store(data, batched=True)
        if len(totals) != store.num_blocks:
            raise SchemaError(
                f"load_state_dict: the state has {len(totals)} shards, {store._where()} has {store.num_blocks}"
            )
        store[:] = data
        for block, total in zip(store.blocks, totals, strict=True):
            block.set_ring_total(int(total))
        self._bump_mutation_revision()


class ShardedStoreWriter(TensorDictStoreWriter):
    """A TorchRL writer that appends through :meth:`ShardedStore.extend <tdstore.ShardedStore.extend>`.

    Each ``extend`` (and ``add``) appends to one shard, atomically there, and returns the rows'
    indices in the whole buffer (``index // block_rows`` is the shard). The shard is
    ``pin_shard`` if given, else the ShardedStore handle's next one in turn (each process
    starts at a random shard, so writers spread). Needs a :class:`ShardedStoreStorage`.

    Args:
        pin_shard (int, optional): the shard every append of this writer goes to.
    """

    def __init__(self, pin_shard: int | None = None) -> None:
        if pin_shard is not None and (
            isinstance(pin_shard, bool) or not isinstance(pin_shard, numbers.Integral) or pin_shard < 0
        ):
            raise ValueError(f"ShardedStoreWriter: pin_shard must be a shard number (an int >= 0), got {pin_shard!r}")
        super().__init__()
        self.pin_shard = None if pin_shard is None else int(pin_shard)

    def register_storage(self, storage: Storage) -> None:
        if not isinstance(storage, ShardedStoreStorage):
            raise TypeError(f"ShardedStoreWriter needs a ShardedStoreStorage, got {type(storage).__name__}")
        super().register_storage(storage)

    @property
    def _cursor(self) -> int:
        """Rows appended so far, all shards together (each shard has a cursor of its own)."""
        storage = self._storage
        if storage is None or storage._storage is None:
            return 0
        return int(storage._storage.ring_state().total)

    def _append(self, data: object) -> torch.Tensor:
        return self._storage.extend(data, shard=self.pin_shard)  # type: ignore[no-any-return]


class ShardedStorePrioritizedSampler(TensorDictStorePrioritizedSampler):
    """TorchRL's proportional prioritized sampler over a :class:`ShardedStoreStorage`.

    As :class:`~tdstore.torchrl.TensorDictStorePrioritizedSampler`, with the priorities on
    the shards: ``sample`` draws from the union of the shards by priority
    (``ShardedStore.sample(prioritized=True)``), ``info["index"]`` is in the whole buffer's
    numbering and ``info["_weight"]`` is the union's importance weight
    ``(N P) ** -beta / max``; ``update_priority`` sends each row to its shard, with the
    generations of the sample the index came from (a row appended to since keeps its new
    priority).

    A ShardedStore that the storage created (from the first data) gets its priorities
    enabled with this sampler's settings. One that was given (``store=``, or found by
    ``td_id=``) must have priorities on every shard already
    (``store.enable_priorities(alpha, beta, eps)``); otherwise the first use raises
    ValueError and changes nothing.

    Args:
        alpha, beta, eps: as :class:`~tdstore.torchrl.TensorDictStorePrioritizedSampler`.
    """

    _storage_name = "ShardedStoreStorage"
    _store: ShardedStore | None  # type: ignore[assignment]

    def _accepts(self, storage: Storage) -> bool:
        return isinstance(storage, ShardedStoreStorage)

    def _enable(self, store: ShardedStore) -> None:  # type: ignore[override]
        want = (self._alpha, self._beta, self._eps, self._arity)
        for block in store.blocks:
            s = block.priority_settings()
            if s is None or (s.alpha, s.beta, s.eps, s.arity) != want:
                store.enable_priorities(self._alpha, self._beta, self._eps, arity=self._arity)
                return

    def _store_of(self, storage: Storage | None) -> ShardedStore | None:  # type: ignore[override]
        if storage is None:
            return self._store
        if not isinstance(storage, ShardedStoreStorage):
            raise TypeError(f"{type(self).__name__} needs a ShardedStoreStorage, got {type(storage).__name__}")
        store = storage._storage
        if store is None or store is self._store:
            return store
        if not storage._created:
            off = [shard for shard, block in enumerate(store.blocks) if block.priority_settings() is None]
            if off:
                raise ValueError(
                    f"{type(self).__name__}: {store._where()} has priorities off on shard(s) {off}; a prioritized "
                    f"sampler needs them on every shard: call store.enable_priorities({self._alpha}, {self._beta}, "
                    f"{self._eps}) first (or let ShardedStoreStorage create the ShardedStore from the first data). "
                    "Nothing was changed"
                )
        self._attach(store)  # type: ignore[arg-type]
        return store

    def _read(self, store: ShardedStore) -> tuple[torch.Tensor, float] | None:  # type: ignore[override]
        """Every row's priority (the shards' in row order) and the max priority of all shards."""
        parts = [_read_priorities(block) for block in store.blocks]
        if any(part is None for part in parts):
            return None
        got = [part for part in parts if part is not None]
        tops = [top for _, top in got if not math.isnan(top)]
        return torch.cat([q for q, _ in got]), (max(tops) if tops else math.nan)

    def _write(self, store: ShardedStore, q: torch.Tensor, top: float) -> None:  # type: ignore[override]
        """Writes back what :meth:`_read` read, each shard its rows."""
        q = torch.as_tensor(q, dtype=torch.float64).reshape(-1)
        for shard, block in enumerate(store.blocks):
            lo = shard * store.block_rows
            _write_priorities(block, q[lo : lo + int(block.batch_size[0])], top)

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Draws ``batch_size`` rows of the union by priority and reads them (handed to ``storage``)."""
        store = self._store_of(storage)
        if store is None:
            raise RuntimeError("Cannot sample from an empty storage.")
        assert isinstance(storage, ShardedStoreStorage)
        got = store.sample(batch_size, prioritized=True, return_info=True, generator=self._rng)
        assert isinstance(got, tuple)
        batch, info = got
        return self._pass_rows(storage, batch, info)


register_sharded(ShardedStorePrioritizedSampler, ShardedStoreStorage)
