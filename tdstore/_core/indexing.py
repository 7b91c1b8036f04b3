"""Index math: any TensorDict batch index -> result shape and coalesced byte runs. No I/O.

An index over the batch dims selects rows: the elements of the flattened batch, each
followed in an entry's bytes by its feature block (``prod(shape[batch_dims:]) * itemsize``
bytes). :func:`select_rows` resolves the index exactly as torch indexes a tensor of the
batch shape (same result shape, same placement of advanced indices, same errors), and
:func:`row_runs` turns the selected rows, in result order, into ``(offset, length)`` runs,
merging consecutive rows into one run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    # what TensorDict's own indexing takes (tensordict.utils.IndexType); named for the type checker only
    from tensordict.utils import IndexType

__all__ = [
    "normalize_index", "select_rows", "contiguous_rows", "row_runs", "RowSpans", "is_full_index", "consumed_dims",
    "leaf_dims", "check_index_dtype", "expand_ellipsis",
]


#: the dtypes torch (and TensorDict) index with; any other is an IndexError there
_INDEX_DTYPES = frozenset({torch.int64, torch.int32, torch.uint8, torch.bool})


def normalize_index(index: IndexType) -> IndexType:
    """Converts lists, ranges and numpy arrays in an index to tensors, as TensorDict does.

    Refuses what TensorDict refuses, with its exception types: a tensor index of a dtype
    torch does not index with (IndexError), two Ellipses (RuntimeError), and a tuple of row indices
    with a key after them (TypeError; a key first is TensorDict's IndexError).
    """
    if isinstance(index, tuple):
        if sum(i is Ellipsis for i in index) > 1:
            raise RuntimeError(f"An index can only have one ellipsis at most, got {index!r}")
        if index and not isinstance(index[0], str) and any(isinstance(i, str) for i in index):
            raise TypeError(
                f"index {index!r} mixes a key with row indices: read the entry first (store[key][rows]) "
                "or the rows first (store[rows][key])"
            )
        return tuple(_normalize_one(i) for i in index)
    return _normalize_one(index)


def _normalize_one(index: IndexType) -> IndexType:
    if isinstance(index, (list, range)):
        return torch.as_tensor(list(index)) if len(index) else torch.zeros(0, dtype=torch.long)
    if isinstance(index, np.ndarray):
        return torch.from_numpy(index)
    if isinstance(index, np.integer):
        return int(index)
    if isinstance(index, np.bool_):
        return bool(index)
    if isinstance(index, torch.Tensor):
        if index.dtype not in _INDEX_DTYPES:
            raise IndexError(f"tensors used as indices must be long, int, byte or bool tensors, got {index.dtype}")
        if index.ndim == 0 and index.dtype != torch.bool:
            # torch indexes with a 0-d integer tensor as with an int (a value of another dtype is
            # then cast, as x[3] = 7 is; a 1-d index would need the dtypes to match)
            return int(index)
        if index.device.type != "cpu":
            return index.cpu()
    return index


def consumed_dims(index: IndexType, ndim: int) -> int:
    """How many leading dims of a tensor with ``ndim`` dims ``index`` selects over.

    An ``Ellipsis`` makes the index reach the last dim, so it consumes all ``ndim``.
    """
    items = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in items):
        return ndim
    count = 0
    for item in items:
        if item is None:
            continue
        if isinstance(item, torch.Tensor) and item.dtype == torch.bool:
            count += max(item.dim(), 1)
        else:
            count += 1
    return count


def leaf_dims(index: IndexType, nb: int, ndim: int) -> int:
    """How many leading dims of a leaf with ``ndim`` dims (``nb`` of them batch dims) an index reaches.

    ``nb`` when it stays in the batch dims; more when it indexes the leaf's own feature dims,
    as ``TensorDict.get_at`` / ``set_at_`` do: an ``Ellipsis`` that is not the last item
    expands over all the leaf's dims (``(..., 0)`` is the leaf's last dim), a trailing one adds nothing.
    """
    items = index if isinstance(index, tuple) else (index,)
    while items and items[-1] is Ellipsis:
        items = items[:-1]
    if any(i is Ellipsis for i in items):
        return ndim
    return max(nb, min(consumed_dims(items, ndim), ndim))


def expand_ellipsis(index: IndexType, nb: int) -> IndexType:
    """``index`` over ``nb`` batch dims with its ``...`` spelled out as slices, so that it selects the
    same leading dims of a tensor with more dims (a nested tensordict's)."""
    items = index if isinstance(index, tuple) else (index,)
    if not any(i is Ellipsis for i in items):
        return index
    rest = tuple(i for i in items if i is not Ellipsis)
    out: list[object] = []
    for item in items:
        if item is Ellipsis:
            out.extend([slice(None)] * max(nb - consumed_dims(rest, nb), 0))
        else:
            out.append(item)
    return tuple(out)


def check_index_dtype(index: IndexType, value: object, dtype: torch.dtype | None, key: object, where: str) -> None:
    """Raises what torch raises for ``leaf[index] = value`` when ``index`` holds a list, a tensor or a
    mask and ``value`` is a tensor of another dtype (torch casts only for ints, slices and ``...``,
    and a 0-dim value under a lone mask, which is a fill)."""
    if dtype is None or not isinstance(value, torch.Tensor) or value.dtype == dtype:
        return
    index = normalize_index(index)
    items = index if isinstance(index, tuple) else (index,)
    tensors = [i for i in items if isinstance(i, torch.Tensor)]
    if not tensors:
        return
    if value.dim() == 0 and len(items) == 1 and tensors[0].dtype == torch.bool:
        return
    raise RuntimeError(
        f"Index put requires the source and destination dtypes match, got {dtype} for the destination "
        f"and {value.dtype} for the source: entry {key!r} of {where} was not written (with a list, tensor "
        "or mask index, TensorDict and torch do not cast; cast the value first)"
    )


def is_full_index(index: IndexType, ndim: int) -> bool:
    """Whether ``index`` selects the whole batch in order (``...``, ``:``, ``()``)."""
    items = index if isinstance(index, tuple) else (index,)
    if len(items) > ndim + (1 if any(i is Ellipsis for i in items) else 0):
        return False
    return all(i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in items)


def select_rows(index: IndexType, batch_shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Flat row numbers selected by ``index``, shaped like the indexed batch.

    An int, a slice or an integer tensor over the first dim is resolved directly; any
    other index is applied by torch to ``arange(numel).reshape(batch_shape)``, which gives
    torch's exact result shape, advanced-index placement and errors.

    Raises:
        IndexError, TypeError, ValueError: as torch raises them for the same index on a
            tensor of shape ``batch_shape``.
    """
    index = normalize_index(index)
    batch_shape = tuple(batch_shape)
    first = _first_dim_rows(index, batch_shape)
    if first is not None:
        inner = math.prod(batch_shape[1:])
        if len(batch_shape) == 1:
            return first
        rows = first.unsqueeze(-1) * inner + torch.arange(inner)
        return rows.reshape(tuple(first.shape) + batch_shape[1:])
    numel = math.prod(batch_shape)
    rows = torch.arange(numel, dtype=torch.long).reshape(batch_shape)
    return rows[index]


def contiguous_rows(index: IndexType, batch_shape: Sequence[int]) -> tuple[int, int, tuple[int, ...]] | None:
    """``(first row, row count, result shape)`` when ``index`` selects one block of consecutive rows.

    The fast path of :func:`select_rows` for an int or a slice with step 1 over the first
    dim (the rows of the inner dims follow each other in the flat batch); None for any
    other index, or an int out of range (then :func:`select_rows` raises torch's error).
    """
    if not batch_shape:
        return None
    n0 = batch_shape[0]
    kind = type(index)
    if kind is int:
        if not -n0 <= index < n0:
            return None
        inner = math.prod(batch_shape[1:])
        return (index % n0) * inner, inner, tuple(batch_shape[1:])
    if kind is slice and (index.step is None or (type(index.step) is int and index.step == 1)):
        start, stop = index.start, index.stop
        if not (start is None or type(start) is int) or not (stop is None or type(stop) is int):
            return None
        start, stop, _ = index.indices(n0)
        count = max(0, stop - start)
        inner = math.prod(batch_shape[1:])
        return start * inner, count * inner, (count, *batch_shape[1:])
    return None


def _first_dim_rows(index: IndexType, batch_shape: tuple[int, ...]) -> torch.Tensor | None:
    """The selected rows of dim 0 for the common indices, or None (then torch decides)."""
    if not batch_shape:
        return None
    n0 = batch_shape[0]
    if isinstance(index, bool):
        return None
    if isinstance(index, int):
        if -n0 <= index < n0:
            return torch.tensor(index % n0)
        return None
    if isinstance(index, slice):
        if index.step is not None and (not isinstance(index.step, int) or index.step <= 0):
            return None
        if not all(v is None or isinstance(v, int) for v in (index.start, index.stop)):
            return None
        start, stop, step = index.indices(n0)
        count = max(0, (stop - start + step - 1) // step)
        return torch.arange(count, dtype=torch.long) * step + start
    if isinstance(index, torch.Tensor) and index.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        if index.dtype == torch.uint8:
            return None  # a uint8 index is a deprecated mask in torch
        if index.numel() == 0:
            return None
        lo, hi = (int(v) for v in torch.aminmax(index))
        if lo < -n0 or hi >= n0:
            return None
        if lo >= 0:
            return index.clone() if index.dtype == torch.int64 else index.long()
        return index.long() % n0
    return None


class RowSpans:
    """Runs of consecutive rows (in result order), computed once and scaled per entry.

    Counting the runs (``len``) is cheaper than listing them, and a read by the gather
    script needs only the count: the list is made on the first :meth:`runs`.
    """

    __slots__ = ("_flat", "_first", "_count", "_len", "_cache")

    def __init__(self, rows: torch.Tensor) -> None:
        self._flat: torch.Tensor | None = rows.reshape(-1)
        self._first: list[int] | None = None
        self._count: list[int] | None = None
        self._len: int | None = None
        self._cache: dict[int, list[tuple[int, int]]] = {}

    @classmethod
    def block(cls, first: int, count: int) -> RowSpans:
        """The spans of ``count`` consecutive rows from row ``first`` (see :func:`contiguous_rows`)."""
        self = cls.__new__(cls)
        self._flat = None
        self._first, self._count = ([first], [count]) if count else ([], [])
        self._len = len(self._first)
        self._cache = {}
        return self

    def __len__(self) -> int:
        if self._len is None:
            flat = self._flat
            assert flat is not None  # only block() leaves it unset, and it sets _len
            n = flat.numel()
            self._len = int((flat[1:] - flat[:-1] != 1).sum()) + 1 if n > 1 else n
        return self._len

    @property
    def first(self) -> list[int]:
        """The first row of each run."""
        if self._first is None:
            self._split()
        return self._first  # type: ignore[return-value]

    @property
    def count(self) -> list[int]:
        """The number of rows of each run."""
        if self._count is None:
            self._split()
        return self._count  # type: ignore[return-value]

    def _split(self) -> None:
        flat = self._flat
        assert flat is not None  # only block() leaves it unset, and it sets the runs
        n = flat.numel()
        if n == 0:
            self._first, self._count = [], []
        elif n == 1:
            self._first, self._count = [int(flat[0])], [1]
        else:
            breaks = torch.nonzero(flat[1:] - flat[:-1] != 1).reshape(-1) + 1
            starts = torch.cat([torch.zeros(1, dtype=torch.long), breaks])
            ends = torch.cat([breaks, torch.tensor([n])])
            self._first = flat[starts].tolist()
            self._count = (ends - starts).tolist()
        self._len = len(self._first)

    def runs(self, row_bytes: int) -> list[tuple[int, int]]:
        """``(byte offset, byte length)`` of each run, for rows of ``row_bytes`` bytes."""
        if row_bytes == 0:
            return []
        out = self._cache.get(row_bytes)
        if out is None:
            out = self._cache[row_bytes] = [
                (f * row_bytes, c * row_bytes) for f, c in zip(self.first, self.count, strict=True)
            ]
        return out


def row_runs(rows: torch.Tensor, row_bytes: int) -> list[tuple[int, int]]:
    """Coalesces flat row numbers (in result order) into ``(byte offset, byte length)`` runs.

    Consecutive ascending rows form one run; a repeated or backward row starts a new one,
    so reading the runs in order and concatenating them gives the rows in result order.
    """
    return RowSpans(rows).runs(row_bytes)
