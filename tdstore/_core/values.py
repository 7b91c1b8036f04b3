"""Turns values into commit ops and registry metadata, and snapshot bytes back into values.

No I/O. Registry metadata (one JSON object per entry path, see ``_keys``):

* tensor: ``{"k": "t", "dtype": "float32", "shape": [...], "o": [lv, i]}``
* nested tensordict: ``{"k": "td", "batch_size": [...], "names": [...] | null, "o": ...}``
* non-tensor: ``{"k": "nt", "enc": "json" | "pickle", "stack": ndim, "o": ...}``, where
  ``stack`` 0 is one value for the whole batch (``NonTensorData``) and ``k > 0`` a
  ``NonTensorStack`` over the first ``k`` batch dims, stored as nested lists.

``o`` orders the keys as they were inserted: a registry hash does not keep order.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeGuard

import torch
from tensordict.base import NO_DEFAULT  # the "argument left out" sentinel of TensorDictBase

from tdstore._core import codec as _codec
from tdstore.errors import CorruptMetadataError, DataLostError, SchemaError, UnsafePayloadError

__all__ = ["NO_DEFAULT", "is_no_default", "tensor_meta", "nontensor_parts", "decode_value", "check_meta", "order_key"]


def is_no_default(value: Any) -> bool:
    """Whether ``value`` is TensorDict's NO_DEFAULT sentinel (an argument left out)."""
    return value is NO_DEFAULT


def tensor_meta(tensor: torch.Tensor, order: list[int]) -> dict[str, Any]:
    return {"k": "t", "dtype": _codec.dtype_name(tensor.dtype), "shape": list(tensor.shape), "o": order}


def node_meta(batch_size: torch.Size | list[int], names: list[str | None] | None, order: list[int]) -> dict[str, Any]:
    if names is not None and all(n is None for n in names):
        names = None
    return {"k": "td", "batch_size": list(batch_size), "names": names, "o": order}


def nontensor_parts(value: Any, order: list[int], policy: _codec.PicklePolicy | None = None) -> tuple[dict[str, Any], bytes]:
    """Metadata and payload of a NonTensorData / NonTensorStack value."""
    from tensordict import NonTensorStack

    if isinstance(value, NonTensorStack):
        data = value.tolist()
        stack = value.batch_dims
    else:
        data = value.data
        stack = 0
    enc, payload = _codec.encode_non_tensor(data, policy)
    return {"k": "nt", "enc": enc, "stack": stack, "o": order}, payload


def order_key(meta: dict[str, Any]) -> tuple[int, ...]:
    order = meta.get("o") or [0, 0]
    return tuple(int(x) for x in order)


#: The most dims a shape or batch size read from the server may have.
MAX_DIMS = 64
#: The largest dim read from the server (a larger one is damage, not data).
MAX_DIM = 2**62
#: The most bytes a tensor entry read from the server may have (2**48: 256 TiB).
MAX_ENTRY_BYTES = 2**48
#: The encodings of non-tensor entries.
NONTENSOR_ENCODINGS = ("json", "pickle")


def is_dims(value: Any) -> TypeGuard[list[int]]:
    """Whether ``value`` is a plausible shape or batch size: a list of at most
    :data:`MAX_DIMS` non-negative ints (booleans are not ints here) below :data:`MAX_DIM`."""
    return (
        isinstance(value, list)
        and len(value) <= MAX_DIMS
        and all(type(d) is int and 0 <= d <= MAX_DIM for d in value)
    )


def _is_names(value: Any, ndim: int) -> bool:
    return value is None or (
        isinstance(value, list) and len(value) == ndim and all(n is None or isinstance(n, str) for n in value)
    )


