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

from tdstore._backend.retry import OutcomeUnknownError, RetryPolicy, ServerUnavailableError
from tdstore._core import moved as _moved
from tdstore._core.codec import PicklePolicy, set_pickle_policy
from tdstore._core.progress import set_progress
from tdstore.errors import (
    ClientConfigError,
    CorruptMetadataError,
    DataLostError,
    EntryNotFoundError,
    EntryTooLargeError,
    EventLoopError,
    FormatVersionError,
    PartialWriteError,
    SchemaError,
    ServerAuthError,
    ServerOutOfMemoryError,
    ServerPermissionError,
    ServerTLSError,
    StaleLayoutError,
    StoreClosedError,
    StoreExistsError,
    StoreLockedError,
    StoreNotFoundError,
    TDStoreError,
    UnsafePayloadError,
    UnsupportedOperationError,
)
from tdstore.lazy import LazyStackedTensorDictStore
from tdstore.sharded import ShardedStore
from tdstore.store import TensorDictStore

__version__ = "0.1.0"

_moved.install()  # old module names still import (pickles made before the layer packages)

__all__ = [
    "TensorDictStore",
    "ShardedStore",
    "LazyStackedTensorDictStore",
    "TDStoreError",
    "StoreNotFoundError",
    "StoreExistsError",
    "StoreClosedError",
    "StoreLockedError",
    "EntryNotFoundError",
    "EntryTooLargeError",
    "SchemaError",
    "ServerAuthError",
    "ServerOutOfMemoryError",
    "ServerPermissionError",
    "ServerTLSError",
    "DataLostError",
    "StaleLayoutError",
    "PartialWriteError",
    "CorruptMetadataError",
    "FormatVersionError",
    "UnsupportedOperationError",
    "ClientConfigError",
    "EventLoopError",
    "UnsafePayloadError",
    "ServerUnavailableError",
    "OutcomeUnknownError",
    "RetryPolicy",
    "PicklePolicy",
    "set_pickle_policy",
    "set_progress",
    "__version__",
]
