"""Turns values into commit ops and registry metadata, and snapshot bytes back into values.

No I/O. Registry metadata is one :class:`~tdstore._core.layout.Entry` per entry path (its
docstring gives the JSON wire format): a tensor, a nested tensordict, or a non-tensor
value, whose ``stack`` 0 is one value for the whole batch (``NonTensorData``) and ``k > 0`` a
``NonTensorStack`` over the first ``k`` batch dims, stored as nested lists.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from tensordict.base import NO_DEFAULT  # the "argument left out" sentinel of TensorDictBase

from tdstore._core import codec as _codec
from tdstore._core.layout import MAX_DIM, MAX_DIMS, MAX_ENTRY_BYTES, NONTENSOR_ENCODINGS, Entry, is_dims
from tdstore._core.layout import is_names as _is_names
from tdstore.errors import CorruptMetadataError, DataLostError, SchemaError, UnsafePayloadError

if TYPE_CHECKING:
    from tensordict import NonTensorData, NonTensorStack

__all__ = [
    "NO_DEFAULT", "is_no_default", "tensor_meta", "nontensor_parts", "decode_value", "decode_stored_non_tensor", "check_meta", "order_key",
    "is_dims", "MAX_DIM", "MAX_DIMS", "MAX_ENTRY_BYTES", "NONTENSOR_ENCODINGS",
]


def is_no_default(value: object) -> bool:
    """Whether ``value`` is TensorDict's NO_DEFAULT sentinel (an argument left out)."""
    return value is NO_DEFAULT


def tensor_meta(tensor: torch.Tensor, order: list[int] | tuple[int, ...] | None) -> Entry:
    return Entry.tensor(_codec.dtype_name(tensor.dtype), tensor.shape, order)


def node_meta(batch_size: torch.Size | list[int], names: list[str | None] | None, order: list[int] | tuple[int, ...] | None) -> Entry:
    if names is not None and all(n is None for n in names):
        names = None
    return Entry.node(batch_size, names, order)


def nontensor_parts(value: NonTensorData | NonTensorStack, order: list[int] | tuple[int, ...] | None, policy: _codec.PicklePolicy | None = None) -> tuple[Entry, bytes]:
    """Metadata and payload of a NonTensorData / NonTensorStack value."""
    from tensordict import NonTensorStack

    if isinstance(value, NonTensorStack):
        data = value.tolist()
        stack = value.batch_dims
    else:
        data = value.data
        stack = 0
    enc, payload = _codec.encode_non_tensor(data, policy)
    return Entry.non_tensor(enc, stack, order), payload


def order_key(meta: Entry) -> tuple[int, ...]:
    return meta.order_key


def check_meta(path: tuple[str, ...], meta: Entry, where: str) -> Entry:
    """Checks that one registry entry (validated field by field when parsed, see
    :meth:`~tdstore._core.layout.Entry.from_json`) is of a kind a dense store holds, and of
    a dtype this torch knows.

    Raises :class:`CorruptMetadataError` naming the entry otherwise (a lazy store's leaf).
    """
    if meta.kind not in ("t", "td", "nt"):
        raise CorruptMetadataError(f"entry {path!r} of {where} has malformed metadata {meta.to_json()!r:.200}")
    if meta.dtype is not None and meta.dtype not in _codec.DTYPE_BY_NAME:  # a dtype this torch lacks
        try:
            _codec.dtype_from_name(meta.dtype)
        except ValueError as err:
            raise CorruptMetadataError(f"entry {path!r} of {where}: field 'dtype': {err}") from None
    return meta


def check_tree(
    batch_size: list[int], entries: Mapping[tuple[str, ...], Entry], where: str
) -> None:
    """Validates a registry as a whole, after :func:`check_meta` of each entry: every entry's
    parent exists and is a nested tensordict, and every entry's shape (or batch size)
    starts with its parent's batch size."""
    for path, meta in entries.items():
        if len(path) > 1:
            parent = entries.get(path[:-1])
            if parent is None or not parent.is_node:
                raise CorruptMetadataError(
                    f"entry {path!r} of {where} has no nested tensordict {path[:-1]!r} above it"
                )
            owner = list(parent.batch_size or ())
        else:
            owner = batch_size
        dims = meta.shape if meta.is_tensor else meta.batch_size if meta.is_node else None
        if dims is not None and list(dims[: len(owner)]) != owner:
            field = "shape" if meta.is_tensor else "batch_size"
            raise CorruptMetadataError(
                f"entry {path!r} of {where} has {field} {list(dims)}, which does not start with its owner's "
                f"batch size {owner}"
            )