def check_meta(path: tuple[str, ...], meta: Any, where: str) -> dict[str, Any]:
    """Validates one registry entry read from the server before it is used.

    Raises :class:`CorruptMetadataError` naming the entry and the field, for every value a
    hand edit (or damage) may leave: wrong JSON types, booleans or floats or negative or
    huge dims, an unknown dtype or encoding, a chunking of implausibly many strings.
    """
    if not isinstance(meta, dict) or meta.get("k") not in ("t", "td", "nt"):
        raise CorruptMetadataError(f"entry {path!r} of {where} has malformed metadata {meta!r:.200}")
    order = meta.get("o")
    if order is not None and not (isinstance(order, list) and all(type(x) is int for x in order)):
        raise CorruptMetadataError(f"entry {path!r} of {where} has a malformed field 'o' (insertion order) {order!r:.200}")
    if meta["k"] == "t":
        shape = meta.get("shape")
        if not is_dims(shape):
            raise CorruptMetadataError(f"entry {path!r} of {where} has a malformed shape {shape!r:.200}")
        try:
            dtype = _codec.dtype_from_name(meta.get("dtype", ""))
        except (ValueError, TypeError) as err:
            raise CorruptMetadataError(f"entry {path!r} of {where}: field 'dtype': {err}") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > MAX_ENTRY_BYTES:
            raise CorruptMetadataError(
                f"entry {path!r} of {where} has a shape {shape} of {nbytes} bytes, more than any server holds"
            )
        chunk = meta.get("c")
        if chunk is not None:
            from tdstore._core import chunks as _chunks

            if not (type(chunk) is int and chunk > 0 and chunk % dtype.itemsize == 0):
                raise CorruptMetadataError(f"entry {path!r} of {where} has a malformed chunk size (field 'c') {chunk!r:.200}")
            if -(-nbytes // chunk) > _chunks.MAX_CHUNKS:
                raise CorruptMetadataError(
                    f"entry {path!r} of {where}: its chunk size (field 'c') {chunk} and shape {shape} make "
                    f"{-(-nbytes // chunk)} strings, more than the {_chunks.MAX_CHUNKS} an entry may have"
                )
    elif meta["k"] == "td":
        bs = meta.get("batch_size")
        if not is_dims(bs):
            raise CorruptMetadataError(f"nested entry {path!r} of {where} has a malformed batch size {bs!r:.200}")
        if not _is_names(meta.get("names"), len(bs)):
            raise CorruptMetadataError(f"nested entry {path!r} of {where} has malformed names {meta.get('names')!r:.200}")
    else:
        if meta.get("enc") not in NONTENSOR_ENCODINGS:
            raise CorruptMetadataError(f"non-tensor entry {path!r} of {where} has an unknown encoding (field 'enc') {meta.get('enc')!r:.200}")
        stack = meta.get("stack", 0)
        if not (type(stack) is int and 0 <= stack <= MAX_DIMS):
            raise CorruptMetadataError(f"non-tensor entry {path!r} of {where} has a malformed field 'stack' {stack!r:.200}")
    return meta


def check_tree(
    batch_size: list[int], entries: dict[tuple[str, ...], dict[str, Any]], where: str
) -> None:
    """Validates a registry as a whole, after :func:`check_meta` of each entry: every entry's
    parent exists and is a nested tensordict, and every entry's shape (or batch size)
    starts with its parent's batch size."""
    for path, meta in entries.items():
        if len(path) > 1:
            parent = entries.get(path[:-1])
            if parent is None or parent.get("k") != "td":
                raise CorruptMetadataError(
                    f"entry {path!r} of {where} has no nested tensordict {path[:-1]!r} above it"
                )
            owner = parent["batch_size"]
        else:
            owner = batch_size
        kind = meta["k"]
        dims = meta["shape"] if kind == "t" else meta["batch_size"] if kind == "td" else None
        if dims is not None and dims[: len(owner)] != owner:
            field = "shape" if kind == "t" else "batch_size"
            raise CorruptMetadataError(
                f"entry {path!r} of {where} has {field} {dims}, which does not start with its owner's "
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


def parse_names(raw: str | None, ndim: int, where: str) -> list[str | None] | None:
    """The dim names (JSON list or null) read from the store's meta hash, validated."""
    try:
        value = json.loads(raw or "null")
    except (ValueError, RecursionError):
        value = raw
    if not _is_names(value, ndim):
        raise CorruptMetadataError(f"store {where} has malformed names {raw!r:.200} in its meta hash")
    return value


def to_device(tensor: torch.Tensor, device: torch.device, path: tuple[str, ...], where: str) -> torch.Tensor:
    """Moves a value read from the server to the store's device, or says why it cannot."""
    try:
        return tensor.to(device, non_blocking=False)
    except (AssertionError, RuntimeError) as err:  # torch built without CUDA, or no such device here
        raise RuntimeError(
            f"entry {path!r} of {where} cannot be moved to the store's device {device} in this process "
            f"({err}); reconnect with TensorDictStore.from_store(td_id=..., device='cpu') to read it here"
        ) from err


def decode_value(
    path: tuple[str, ...],
    meta: dict[str, Any],
    data: Any,
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
    if meta["k"] == "t":
        dtype = _codec.dtype_from_name(meta["dtype"])
        try:
            tensor = _codec.tensor_from_reply(data, dtype, tuple(meta["shape"]), owned=owned)
        except ValueError as err:
            raise CorruptMetadataError(f"entry {path!r} of {where}: {err}") from None
        if device is not None and device.type != "cpu":
            tensor = to_device(tensor, device, path, where)
        return tensor
    if meta["k"] == "nt":
        from tensordict import NonTensorData, NonTensorStack

        try:
            value = _codec.decode_non_tensor(meta["enc"], bytes(data), policy)
        except (ValueError, RecursionError) as err:  # UnsafePayloadError is raised as it is
            if isinstance(err, UnsafePayloadError):
                raise
            raise CorruptMetadataError(f"non-tensor entry {path!r} of {where} holds bytes that do not decode: {err}") from None
        stack = int(meta.get("stack", 0))
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


def _nest(flat: list[Any], shape: tuple[int, ...]) -> Any:
    if not shape:
        return flat[0]
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def _all_equal(values: list[Any]) -> bool:
    try:
        return all(type(v) is type(values[0]) and bool(v == values[0]) for v in values[1:])
    except Exception:  # noqa: BLE001 - values without a plain truth value differ
        return False


def nontensor_after_index_write(
    path: tuple[str, ...],
    old_meta: dict[str, Any] | None,
    old_payload: bytes | None,
    value: Any,
    rows: torch.Tensor,
    batch_size: torch.Size,
    order: list[int],
    where: str,
    policy: _codec.PicklePolicy | None = None,
) -> tuple[dict[str, Any], bytes]:
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
        flat: list[Any] = [None] * numel
    else:
        old = _codec.decode_non_tensor(old_meta["enc"], bytes(old_payload or b""), policy)
        stack = int(old_meta.get("stack", 0))
        if stack == 0:
            flat = [old] * numel
        elif stack == nb:
            flat = _flatten_nested(old, nb)
        else:
            raise SchemaError(
                f"non-tensor entry {path!r} of {where} is a stack over {stack} of {nb} batch dims; "
                "write the whole entry instead"
            )
        order = old_meta.get("o", order)
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
    if old_meta is not None and int(old_meta.get("stack", 0)) == 0 and numel and _all_equal(flat):
        enc, payload = _codec.encode_non_tensor(flat[0], policy)
        return {"k": "nt", "enc": enc, "stack": 0, "o": order}, payload
    enc, payload = _codec.encode_non_tensor(_nest(flat, tuple(batch_size)) if nb else flat[0], policy)
    return {"k": "nt", "enc": enc, "stack": nb, "o": order}, payload
