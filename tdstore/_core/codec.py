"""Tensor <-> bytes, dtype names and non-tensor encoding. Pure functions, no I/O.

Tensors travel as their contiguous CPU bytes in native (little-endian) order. Writes hand
redis-py a ``memoryview`` of the tensor's own memory, so no ``bytes`` copy is made; reads
wrap the reply's buffer without copying it when this process owns the reply exclusively
(see :func:`tensor_from_reply`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import pickle
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from tdstore._core.layout import DTYPE_ITEMSIZE, Entry

__all__ = [
    "DTYPE_BY_NAME",
    "dtype_name",
    "dtype_from_name",
    "entry_dtype",
    "tensor_nbytes",
    "tensor_view",
    "tensor_from_reply",
    "encode_non_tensor",
    "decode_non_tensor",
    "is_json_faithful",
    "PicklePolicy",
    "default_pickle_policy",
    "set_pickle_policy",
]

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("tdstore stores tensors in little-endian order and needs a little-endian host")

_DTYPE_NAMES = list(DTYPE_ITEMSIZE)

#: Every torch dtype tdstore can store, by its canonical name (the one written on the server).
DTYPE_BY_NAME: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _DTYPE_NAMES if isinstance(getattr(torch, name, None), torch.dtype)
}
_NAME_BY_DTYPE: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPE_BY_NAME.items()}

# torch.frombuffer warns that a bytes reply is read-only; tdstore only wraps replies
# that nothing else references (tensor_from_reply), so writing through them is safe.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def dtype_name(dtype: torch.dtype) -> str:
    """The name under which ``dtype`` is written on the server."""
    try:
        return _NAME_BY_DTYPE[dtype]
    except KeyError:
        raise TypeError(
            f"dtype {dtype} cannot be stored: tdstore stores {', '.join(DTYPE_BY_NAME)}"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; raises ``ValueError`` for an unknown name."""
    try:
        return DTYPE_BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"unknown dtype {name!r} in the store's metadata (this torch knows {', '.join(DTYPE_BY_NAME)})"
        ) from None


def entry_dtype(meta: Entry) -> torch.dtype:
    """The ``torch.dtype`` of a tensor entry of the registry (its dtype name, mapped)."""
    assert meta.dtype is not None, meta
    return dtype_from_name(meta.dtype)


