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

from typing import Any

import torch

from tdstore import _codec
from tdstore.errors import CorruptMetadataError, SchemaError

__all__ = ["tensor_meta", "nontensor_parts", "decode_value", "check_meta", "order_key"]


def tensor_meta(tensor: torch.Tensor, order: list[int]) -> dict[str, Any]:
    return {"k": "t", "dtype": _codec.dtype_name(tensor.dtype), "shape": list(tensor.shape), "o": order}


def node_meta(batch_size: torch.Size | list[int], names: list[str | None] | None, order: list[int]) -> dict[str, Any]:
    if names is not None and all(n is None for n in names):
        names = None
    return {"k": "td", "batch_size": list(batch_size), "names": names, "o": order}


def nontensor_parts(value: Any, order: list[int]) -> tuple[dict[str, Any], bytes]:
    """Metadata and payload of a NonTensorData / NonTensorStack value."""
    from tensordict import NonTensorStack

    if isinstance(value, NonTensorStack):
        data = value.tolist()
        stack = value.batch_dims
    else:
        data = value.data
        stack = 0
    enc, payload = _codec.encode_non_tensor(data)
    return {"k": "nt", "enc": enc, "stack": stack, "o": order}, payload


def order_key(meta: dict[str, Any]) -> tuple[int, ...]:
    order = meta.get("o") or [0, 0]
    return tuple(int(x) for x in order)


def check_meta(path: tuple[str, ...], meta: Any, where: str) -> dict[str, Any]:
    """Validates one registry entry read from the server before it is used."""
    if not isinstance(meta, dict) or meta.get("k") not in ("t", "td", "nt"):
        raise CorruptMetadataError(f"entry {path!r} of {where} has malformed metadata {meta!r}")
    if meta["k"] == "t":
        shape = meta.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CorruptMetadataError(f"entry {path!r} of {where} has a malformed shape {shape!r}")
        try:
            _codec.dtype_from_name(meta.get("dtype", ""))
        except ValueError as err:
            raise CorruptMetadataError(f"entry {path!r} of {where}: {err}") from None
    elif meta["k"] == "td":
        bs = meta.get("batch_size")
        if not isinstance(bs, list) or not all(isinstance(d, int) and d >= 0 for d in bs):
            raise CorruptMetadataError(f"nested entry {path!r} of {where} has a malformed batch size {bs!r}")
    return meta


def decode_value(
    path: tuple[str, ...],
    meta: dict[str, Any],
    data: Any,
    *,
    owner_batch_size: torch.Size,
    device: torch.device | None,
    owned: bool,
    where: str,
) -> Any:
    """The tensor or non-tensor value of one entry, from its metadata and bytes."""
    if data is None:
        raise CorruptMetadataError(
            f"entry {path!r} of {where} is registered but its bytes are missing on the server "
            "(evicted or deleted by hand?)"
        )
    if meta["k"] == "t":
        dtype = _codec.dtype_from_name(meta["dtype"])
        try:
            tensor = _codec.tensor_from_reply(data, dtype, tuple(meta["shape"]), owned=owned)
        except ValueError as err:
            raise CorruptMetadataError(f"entry {path!r} of {where}: {err}") from None
        if device is not None and device.type != "cpu":
            tensor = tensor.to(device, non_blocking=False)
        return tensor
    if meta["k"] == "nt":
        from tensordict import NonTensorData, NonTensorStack

        value = _codec.decode_non_tensor(meta["enc"], bytes(data))
        stack = int(meta.get("stack", 0))
        if stack:
            out = NonTensorStack.from_list(value)
            if out.batch_size != owner_batch_size[:stack]:
                raise CorruptMetadataError(
                    f"non-tensor entry {path!r} of {where} holds a stack of shape "
                    f"{list(out.batch_size)}, expected {list(owner_batch_size[:stack])}"
                )
            return out
        return NonTensorData(data=value, batch_size=owner_batch_size, device=device)
    raise SchemaError(f"entry {path!r} is a nested tensordict, not a value")
