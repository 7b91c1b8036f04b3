"""ShardedStore: one large buffer split into row blocks, each block a TensorDictStore.

A :class:`~tdstore.TensorDictStore` lives in one Redis Cluster slot (its keys share the
hash tag ``{td_id}``), so one store is served by one master and each of its entries is one
string (512 MB by default). A buffer larger than one master, or whose rows should be served
by several masters at once, is split along its first batch dimension into blocks of
``block_rows`` rows. Block ``i`` is a store of its own with td_id ``<td_id>.b<i>``: its own
hash tag, so the blocks spread over the masters. A small manifest store (td_id ``<td_id>``)
records the layout, so :meth:`ShardedStore.from_store` reconnects from the td_id alone.

Atomicity is **per block**, exactly:

* a read or write of rows that fall in one block is one atomic step of that block's store
  (all entries, all rows, or nothing), with every guarantee of ``docs/guarantees.md``;
* a read or write that spans several blocks is one atomic step per block: the first block
  alone, then the others in parallel threads (their round trips overlap, on one master or
  several). A concurrent reader may see the new rows of one block and the old rows of
  another, and a failure (a server down, a lost connection) part-way leaves some blocks
  written and others not. Bad input (a wrong shape, dtype, row index or value batch size)
  is refused before any block is written: the index and batch size are checked first, and
  every block gets a slice of the same value, which the first block checks before the
  others start.

Pick ``block_rows`` so that a block's largest entry stays well under the server's
``proto-max-bulk-len`` and so that the operations that must be atomic stay inside a block.

Examples:
    >>> import torch
    >>> from tdstore import ShardedStore
    >>> buf = ShardedStore.from_schema({"obs": ([4], torch.float32)}, batch_size=[10], block_rows=4)
    >>> buf.num_blocks
    3
    >>> buf[3:6] = {"obs": torch.ones(3, 4)}    # rows 3 (block 0) and 4, 5 (block 1)
    >>> buf["obs"][:, 0]
    tensor([0., 0., 0., 1., 1., 1., 0., 0., 0., 0.])
    >>> buf.clear_redis()
    >>> buf.close()
"""

from __future__ import annotations

import json
import numbers
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from tensordict import TensorDict, TensorDictBase

from tdstore._core.keys import new_td_id, validate_td_id
from tdstore.errors import FormatVersionError, StoreNotFoundError
from tdstore.sharded_ring import ShardedRing, ShardedRingState
from tdstore.store import TensorDictStore

if TYPE_CHECKING:
    from tensordict import NestedKey
    from tensordict.utils import IndexType

    from tdstore.base.views import StoreKeysView

__all__ = ["ShardedStore"]

T = TypeVar("T")
_I = TypeVar("_I")

#: Blocks are read and written by up to this many threads at once (their round trips overlap).
MAX_PARALLEL_BLOCKS = 8

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(MAX_PARALLEL_BLOCKS, thread_name_prefix="tdstore-blocks")
        return _POOL


def _after_fork() -> None:  # a forked child has no pool threads: start a new pool on first use
    global _POOL
    _POOL = None


os.register_at_fork(after_in_child=_after_fork)


def _each(fn: Callable[[_I], T], items: Sequence[_I]) -> list[T]:
    """``[fn(item) for item in items]``, the first item alone, then the others in parallel.

    The first call runs before any other starts, so input that every block would refuse
    (all of them get slices of one value) is refused before a second block is touched.
    """
    if len(items) <= 1:
        return [fn(item) for item in items]
    first = fn(items[0])
    return [first, *_pool().map(fn, items[1:])]

#: Version of the manifest layout.
_FORMAT = 1
_MANIFEST_KEY = "sharded_manifest"


def _block_id(td_id: str, index: int) -> str:
    return f"{td_id}.b{index}"