def parse_dims(raw: str | None, field: str, where: str, *, default: str = "[]") -> list[int]:
    """A batch size (JSON list of ints) read from the store's meta hash, validated."""
    try:
        value = json.loads(raw if raw is not None else default)
    except (ValueError, RecursionError):
        value = raw
    if not is_dims(value):
        raise CorruptMetadataError(f"store {where} has a malformed {field} {raw!r:.200} in its meta hash")
    return value


def check_names(names: Sequence[object], where: str) -> None:
    """Refuses dim names that are not str or None, before anything is written.

    TensorDict keeps any object as a name; the store records names as a JSON list of strings
    (that other processes read back), so a number, a bool or a tuple is refused here.
    """
    for name in names:
        if name is not None and not isinstance(name, str):
            raise SchemaError(
                f"dimension names of {where} must be str or None, got {name!r} "
                f"({type(name).__name__}) in {list(names)!r}; nothing was written"
            )


def parse_names(raw: str | None, ndim: int, where: str) -> list[str | None] | None:
    """The dim names (JSON list or null) read from the store's meta hash, validated."""
    try:
        value = json.loads(raw or "null")
    except (ValueError, RecursionError):
        value = raw
    if not _is_names(value, ndim):
        raise CorruptMetadataError(f"store {where} has malformed names {raw!r:.200} in its meta hash")
    return cast("list[str | None] | None", value)


def to_device(tensor: torch.Tensor, device: torch.device, path: tuple[str, ...], where: str) -> torch.Tensor:
    """Moves a value read from the server to the store's device, or says why it cannot."""
    try:
        return tensor.to(device, non_blocking=False)
    except (AssertionError, RuntimeError) as err:  # torch built without CUDA, or no such device here
        raise RuntimeError(
            f"entry {path!r} of {where} cannot be moved to the store's device {device} in this process "
            f"({err}); reconnect with TensorDictStore.from_store(td_id=..., device='cpu') to read it here"
        ) from err


def decode_stored_non_tensor(meta: Entry, payload: bytes | None, policy: _codec.PicklePolicy | None, path: object, where: str) -> object:
    """The value a non-tensor entry holds, read to be updated in place: its bytes gone raise
    :class:`~tdstore.errors.DataLostError`, bytes that do not decode
    :class:`~tdstore.errors.CorruptMetadataError` (an UnsafePayloadError as it is)."""
    from tdstore.errors import DataLostError, UnsafePayloadError

    if payload is None:
        raise DataLostError(f"non-tensor entry {path!r} of {where} is registered but its bytes are gone from the server")
    try:
        return _codec.decode_non_tensor(meta.enc or "", bytes(payload), policy)
    except (ValueError, RecursionError) as err:
        if isinstance(err, UnsafePayloadError):
            raise
        raise CorruptMetadataError(f"non-tensor entry {path!r} of {where} holds bytes that do not decode: {err}") from None


def decode_value(
    path: tuple[str, ...],
    meta: Entry,
    data: bytes | bytearray | memoryview | torch.Tensor | None,
    *,
    owner_batch_size: torch.Size,
    device: torch.device | None,
    owned: bool,
    where: str,
    policy: _codec.PicklePolicy | None = None,
) -> Any:
    """The tensor or non-tensor value of one entry, from its metadata and bytes."""
    if data is None:
        raise DataLostError(
            f"entry {path!r} of {where} is registered but its bytes are gone from the server "
            "(evicted under a maxmemory policy, or deleted by hand); use maxmemory-policy "
            "noeviction for servers that hold stores"
        )
    if meta.is_tensor:
        try:
            tensor = _codec.tensor_from_reply(data, _codec.entry_dtype(meta), tuple(meta.shape or ()), owned=owned)
        except ValueError as err:
            raise CorruptMetadataError(f"entry {path!r} of {where}: {err}") from None
        if device is not None and device.type != "cpu":
            tensor = to_device(tensor, device, path, where)
        return tensor
    if meta.is_non_tensor:
        from tensordict import NonTensorData, NonTensorStack

        try:
            value = _codec.decode_non_tensor(meta.enc or "", bytes(data), policy)
        except (ValueError, RecursionError) as err:  # UnsafePayloadError is raised as it is
            if isinstance(err, UnsafePayloadError):
                raise
            raise CorruptMetadataError(f"non-tensor entry {path!r} of {where} holds bytes that do not decode: {err}") from None
        stack = meta.stack
        if stack:
            try:
                out = NonTensorStack.from_list(value) if isinstance(value, list) else None
            except (ValueError, TypeError, RuntimeError, RecursionError, IndexError):
                out = None
            if out is None:
                raise CorruptMetadataError(
                    f"non-tensor entry {path!r} of {where} is a stack over {stack} dims (field 'stack') "
                    "but holds no list of that depth"
                )
            if out.batch_size != owner_batch_size[:stack]:
                raise CorruptMetadataError(
                    f"non-tensor entry {path!r} of {where} holds a stack of shape "
                    f"{list(out.batch_size)}, expected {list(owner_batch_size[:stack])}"
                )
            return out
        return NonTensorData(data=value, batch_size=owner_batch_size, device=device)
    raise SchemaError(f"entry {path!r} is a nested tensordict, not a value")


