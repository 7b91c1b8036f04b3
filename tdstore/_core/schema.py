"""A schema of ``from_schema`` checked, with no server: ``{key: (shape, dtype)}`` to the
entries' paths, shapes and dtypes, and a batch size; one :class:`~tdstore.errors.SchemaError`
naming the key and what was expected for anything else, before a store is touched."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch

from tdstore._core import codec as _codec
from tdstore._core.keys import as_path as _as_path
from tdstore.errors import SchemaError

__all__ = ["check_batch_size", "parse_schema"]


def parse_schema(schema: object) -> list[tuple[tuple[str, ...], list[int], torch.dtype]]:
    """The ``(path, shape, dtype)`` of each entry of ``schema``, in its order.

    Raises:
        SchemaError: not a mapping; a key that is not a key; a spec that is not ``(shape,
            dtype)``; a dtype a store cannot hold; a shape that is not non-negative ints; a key
            both an entry and the parent of another; a key twice.
    """
    if not isinstance(schema, Mapping):
        raise SchemaError(f"schema must be a mapping of key -> (shape, dtype), got {type(schema).__name__}")
    entries: list[tuple[tuple[str, ...], list[int], torch.dtype]] = []
    for key, spec in schema.items():
        try:
            path = _as_path(key)
        except TypeError as err:
            raise SchemaError(f"schema key {key!r}: {err}") from None
        if not isinstance(spec, (tuple, list)) or len(spec) != 2:
            raise SchemaError(f"schema entry {key!r} must be (shape, dtype), got {spec!r}")
        shape, dtype = spec
        if not isinstance(dtype, torch.dtype):
            raise SchemaError(f"schema entry {key!r}: dtype must be a torch.dtype, got {dtype!r}")
        try:
            _codec.dtype_name(dtype)
        except TypeError as err:
            raise SchemaError(f"schema entry {key!r}: {err}") from None
        try:
            shape = list(shape)
        except TypeError:
            raise SchemaError(f"schema entry {key!r}: shape must be a sequence of ints, got {shape!r}") from None
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise SchemaError(f"schema entry {key!r}: shape must hold non-negative ints, got {shape!r}")
        entries.append((path, shape, dtype))
    paths = [p for p, _, _ in entries]
    for p in paths:
        for q in paths:
            if len(q) > len(p) and q[: len(p)] == p:
                raise SchemaError(f"schema key {p!r} is both an entry and the parent of {q!r}")
    if len(set(paths)) != len(paths):
        raise SchemaError("schema has duplicate keys")
    return entries


def check_batch_size(batch_size: object) -> torch.Size:
    """``batch_size`` as a ``torch.Size`` of non-negative ints, or SchemaError."""
    try:
        bs = torch.Size(cast("Sequence[int]", batch_size))  # (anything else: TypeError or ValueError)
    except (TypeError, ValueError):
        raise SchemaError(f"batch_size must be a sequence of non-negative ints, got {batch_size!r}") from None
    if any(d < 0 for d in bs):
        raise SchemaError(f"batch_size must hold non-negative ints, got {list(bs)}")
    return bs