class ShardedStore:
    """A buffer split along its first batch dimension into blocks of ``block_rows`` rows.

    Create one with :meth:`from_schema` or :meth:`from_tensordict`, reconnect with
    :meth:`from_store`. Rows are indexed with an int, a slice, a list or 1-D integer
    tensor, or a boolean mask over the first dimension; entries by key. See the module
    docstring for the atomicity (per block).
    """

    def __init__(
        self, manifest: TensorDictStore, blocks: Sequence[TensorDictStore], block_rows: int, pin_shard: int | None = None
    ) -> None:
        self._manifest = manifest
        self._blocks = tuple(blocks)
        self._block_rows = int(block_rows)
        first = self._blocks[0].batch_size
        rows = sum(int(b.batch_size[0]) for b in self._blocks)
        self._batch_size = torch.Size([rows, *first[1:]])
        #: the ring over the blocks (block i = shard i): tdstore/sharded_ring.py
        self._ring = ShardedRing(self._blocks, self._block_rows, self._where, _pool, pin_shard)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _check_layout(batch_size: Sequence[int] | torch.Size | None, block_rows: object, where: str) -> tuple[torch.Size, int]:
        size = torch.Size(batch_size if batch_size is not None else [])
        if len(size) == 0:
            raise ValueError(f"{where}: a sharded buffer needs a batch size with a first dimension, got {list(size)}")
        if isinstance(block_rows, bool) or not isinstance(block_rows, numbers.Integral) or block_rows < 1:
            raise ValueError(f"{where}: block_rows must be a positive int, got {block_rows!r}")
        return size, int(block_rows)

    @classmethod
    def _build(
        cls, td_id: str | None, size: torch.Size, block_rows: int, make_block: Callable[[str, int, int], TensorDictStore],
        conn: dict[str, Any], pin_shard: int | None = None,
    ) -> ShardedStore:
        td_id = validate_td_id(td_id) if td_id is not None else new_td_id()
        rows = int(size[0])
        nblocks = max(1, -(-rows // block_rows))
        info = {"format": _FORMAT, "batch_size": list(size), "block_rows": block_rows, "blocks": nblocks}
        # the manifest first: it claims the td_id (StoreExistsError if taken) before any block is made
        manifest = TensorDictStore.from_dict({_MANIFEST_KEY: json.dumps(info)}, td_id=td_id, batch_size=[], **conn)
        created: list[TensorDictStore] = []
        try:
            for index in range(nblocks):
                lo, hi = index * block_rows, min(rows, (index + 1) * block_rows)
                created.append(make_block(_block_id(td_id, index), lo, hi))
        except BaseException:
            for store in [*created, manifest]:  # undo: nothing of the buffer stays behind
                try:
                    store.clear_redis()
                finally:
                    store.close()
            raise
        try:
            return cls(manifest, created, block_rows, pin_shard)
        except BaseException:
            for store in [*created, manifest]:  # (a bad pin_shard: nothing stays behind either)
                try:
                    store.clear_redis()
                finally:
                    store.close()
            raise

    @classmethod
    def from_schema(
        cls,
        schema: Mapping[NestedKey, tuple[Sequence[int] | torch.Size, torch.dtype]],
        *,
        batch_size: Sequence[int] | torch.Size,
        block_rows: int,
        td_id: str | None = None,
        pin_shard: int | None = None,
        **conn: Any,
    ) -> ShardedStore:
        """Creates zero-filled blocks (allocated by the servers, no bytes sent) and the manifest.

        Args:
            schema: As :meth:`TensorDictStore.from_schema`: ``{key: (element_shape, dtype)}``.
            batch_size: The whole buffer's batch size; its first dimension is split.
            block_rows: Rows per block (the last block may be shorter).
            td_id: The buffer's id (default: a new UUID); blocks are ``<td_id>.b<i>``.
            pin_shard: The shard this handle's :meth:`extend` appends to (default: the shards in turn).
            **conn: Connection arguments for every block, e.g. ``cluster_nodes=[(host, port)]``.
        """
        size, block_rows = cls._check_layout(batch_size, block_rows, "ShardedStore.from_schema")

        def make(block_id: str, lo: int, hi: int) -> TensorDictStore:
            return TensorDictStore.from_schema(schema, batch_size=[hi - lo, *size[1:]], td_id=block_id, **conn)

        return cls._build(td_id, size, block_rows, make, conn, pin_shard)

    @classmethod
    def from_tensordict(
        cls, td: TensorDictBase, *, block_rows: int, td_id: str | None = None, pin_shard: int | None = None, **conn: Any
    ) -> ShardedStore:
        """Uploads a TensorDict, one block (one atomic step) at a time."""
        if not isinstance(td, TensorDictBase):
            raise TypeError(f"ShardedStore.from_tensordict takes a TensorDict, got {type(td).__name__}")
        size, block_rows = cls._check_layout(td.batch_size, block_rows, "ShardedStore.from_tensordict")

        def make(block_id: str, lo: int, hi: int) -> TensorDictStore:
            return TensorDictStore.from_tensordict(td[lo:hi], td_id=block_id, **conn)

        return cls._build(td_id, size, block_rows, make, conn, pin_shard)

    @classmethod
    def from_store(cls, *, td_id: str, pin_shard: int | None = None, **conn: Any) -> ShardedStore:
        """Reconnects to a sharded buffer by its td_id (reads the manifest, then each block).

        The ring (its rows, cursors and priorities) lives on the shards: the new handle
        samples and appends to the same buffer. ``pin_shard``: as :meth:`from_schema`."""
        manifest = TensorDictStore.from_store(td_id=td_id, **conn)
        try:
            try:
                raw = manifest.get(_MANIFEST_KEY)
            except KeyError:
                raise StoreNotFoundError(
                    f"no ShardedStore with td_id={td_id!r} on {manifest._conn.describe()}: its manifest "
                    f"(store {td_id!r}, entry {_MANIFEST_KEY!r}) is missing"
                ) from None
            info = json.loads(raw.data if hasattr(raw, "data") else raw)
            if info.get("format") != _FORMAT:
                raise FormatVersionError(
                    f"ShardedStore td_id={td_id!r} has manifest format {info.get('format')!r}; this tdstore "
                    f"reads format {_FORMAT}"
                )
            blocks: list[TensorDictStore] = []
            try:
                for index in range(int(info["blocks"])):
                    blocks.append(TensorDictStore.from_store(td_id=_block_id(td_id, index), **conn))
            except BaseException:
                for block in blocks:
                    block.close()
                raise
        except BaseException:
            manifest.close()
            raise
        try:
            return cls(manifest, blocks, int(info["block_rows"]), pin_shard)
        except BaseException:
            for block in [*blocks, manifest]:
                block.close()
            raise

    # ------------------------------------------------------------------ description
    @property
    def td_id(self) -> str:
        return self._manifest.td_id

    @property
    def batch_size(self) -> torch.Size:
        return self._batch_size

    @property
    def block_rows(self) -> int:
        return self._block_rows

    @property
    def blocks(self) -> tuple[TensorDictStore, ...]:
        """The block stores, in row order (block ``i`` holds rows ``i*block_rows`` on)."""
        return self._blocks

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def __len__(self) -> int:
        return int(self._batch_size[0])

    def keys(self, include_nested: bool = False, leaves_only: bool = False) -> StoreKeysView:
        return self._blocks[0].keys(include_nested=include_nested, leaves_only=leaves_only)

    def __repr__(self) -> str:
        return (
            f"ShardedStore(td_id={self.td_id!r}, batch_size={list(self._batch_size)}, "
            f"block_rows={self._block_rows}, blocks={self.num_blocks})"
        )

    def _where(self) -> str:
        return f"ShardedStore(td_id={self.td_id!r}, {len(self)} rows)"

    # ------------------------------------------------------------------ index math
    def _rows(self, idx: IndexType) -> tuple[torch.Tensor, bool]:
        """Row numbers (an int64 tensor) selected by ``idx``, and whether ``idx`` was a single row."""
        n = len(self)
        if isinstance(idx, numbers.Integral) and not isinstance(idx, bool):
            row = int(idx) + n if idx < 0 else int(idx)
            if not 0 <= row < n:
                raise IndexError(f"row {idx} is out of range for {self._where()}")
            return torch.tensor([row]), True
        if isinstance(idx, slice):
            return torch.arange(n)[idx], False
        if isinstance(idx, (list, range)) or type(idx).__module__ == "numpy":
            idx = torch.as_tensor(idx) if len(idx) else torch.empty(0, dtype=torch.int64)
        if isinstance(idx, torch.Tensor):
            if idx.dtype == torch.bool:
                if idx.shape != (n,):
                    raise IndexError(f"a boolean mask of {self._where()} must have shape [{n}], got {list(idx.shape)}")
                return idx.nonzero().squeeze(1), False
            if not idx.dtype.is_floating_point and not idx.dtype.is_complex and idx.ndim <= 1:
                rows = idx.reshape(-1).to(torch.int64)
                rows = torch.where(rows < 0, rows + n, rows)
                bad = (rows < 0) | (rows >= n)
                if bool(bad.any()):
                    raise IndexError(
                        f"row {int(idx.reshape(-1)[bad.nonzero()[0, 0]])} is out of range for {self._where()}"
                    )
                return rows, idx.ndim == 0
        raise TypeError(
            f"{self._where()} takes an entry key (str or tuple of str), or rows of its first dimension: an int, "
            f"a slice, a list or 1-D integer tensor, or a boolean mask; got {type(idx).__name__}"
        )

    def _split(self, rows: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, slice | torch.Tensor]]:
        """``(block, positions in rows, index inside the block)`` for each block that ``rows`` touch."""
        block_ids = torch.div(rows, self._block_rows, rounding_mode="floor")
        local = rows - block_ids * self._block_rows
        for block in torch.unique(block_ids).tolist():
            positions = (block_ids == block).nonzero().squeeze(1)
            loc = local[positions]
            first, count = int(loc[0]), int(loc.numel())
            if bool((loc == torch.arange(first, first + count)).all()):
                yield block, positions, slice(first, first + count)  # contiguous: byte runs, no gather
            else:
                yield block, positions, loc

    @staticmethod
    def _is_key(idx: object) -> bool:
        return isinstance(idx, str) or (isinstance(idx, tuple) and bool(idx) and all(isinstance(k, str) for k in idx))

    # ------------------------------------------------------------------ reads
    def __getitem__(self, idx: IndexType) -> torch.Tensor | TensorDictBase:
        """An entry (all rows, one read per block) or rows (a TensorDict)."""
        if self._is_key(idx):
            return torch.cat(_each(lambda block: block.get(idx), self._blocks))
        rows, single = self._rows(idx)
        if single:
            row = int(rows[0])
            return self._blocks[row // self._block_rows][row % self._block_rows]
        pieces = list(self._split(rows))
        parts = _each(lambda piece: self._blocks[piece[0]][piece[2]], pieces)
        order = [positions for _, positions, _ in pieces]
        if not parts:
            return self._blocks[0][0:0]
        out = torch.cat(parts)
        order_t = torch.cat(order)
        if bool((order_t == torch.arange(order_t.numel())).all()):
            return out
        return out[torch.argsort(order_t)]

    def get(self, key: NestedKey) -> torch.Tensor:
        return self[key]

    def to_tensordict(self) -> TensorDict:
        """The whole buffer in memory (one consistent read per block)."""
        return torch.cat(_each(lambda block: block.to_tensordict(), self._blocks))

    # ------------------------------------------------------------------ writes
    def __setitem__(self, idx: IndexType, value: Any) -> None:
        """Writes an entry (all rows) or rows; one atomic step per block touched."""
        if self._is_key(idx):
            self._set_entry(idx, value)
            return
        rows, single = self._rows(idx)
        value = self._as_rows(value, rows, single)
        if single:
            row = int(rows[0])
            self._blocks[row // self._block_rows][row % self._block_rows] = value
            return
        def write(piece: tuple[int, torch.Tensor, slice | torch.Tensor]) -> None:
            block, positions, local = piece
            self._blocks[block][local] = value[positions]

        _each(write, list(self._split(rows)))

    def _as_rows(self, value: object, rows: torch.Tensor, single: bool) -> TensorDictBase:
        """Checks that ``value`` holds one item per selected row, before any block is written."""
        expected = [] if single else [int(rows.numel())]
        if isinstance(value, Mapping) and not isinstance(value, TensorDictBase):
            try:
                value = TensorDict(dict(value), batch_size=expected)
            except RuntimeError as err:
                raise ValueError(
                    f"rows written to {self._where()} need a leading dimension of {expected} (one item per "
                    f"selected row): {err}"
                ) from None
        if not isinstance(value, TensorDictBase):
            raise TypeError(
                f"rows written to {self._where()} must be a TensorDict or a dict of tensors, got {type(value).__name__}"
            )
        if list(value.batch_size[: len(expected)]) != expected:
            raise ValueError(
                f"rows written to {self._where()} must have batch size {expected} (one item per selected row), "
                f"got {list(value.batch_size)}"
            )
        # the blocks get slices of this one value, so they agree on its keys, shapes and dtypes:
        # a value the first block refuses (checked before that block writes) reaches no block
        return value

    def _set_entry(self, key: NestedKey, value: object) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"entry {key!r} of {self._where()} must be a tensor of {len(self)} rows, got {type(value).__name__}")
        if value.ndim == 0 or value.shape[0] != len(self):
            raise ValueError(
                f"entry {key!r} of {self._where()} must have {len(self)} rows (shape [{len(self)}, ...]), "
                f"got shape {list(value.shape)}"
            )
        def write(index: int) -> None:
            lo = index * self._block_rows
            self._blocks[index][key] = value[lo : lo + int(self._blocks[index].batch_size[0])]

        _each(write, range(len(self._blocks)))

    # ------------------------------------------------------------------ ring buffer: tdstore/sharded_ring.py
    @property
    def pin_shard(self) -> int | None:
        """The shard this handle's :meth:`extend` appends to; None: the shards in turn (settable)."""
        return self._ring.pin_shard

    @pin_shard.setter
    def pin_shard(self, shard: int | None) -> None:
        self._ring.pin_shard = shard

    def extend(self, td: TensorDictBase, *, shard: int | None = None) -> torch.Tensor:
        """Appends the rows of ``td`` to one shard, atomically there; returns their indices in the
        whole buffer (``index // block_rows`` is the shard).

        The shard is ``shard`` if given, else this handle's :attr:`pin_shard`, else the next one
        in turn (each handle starts at a per-process random shard, so writers spread). The rows
        wrap around that shard's ring as :meth:`TensorDictStore.extend` does; ``td`` may hold
        at most the shard's rows. Bad input raises as there and writes nothing.
        """
        return self._ring.extend(td, shard)

    def ring_state(self) -> ShardedRingState:
        """The ring counters of every shard (one parallel round) and their sums: ``.valid`` is
        the valid rows of the whole buffer."""
        return self._ring.ring_state()

    def sample(
        self, n: int, *, generator: torch.Generator | None = None, prioritized: bool = False,
        return_info: bool = False, skip_unavailable: bool = False,
    ) -> TensorDictBase | tuple[TensorDictBase, dict[str, torch.Tensor]]:
        """Reads ``n`` random rows (with replacement) of the whole buffer: a sample of the union of the shards.

        How many rows each shard gives is drawn first (multinomial, by the shards' valid rows,
        or ``prioritized=True`` by their priority mass); then the shards are sampled in
        parallel, each in one consistent snapshot as :meth:`TensorDictStore.sample`, and the
        rows are shuffled together. ``return_info=True`` returns ``(batch, info)``:
        ``info["index"]`` in the buffer's numbering, and when prioritized ``info["_weight"]``
        (the importance weights over all shards) and ``info["generation"]``.

        A shard that cannot be reached raises :class:`~tdstore.errors.ShardUnavailableError`
        naming it; ``skip_unavailable=True`` draws the ``n`` rows from the reachable shards
        only (renormalized over them). The batch always has ``n`` rows.

        Raises:
            ValueError: ``n`` is not an int >= 1, no row was appended yet, or (prioritized)
                priorities are off.
            ShardUnavailableError: a shard (or, skipping, every shard) cannot be reached.
        """
        return self._ring.sample(
            n, generator=generator, prioritized=prioritized, return_info=return_info, skip_unavailable=skip_unavailable
        )

    def enable_priorities(self, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-8, *, arity: int = 8) -> None:
        """:meth:`TensorDictStore.enable_priorities` on every shard (the first alone, so bad
        settings reach none)."""
        self._ring.enable_priorities(alpha, beta, eps, arity)

    def disable_priorities(self) -> bool:
        """Turns prioritized sampling off on every shard; False when it was off on all."""
        return self._ring.disable_priorities()

    def update_priority(
        self, index: torch.Tensor | Sequence[int], priority: torch.Tensor | Sequence[float] | float,
        generation: torch.Tensor | Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Sets the priority of rows ``index`` (the buffer's numbering), each on its shard: one
        step per shard, in parallel; returns which were applied (see
        :meth:`TensorDictStore.update_priority`). A bad argument raises ValueError and no shard
        changes."""
        return self._ring.update_priority(index, priority, generation)

    # ------------------------------------------------------------------ lifecycle
    def clear_redis(self) -> None:
        """Deletes the manifest, then every block, from the server(s)."""
        self._manifest.clear_redis()
        for block in self._blocks:
            block.clear_redis()

    def close(self) -> None:
        for block in self._blocks:
            block.close()
        self._manifest.close()

    def __reduce__(self) -> tuple[Callable[..., ShardedStore], tuple[object, ...]]:
        # by td_id: the manifest and block handles pickle as TensorDictStore does (the
        # connection, not the rows); unpickling checks the manifest as from_store does
        return (_reopen, (self._manifest, self._blocks, self._block_rows, self._ring.pin_shard))

    def __enter__(self) -> ShardedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reopen(
    manifest: TensorDictStore, blocks: Sequence[TensorDictStore], block_rows: int, pin_shard: int | None
) -> ShardedStore:
    """Unpickles a :class:`ShardedStore` (see ``__reduce__``): its manifest must still be there."""
    try:
        raw = manifest.get(_MANIFEST_KEY)
    except KeyError:
        raise StoreNotFoundError(
            f"no ShardedStore with td_id={manifest.td_id!r} on {manifest._conn.describe()}: its manifest "
            f"(store {manifest.td_id!r}, entry {_MANIFEST_KEY!r}) is missing"
        ) from None
    info = json.loads(raw.data if hasattr(raw, "data") else raw)
    if int(info["blocks"]) != len(blocks) or int(info["block_rows"]) != block_rows:
        raise FormatVersionError(
            f"ShardedStore td_id={manifest.td_id!r}: the server's manifest ({info['blocks']} blocks of "
            f"{info['block_rows']} rows) is not the pickled handle's ({len(blocks)} of {block_rows}); reconnect "
            "with ShardedStore.from_store(td_id=...)"
        )
    return ShardedStore(manifest, blocks, block_rows, pin_shard)
