"""Indexed writes (``store[idx] = value``, ``set_at_``): every entry's rows in one atomic step.

The rows are written on the server by the ``write_runs`` script; nothing is read back
first. Entries that do not exist yet are created zero-filled by a ``commit`` in the same
MULTI, and the ``write_runs`` call then expects the layout version that commit produces,
so either both apply or neither does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from tensordict import NonTensorData, NonTensorStack

from tdstore import _backend, _codec, _io, _values
from tdstore._indexing import normalize_index, row_runs, select_rows
from tdstore.errors import StaleLayoutError, UnsupportedOperationError

if TYPE_CHECKING:
    from tdstore.store import TensorDictStore

_MAX_RETRIES = _io.MAX_RETRIES


def _row_payload(value: Any, dtype: torch.dtype, shape: tuple[int, ...], key: tuple[str, ...], where: str) -> torch.Tensor:
    tensor = torch.as_tensor(value)
    if tensor.dtype != dtype:
        tensor = tensor.to(dtype)
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
    index: Any,
    targets: Mapping[tuple[str, ...], Any],
    *,
    broadcast: bool = False,
    value_batch: torch.Size | None = None,
) -> None:
    conn = store._conn
    index = normalize_index(index)
    where = store._where()
    for attempt in range(_MAX_RETRIES):
        layout = store._layout()
        node = store._node(layout)
        batch_size = torch.Size(node["batch_size"])
        nb = len(batch_size)
        rows = select_rows(index, batch_size)
        new_bs = rows.shape
        groups: list[tuple[tuple[str, ...], list[tuple[int, int]], Any]] = []
        keep: list[Any] = []
        create: list[_backend.Op] = []
        nontensor: list[tuple[tuple[str, ...], Any]] = []
        seq = 0
        for path, value in targets.items():
            meta = layout.entries.get(path)
            if isinstance(value, (NonTensorData, NonTensorStack)):
                if meta is not None and meta["k"] != "nt":
                    raise UnsupportedOperationError(
                        f"cannot write a non-tensor value into the {'tensor' if meta['k'] == 't' else 'nested'} "
                        f"entry {path!r} of {where} at an index"
                    )
                if store._owner_batch_size(layout, path) != batch_size:
                    raise UnsupportedOperationError(
                        f"non-tensor entry {path!r} of {where} lives in a nested tensordict with more batch "
                        "dims; write it through that nested store"
                    )
                seq += 1
                nontensor.append((path, _nontensor_update(path, value, rows, batch_size, [layout.lv + 1, seq], where, conn.pickle_policy)))
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
                meta = {"k": "t", "dtype": _codec.dtype_name(tensor.dtype), "shape": list(shape), "o": [layout.lv + 1, seq]}
                create.append(_backend.Op("zero", path, meta, nbytes=_codec.tensor_nbytes(shape, tensor.dtype)))
            elif meta["k"] != "t":
                raise UnsupportedOperationError(
                    f"entry {path!r} of {where} is a nested tensordict; write a TensorDict into it"
                )
            dtype = _codec.dtype_from_name(meta["dtype"])
            feat_shape = tuple(meta["shape"][nb:])
            payload = _row_payload(value, dtype, tuple(new_bs) + feat_shape, path, where)
            row_bytes = _codec.tensor_nbytes(feat_shape, dtype)
            flat, view = _codec.tensor_view(payload)
            keep.append(flat)
            groups.append((path, row_runs(rows, row_bytes), view))
        if not groups and not nontensor:
            return
        expected = str(layout.lv)
        try:
            if nontensor or (create and _backend.choose_write(groups) == "multi"):
                changed = conn.run(
                    lambda c: _backend.write_runs_watched(
                        c, conn.keys, conn.runner, groups, expected=expected, creates=create, nontensor=nontensor
                    )
                )
                if changed:
                    conn.layout = None
            elif create:
                conn.run(lambda c: _create_then_write(c, store, create, groups, layout.lv))
                conn.layout = None
            elif _backend.choose_write(groups) == "multi":
                conn.run(lambda c: _backend.write_runs_watched(c, conn.keys, conn.runner, groups, expected=expected))
            else:
                conn.run(lambda c: _backend.write_runs(c, conn.keys, conn.runner, groups, expected=expected))
        except StaleLayoutError:
            _io.backoff(attempt)
            store._layout(refresh=True)
            continue
        return
    raise StaleLayoutError(f"the layout of {where} kept changing during an indexed write")


def _nontensor_update(
    path: tuple[str, ...], value: Any, rows: torch.Tensor, batch_size: torch.Size, order: list[int], where: str,
    policy: Any,
) -> Any:
    def update(old_meta: dict[str, Any] | None, old: bytes | None) -> tuple[dict[str, Any], bytes]:
        return _values.nontensor_after_index_write(path, old_meta, old, value, rows, batch_size, order, where, policy)

    return update


async def _create_then_write(client: Any, store: TensorDictStore, create: list[_backend.Op], groups: Any, lv: int) -> None:
    conn = store._conn
    keys = conn.keys
    key_list = [keys.meta, keys.reg, keys.wv]
    wire_ops = []
    for op in create:
        key_list.append(keys.data(op.path))
        wire_ops.append({"op": "zero", "f": _keys_encode(op.path), "m": json.dumps(op.meta, separators=(",", ":")), "dst": str(len(key_list)), "n": str(op.nbytes)})
    commit_args = [str(lv), "1", "1", "", json.dumps(wire_ops, separators=(",", ":")), _backend.FORMAT_VERSION, ""]
    run_keys = [keys.meta, keys.wv]
    run_args: list[Any] = [str(lv + 1)]
    for path, runs, payload in groups:
        run_keys.append(keys.data(path))
        run_args.append(str(len(runs)))
        for offset, length in runs:
            run_args.extend((str(offset), str(length)))
        run_args.append(payload)
    import redis.exceptions

    from tdstore._backend import _raise_first_error

    for attempt in range(2):
        async with client.pipeline(transaction=True) as pipe:
            conn.runner.queue(pipe, "commit", key_list, commit_args)
            conn.runner.queue(pipe, "write_runs", run_keys, run_args)
            replies = await pipe.execute(raise_on_error=False)
        if attempt == 0 and isinstance(replies[0], redis.exceptions.NoScriptError):
            # the server lost its scripts (restart, SCRIPT FLUSH): neither ran; load and retry
            await conn.runner.load_all(client)
            continue
        _raise_first_error(replies)
        return


def _keys_encode(path: tuple[str, ...]) -> str:
    from tdstore._keys import encode_path

    return encode_path(path)
