"""tdstore: share PyTorch TensorDicts between processes and machines through a Redis-wire server.

Examples:
    >>> import torch
    >>> from tdstore import TensorDictStore
    >>> store = TensorDictStore(batch_size=[4])
    >>> store["x"] = torch.arange(4)
    >>> store[1:3]["x"]
    tensor([1, 2])
    >>> store.clear_redis()
    >>> store.close()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tdstore import errors as _errors
from tdstore._core import moved as _moved
from tdstore._core.progress import set_progress
from tdstore.errors import *  # noqa: F403 - every exception class of tdstore.errors is importable from tdstore too

if TYPE_CHECKING:
    from tdstore._backend.retry import RetryPolicy
    from tdstore._core.codec import PicklePolicy, set_pickle_policy
    from tdstore.lazy import LazyStackedTensorDictStore
    from tdstore.sharded import ShardedStore
    from tdstore.store import TensorDictStore

#: Names imported on first use (module ``__getattr__``): the stores import torch and tensordict,
#: which the ``tdstore`` command (``--help``, ``ls``, ``info``, ``rm``, ``serve``) does not need.
_LAZY: dict[str, str] = {
    "TensorDictStore": "tdstore.store",
    "LazyStackedTensorDictStore": "tdstore.lazy",
    "ShardedStore": "tdstore.sharded",
    "RetryPolicy": "tdstore._backend.retry",
    "PicklePolicy": "tdstore._core.codec",
    "set_pickle_policy": "tdstore._core.codec",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tdstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"

_moved.install()  # old module names still import (pickles made before the layer packages)

__all__ = [
    "TensorDictStore",
    "ShardedStore",
    "LazyStackedTensorDictStore",
    # the exception classes, as tdstore.errors lists them
    *(name for name in _errors.__all__ if isinstance(getattr(_errors, name), type)),
    "RetryPolicy",
    "PicklePolicy",
    "set_pickle_policy",
    "set_progress",
    "__version__",
]
