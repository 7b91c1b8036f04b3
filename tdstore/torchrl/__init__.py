"""TorchRL replay-buffer storage that keeps its rows in a :class:`~tdstore.TensorDictStore`.

``ReplayBuffer(storage=TensorDictStoreStorage(...), writer=TensorDictStoreWriter())`` keeps
the buffer on a Redis-wire server, so any number of processes (on any machines) can append
to and sample from one buffer. The writer appends through the store's atomic cursor
(:meth:`~tdstore.TensorDictStore.extend`, one server-side step): concurrent writers never
get the same rows, never leave a gap, and the buffer's length is the server's count, the
same in every process.

:class:`TensorDictStorePrioritizedSampler` adds TorchRL's prioritized replay with the
priorities kept on the server (``store.enable_priorities``), shared by every process's
buffer: ``ReplayBuffer(sampler=...)``, ``PrioritizedReplayBuffer(sampler=...)``, and
:class:`TensorDictStorePrioritizedReplayBuffer` for ``TensorDictPrioritizedReplayBuffer``
(:func:`prioritized_replay_buffer` builds either; docs/torchrl.md).

:class:`TensorDictStoreSliceSampler` is TorchRL's ``SliceSampler`` with the trajectory slices
drawn on the server (``store.sample_slices``), and :class:`TensorDictStorePrioritizedSliceSampler`
draws them by the priority of their start row (:mod:`tdstore.torchrl.slices`).

:class:`ShardedStoreStorage`, :class:`ShardedStoreWriter` and :class:`ShardedStorePrioritizedSampler`
do the same over a :class:`~tdstore.ShardedStore`, a buffer split over several stores (spread
over Redis Cluster masters): appends go to one shard each, samples draw from the union of the
shards (:mod:`tdstore.torchrl.sharded`).

torchrl is an optional dependency: ``pip install 'tdstore[torchrl]'``. This module imports
it; ``import tdstore`` does not.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl.data import ReplayBuffer
    >>> from tdstore.torchrl import TensorDictStoreStorage, TensorDictStoreWriter
    >>> rb = ReplayBuffer(storage=TensorDictStoreStorage(100), writer=TensorDictStoreWriter(), batch_size=4)
    >>> rb.extend(TensorDict(obs=torch.randn(10, 3), batch_size=[10]))
    tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    >>> rb.sample()["obs"].shape
    torch.Size([4, 3])
    >>> rb.storage.store.clear_redis()
"""

from __future__ import annotations

from tdstore.torchrl.prioritized import (
    TensorDictStorePrioritizedReplayBuffer,
    TensorDictStorePrioritizedSampler,
    prioritized_replay_buffer,
)
from tdstore.torchrl.sharded import ShardedStorePrioritizedSampler, ShardedStoreStorage, ShardedStoreWriter
from tdstore.torchrl.slices import TensorDictStorePrioritizedSliceSampler, TensorDictStoreSliceSampler
from tdstore.torchrl.storage import TensorDictStoreStorage, TensorDictStoreWriter

__all__ = [
    "TensorDictStoreStorage",
    "TensorDictStoreWriter",
    "TensorDictStorePrioritizedSampler",
    "TensorDictStorePrioritizedReplayBuffer",
    "prioritized_replay_buffer",
    "TensorDictStoreSliceSampler",
    "TensorDictStorePrioritizedSliceSampler",
    "ShardedStoreStorage",
    "ShardedStoreWriter",
    "ShardedStorePrioritizedSampler",
]