def tensor_nbytes(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> int:
    return math.prod(shape) * _itemsize(dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def tensor_view(tensor: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """The contiguous CPU tensor and a byte ``memoryview`` of its memory, without a copy.

    The returned tensor must be kept alive as long as the view is used; the view itself
    holds a reference, so passing it to redis-py is enough.
    """
    if (
        tensor.is_contiguous() and tensor.device.type == "cpu" and not tensor.requires_grad
        and not tensor.is_conj() and not tensor.is_neg() and tensor.numel() > 1
    ):
        # the common case, in fewer torch calls (extend() and row writes send these)
        flat = tensor.reshape(-1)
        return flat, (flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat).numpy().data
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if flat.is_conj():
        flat = flat.resolve_conj()
    if flat.is_neg():
        flat = flat.resolve_neg()
    flat = flat.contiguous().reshape(-1)
    if flat.numel() == 1 and flat.stride() != (1,):
        # a one-element view keeps its parent's stride (it counts as contiguous), which
        # .view(torch.uint8) refuses
        flat = flat.clone(memory_format=torch.contiguous_format)
    if flat.numel() == 0:
        return flat, memoryview(b"")
    raw = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    return flat, raw.numpy().data  # a memoryview of the tensor's bytes, no copy


def tensor_from_reply(
    data: bytes | bytearray | memoryview | torch.Tensor,
    dtype: torch.dtype,
    shape: tuple[int, ...] | torch.Size,
    *,
    owned: bool,
) -> torch.Tensor:
    """Wraps reply bytes as a tensor of ``dtype`` and ``shape``.

    Args:
        data: the bytes read from the server.
        dtype, shape: what the bytes hold; their size must match exactly.
        owned: True when nothing but the caller references ``data`` (a reply parsed from
            a socket). The tensor then shares the reply's memory. Otherwise (an in-process
            server, such as fakeredis, may hand out its own stored object) it is copied.
    """
    expected = tensor_nbytes(shape, dtype)
    if isinstance(data, torch.Tensor):  # read in pieces into a fresh flat uint8 buffer (tdstore._backend.large)
        if data.numel() != expected:
            raise ValueError(f"expected {expected} bytes for {dtype} {list(shape)}, got {data.numel()}")
        flat = data if dtype == torch.uint8 else data.view(dtype)
        return flat.reshape(tuple(shape))
    if len(data) != expected:
        raise ValueError(f"expected {expected} bytes for {dtype} {list(shape)}, got {len(data)}")
    if expected == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    if not owned or len(data) <= 1 or isinstance(data, memoryview):
        # bytes of length <= 1 are interned singletons; never write through those
        data = bytearray(data)
    flat = torch.frombuffer(data, dtype=torch.uint8)
    if dtype != torch.uint8:
        flat = flat.view(dtype)
    return flat.reshape(tuple(shape))


def is_json_faithful(value: Any) -> bool:
    """Whether ``json.loads(json.dumps(value))`` gives back an equal value of the same types."""
    if value is None or isinstance(value, (bool, str)):
        return True
    if type(value) is int:
        return True
    if type(value) is float:
        return math.isfinite(value)
    if type(value) is list:
        return all(is_json_faithful(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and is_json_faithful(v) for k, v in value.items())
    return False


@dataclass(frozen=True)
class PicklePolicy:
    """Whether pickled non-tensor values may be written and read, and the key that signs them.

    ``allow=False``: nothing is ever unpickled (a read of a pickled value raises
    :class:`~tdstore.errors.UnsafePayloadError`), and values that JSON cannot hold are
    refused on write. ``key``: pickled payloads are signed with HMAC-SHA256 under it, and
    a reader with the key rejects any pickled payload whose signature does not verify, so
    a writer without the key cannot make readers run code.
    """

    allow: bool = True
    key: bytes | None = None


_DEFAULT_POLICY: list[PicklePolicy] = []


def default_pickle_policy() -> PicklePolicy:
    """The process-wide policy: set_pickle_policy(), else TDSTORE_ALLOW_PICKLE / TDSTORE_PICKLE_KEY."""
    if _DEFAULT_POLICY:
        return _DEFAULT_POLICY[0]
    allow = os.environ.get("TDSTORE_ALLOW_PICKLE", "1").strip().lower() not in ("0", "false", "no", "off")
    key = os.environ.get("TDSTORE_PICKLE_KEY")
    return PicklePolicy(allow, key.encode() if key else None)


def set_pickle_policy(*, allow: bool | None = None, key: bytes | str | None = None) -> None:
    """Sets the process-wide pickle policy for stores created afterwards (see PicklePolicy).

    With neither argument, the policy goes back to the environment's
    (``TDSTORE_ALLOW_PICKLE``, ``TDSTORE_PICKLE_KEY``).
    """
    if allow is None and key is None:
        _DEFAULT_POLICY.clear()
        return
    if isinstance(key, str):
        key = key.encode()
    _DEFAULT_POLICY[:] = [PicklePolicy(True if allow is None else bool(allow), key)]


_SIGNED = b"TDSH1"


def encode_non_tensor(value: object, policy: PicklePolicy | None = None) -> tuple[str, bytes]:
    """Encodes a non-tensor value: JSON when it round-trips exactly, pickle otherwise."""
    if is_json_faithful(value):
        return "json", json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    policy = policy or default_pickle_policy()
    if not policy.allow:
        from tdstore.errors import UnsafePayloadError

        raise UnsafePayloadError(
            f"a {type(value).__name__} cannot be stored as JSON, and pickle is switched off "
            "(allow_pickle=False); store a JSON-compatible value"
        )
    try:
        payload = pickle.dumps(value, protocol=5)
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise TypeError(
            f"a {type(value).__name__} value is not JSON-compatible and cannot be pickled ({err}); "
            "store a JSON-compatible or picklable value"
        ) from err
    if policy.key is not None:
        return "pickle", _SIGNED + hmac.new(policy.key, payload, hashlib.sha256).digest() + payload
    return "pickle", payload


def decode_non_tensor(encoding: str, payload: bytes, policy: PicklePolicy | None = None) -> Any:
    """Inverse of :func:`encode_non_tensor`; checks the pickle policy before unpickling."""
    if encoding == "json":
        return json.loads(payload)
    if encoding != "pickle":
        raise ValueError(f"unknown non-tensor encoding {encoding!r}")
    from tdstore.errors import UnsafePayloadError

    policy = policy or default_pickle_policy()
    if not policy.allow:
        raise UnsafePayloadError(
            "this value is pickled, and pickle is switched off (allow_pickle=False): a pickle "
            "from the server could run code in this process"
        )
    signed = payload[: len(_SIGNED)] == _SIGNED
    if policy.key is not None:
        if not signed:
            raise UnsafePayloadError("this pickled value is not signed, and this reader requires signatures (pickle_key)")
        digest, body = payload[len(_SIGNED) : len(_SIGNED) + 32], payload[len(_SIGNED) + 32 :]
        if not hmac.compare_digest(digest, hmac.new(policy.key, body, hashlib.sha256).digest()):
            raise UnsafePayloadError("the signature of this pickled value does not verify: it was not written with this pickle_key")
        return pickle.loads(body)
    if signed:
        raise UnsafePayloadError("this pickled value is signed; pass the writer's pickle_key to read it")
    return pickle.loads(payload)
