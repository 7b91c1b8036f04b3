"""Indexed writes (``store[idx] = value``, ``set_at_``): every entry's rows in one atomic step.

The rows are written on the server (the ``write_runs`` script, or SETRANGEs in a
WATCH-guarded MULTI; see ``_row_writes.choose_write``); nothing is read back first. Entries
that do not exist yet are created zero-filled, and non-tensor entries updated element-wise,
in the same MULTI (``_row_writes.write_runs_watched``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
from tensordict import NonTensorData, NonTensorStack

from tdstore._backend import ops as _backend
from tdstore._backend import row_writes as _row_writes
from tdstore._backend.optimistic import optimistic
from tdstore._core import chunks as _chunks
from tdstore._core import codec as _codec
from tdstore._core import values as _values
from tdstore._core.indexing import (
    RowSpans,
    check_index_dtype,
    contiguous_rows,
    expand_ellipsis,
    leaf_dims,
    normalize_index,
    select_rows,
)
from tdstore._core.layout import Entry
from tdstore.errors import CorruptMetadataError, UnsupportedOperationError

if TYPE_CHECKING:
    from tensordict.utils import IndexType

    from tdstore.store import TensorDictStore

#: a non-tensor entry's new bytes from its old ones (read under WATCH)
_Update = Callable[[Entry | None, bytes | None], tuple[Entry, bytes]]


def _row_payload(
    value: object, dtype: torch.dtype, shape: tuple[int, ...], key: tuple[str, ...], where: str, index: object = None
) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        from tdstore._core.planner import check_tensor  # sparse, nested and meta tensors: a clear TypeError

        check_tensor(value, key, where)
        check_index_dtype(index, value, dtype, key, where)
    tensor = torch.as_tensor(value)
    if tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    while tensor.dim() > len(shape) and tensor.shape[0] == 1:
        tensor = tensor[0]  # extra leading size-1 dims, as torch's setitem accepts them
    try:
        tensor = tensor.expand(shape) if tensor.shape != torch.Size(shape) else tensor
    except RuntimeError:
        raise RuntimeError(
            f"cannot write a value of shape {list(tensor.shape)} into entry {key!r} of {where} "
            f"at an index selecting shape {list(shape)}"
        ) from None
    return tensor


def write_index(
    store: TensorDictStore,
    index: IndexType,
    targets: Mapping[tuple[str, ...], object],
    check_batch: Callable[[torch.Size], None] | None = None,
    leaf: bool = False,
) -> None:
    """``leaf``: ``set_at_`` of the one target, whose index may reach the entry's own dims."""
    conn = store._conn
    index = normalize_index(index)
    where = store._where()

    def attempt(_attempt: int) -> None:
        layout = store._layout()
        node = store._node(layout)
        batch_size = torch.Size(node.batch_size or ())
        nb = len(batch_size)
        if leaf:
            meta = layout.entries.get(next(iter(targets)))
            if meta is not None and meta.is_tensor and meta.shape is not None:
                # as TensorDict.set_at_: the index reaches the entry's feature dims, `...` all of them
                batch_size = torch.Size(meta.shape[: leaf_dims(index, nb, len(meta.shape))])
                nb = len(batch_size)
        for path, value in targets.items():
            # torch checks the dtypes before the index's range: the same error comes first
            meta = layout.entries.get(path)
            if meta is not None and meta.is_tensor:
                check_index_dtype(index, value, _codec.entry_dtype(meta), path, where)
        block = contiguous_rows(index, batch_size)
        if block is not None:
            # an int or a slice over dim 0: one run of rows, no tensor index math
            rows = None
            spans = RowSpans.block(block[0], block[1])
            new_bs = torch.Size(block[2])
        else:
            rows = select_rows(index, batch_size)
            spans = RowSpans(rows)
            new_bs = rows.shape
        if check_batch is not None:
            check_batch(new_bs)
        groups: list[tuple[tuple[str, ...], list[tuple[int, int]], memoryview]] = []
        keep: list[torch.Tensor] = []
        create: list[_backend.Op] = []
        nontensor: list[tuple[tuple[str, ...], _Update]] = []
        seq = 0
        for path, value in targets.items():
            meta = layout.entries.get(path)
            if meta is None:
                _check_parents(layout, path, where)
            if isinstance(value, (NonTensorData, NonTensorStack)):
                if meta is not None and not meta.is_non_tensor:
                    raise UnsupportedOperationError(
                        f"cannot write a non-tensor value into the {'tensor' if meta.is_tensor else 'nested'} "
                        f"entry {path!r} of {where} at an index"
                    )
                owner_bs = store._owner_batch_size(layout, path)
                seq += 1
                if owner_bs != batch_size:
                    # in a nested tensordict with more batch dims: the index selects its leading dims
                    owner_rows = select_rows(expand_ellipsis(index, nb), owner_bs)
                else:
                    if rows is None:
                        rows = select_rows(index, batch_size)
                    owner_rows = rows
                nontensor.append((path, _nontensor_update(path, value, owner_rows, owner_bs, [layout.lv + 1, seq], where, conn.pickle_policy)))
                continue
            if meta is None:
                # a new key written through an index: created zero-filled in the same step
                tensor = torch.as_tensor(value)
                owner_bs = store._owner_batch_size(layout, path)
                shape = tuple(owner_bs) + tuple(tensor.shape[len(new_bs):]) if tensor.dim() >= len(new_bs) else tuple(owner_bs)
                if len(path) - len(store._path) > 1 and layout.entries.get(path[:-1]) is None:
                    raise UnsupportedOperationError(
                        f"writing the new nested key {path!r} of {where} through an index needs its "
                        "parent to exist; create it first"
                    )
                seq += 1
                meta = _chunks.annotate(Entry.tensor(_codec.dtype_name(tensor.dtype), shape, (layout.lv + 1, seq)), layout.meta)
                nbytes = _codec.tensor_nbytes(shape, tensor.dtype)
                # a SETRANGE past the limit would fail mid-MULTI
                conn.check_entry_size(path, nbytes, where, chunk=meta.chunk)
                create.append(_backend.Op("zero", path, meta, nbytes=nbytes))
            elif not meta.is_tensor:
                raise UnsupportedOperationError(
                    f"entry {path!r} of {where} is a nested tensordict; write a TensorDict into it"
                )
            elif meta.chunk is None and meta.nbytes > conn.max_bulk:
                # a registered size no server string can hold (a registry edited by hand): refused
                # before a payload of its rows is built (which could need terabytes)
                raise CorruptMetadataError(
                    f"entry {path!r} of {where} is registered with {meta.nbytes} bytes in one string, more than "
                    f"the server's proto-max-bulk-len of {conn.max_bulk} allows: its registry entry is damaged"
                )
            dtype = _codec.entry_dtype(meta)
            feat_shape = tuple((meta.shape or ())[nb:])
            payload = _row_payload(value, dtype, tuple(new_bs) + feat_shape, path, where, index)
            row_bytes = _codec.tensor_nbytes(feat_shape, dtype)
            flat, view = _codec.tensor_view(payload)
            keep.append(flat)
            groups.append((path, spans.runs(row_bytes), view))
        if not groups and not nontensor:
            return
        expected = str(layout.lv)
        if nontensor or create:
            changed = conn.run(
                lambda c: _row_writes.write_runs_watched(
                    c, conn.keys, conn.runner, groups, expected=expected, creates=create, nontensor=nontensor
                )
            )
            if changed:
                conn.layout = None
        elif _row_writes.choose_write(groups) == "multi":
            conn.write_rows(groups, expected)
        else:
            conn.script(*_row_writes.write_runs_call(conn.keys, groups, expected=expected))

    optimistic(attempt, where=where, what="an indexed write", on_stale=lambda: store._layout(refresh=True))


def _check_parents(layout: _backend.Layout, path: tuple[str, ...], where: str) -> None:
    """A new key under an entry that is not a nested tensordict: the TypeError TensorDict raises."""
    for i in range(1, len(path)):
        parent = layout.entries.get(path[:i])
        if parent is not None and not parent.is_node:
            raise TypeError(
                f"cannot write {path!r} in {where} at an index: {path[:i]!r} is a "
                f"{'tensor' if parent.is_tensor else 'non-tensor'} entry, not a nested tensordict"
            )


def _nontensor_update(
    path: tuple[str, ...], value: NonTensorData | NonTensorStack, rows: torch.Tensor, batch_size: torch.Size, order: list[int], where: str,
    policy: _codec.PicklePolicy | None,
) -> _Update:
    def update(old_meta: Entry | None, old: bytes | None) -> tuple[Entry, bytes]:
        return _values.nontensor_after_index_write(path, old_meta, old, value, rows, batch_size, order, where, policy)

    return update
