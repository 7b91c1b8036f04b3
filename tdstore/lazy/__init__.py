"""The :class:`LazyStackedTensorDictStore`: a lazy stack whose elements live on a server."""

from __future__ import annotations

from tdstore.lazy.core import (
    LazyStackedTensorDictStore,
    _unpickle,  # noqa: F401 - pickles made before tdstore.lazy was a package name it here
)

__all__ = ["LazyStackedTensorDictStore"]
