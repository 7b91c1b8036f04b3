"""The dense :class:`TensorDictStore`: the class, its constructors, reads, indexed writes, ring buffer and lifetime."""

from __future__ import annotations

from tdstore.store.core import TensorDictStore

__all__ = ["TensorDictStore"]