def _flatten_nested(value: Any, ndim: int) -> list[Any]:
    if ndim == 0:
        return [value]
    out: list[Any] = []
    for item in value:
        out.extend(_flatten_nested(item, ndim - 1))
    return out


def _nest(flat: list[object], shape: tuple[int, ...]) -> object:
    if not shape:
        return flat[0]
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def _all_equal(values: list[object]) -> bool:
    try:
        return all(type(v) is type(values[0]) and bool(v == values[0]) for v in values[1:])
    except Exception:  # noqa: BLE001 - values without a plain truth value differ
        return False


def nontensor_after_index_write(
    path: tuple[str, ...],
    old_meta: Entry | None,
    old_payload: bytes | None,
    value: NonTensorData | NonTensorStack,
    rows: torch.Tensor,
    batch_size: torch.Size,
    order: list[int] | tuple[int, ...] | None,
    where: str,
    policy: _codec.PicklePolicy | None = None,
) -> tuple[Entry, bytes]:
    """Metadata and payload of a non-tensor entry after ``entry[idx] = value``.

    ``rows`` are the flat batch rows the index selects, in result order (repeated rows:
    the last write wins, as in torch). As in TensorDict, a ``NonTensorData`` written at
    some rows of an entry that holds another value becomes a stack (one value per row);
    a new ``NonTensorStack`` key holds ``None`` in the rows not written.
    """
    from tensordict import NonTensorData, NonTensorStack

    numel = math.prod(batch_size)
    nb = len(batch_size)
    if old_meta is None:
        if isinstance(value, NonTensorData):
            return nontensor_parts(NonTensorData(data=value.data, batch_size=batch_size), order, policy)
        flat: list[object] = [None] * numel
    else:
        old = decode_stored_non_tensor(old_meta, old_payload, policy, path, where)
        stack = old_meta.stack
        if stack == 0:
            flat = [old] * numel
        elif stack == nb:
            try:
                flat = _flatten_nested(old, nb)
            except (TypeError, IndexError, ValueError, RecursionError) as err:
                raise CorruptMetadataError(
                    f"non-tensor entry {path!r} of {where} holds no stack over {nb} batch dims: {err}"
                ) from None
            if len(flat) != numel:
                raise CorruptMetadataError(
                    f"non-tensor entry {path!r} of {where} holds {len(flat)} values for {numel} rows"
                )
        else:
            raise SchemaError(
                f"non-tensor entry {path!r} of {where} is a stack over {stack} of {nb} batch dims; "
                "write the whole entry instead"
            )
        order = old_meta.order if old_meta.order is not None else order
    n = rows.numel()
    if isinstance(value, NonTensorStack):
        new = _flatten_nested(value.tolist(), value.batch_dims)
        if len(new) != n:
            raise RuntimeError(
                f"cannot write a stack of {len(new)} non-tensor values into {n} rows of {path!r} in {where}"
            )
    else:
        new = [value.data] * n
    for row, item in zip(rows.reshape(-1).tolist(), new, strict=True):
        flat[row] = item
    if old_meta is not None and old_meta.stack == 0 and numel and _all_equal(flat):
        enc, payload = _codec.encode_non_tensor(flat[0], policy)
        return Entry.non_tensor(enc, 0, order), payload
    enc, payload = _codec.encode_non_tensor(_nest(flat, tuple(batch_size)) if nb else flat[0], policy)
    return Entry.non_tensor(enc, nb, order), payload
