"""Samples kept in flight: :class:`Prefetcher`, an iterator over ``store.sample(...)`` batches.

A learner that samples, then trains, then samples again leaves the server idle while it
trains and itself idle while the server reads. A :class:`Prefetcher` keeps ``in_flight``
samples being drawn and read by threads of its own, each on the store's handle (which
threads may share), so that ``next()`` mostly finds a batch ready: what Reverb's
``TrajectoryDataset`` does with its ``max_in_flight_samples_per_worker``, and TorchRL's
``ReplayBuffer(prefetch=n)`` with its thread pool.

Every batch is one ``store.sample(batch_size, prioritized=..., return_info=...)``: the
same guarantees, each in one snapshot. A batch drawn ahead was drawn before the updates
made since (a priority update, a rate limiter's count), as with Reverb and TorchRL: a
prioritized learner's update reaches the batches drawn after it, up to ``in_flight``
batches later. ``update_priority`` with the batch's ``info["generation"]`` still drops the
update of a row appended to since it was drawn.

The threads stop at :meth:`close` (also on ``with`` exit, and when the Prefetcher is
garbage-collected), after the sample each is in; an error of a sample is raised by the
``next()`` that would have returned it, and the Prefetcher is closed then.
"""

from __future__ import annotations

import numbers
import queue
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (torch is imported where it is used: the CLI's commands run without it)
    import torch

    from tdstore.sharded import ShardedStore
    from tdstore.store.core import TensorDictStore

__all__ = ["Prefetcher", "MAX_IN_FLIGHT"]

#: The most samples a Prefetcher keeps in flight (threads of its own).
MAX_IN_FLIGHT = 16

_POLL_S = 0.05  # (how often a thread with a batch ready looks whether the Prefetcher was closed)


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _work(store: TensorDictStore | ShardedStore, kwargs: dict[str, object], out: queue.Queue[object], stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            item: object = store.sample(**kwargs)  # type: ignore[arg-type]
        except BaseException as err:  # (handed to next(): the thread stops)
            item = _Failed(err)
        while not stop.is_set():
            try:
                out.put(item, timeout=_POLL_S)
                break
            except queue.Full:
                continue
        if isinstance(item, _Failed):
            return


def _stop(stop: threading.Event, out: queue.Queue[object]) -> None:
    stop.set()
    while True:  # (a thread blocked on a full queue sees the stop within _POLL_S)
        try:
            out.get_nowait()
        except queue.Empty:
            return


class Prefetcher(Iterator[object]):
    """An endless iterator of ``store.sample(batch_size, ...)`` batches, ``in_flight`` of them
    drawn ahead by threads of its own.

    Args:
        store: a ring that has rows: a :class:`~tdstore.TensorDictStore` with a first batch
            dim, or a :class:`~tdstore.ShardedStore` (each batch a sample of the union of
            its shards).
        batch_size: the rows of each batch (``n`` of ``store.sample``).
        prioritized: each batch is ``store.sample(batch_size, prioritized=True,
            return_info=True)``: ``(batch, info)``, the info to update the priorities with.
        return_info: uniform batches come as ``(batch, {"index": rows})``.
        in_flight: samples drawn ahead, each by its own thread (1 to :data:`MAX_IN_FLIGHT`).
            Two keep a single server busy while the client receives a batch.
        generator: seeds each thread's own generator (a ``torch.Generator`` is not for
            several threads); the batches then come in the order the threads finish.

    Raises:
        ValueError: a bad ``batch_size`` or ``in_flight`` (nothing started).
    """

    def __init__(
        self, store: TensorDictStore | ShardedStore, batch_size: int, *, prioritized: bool = False, return_info: bool = False,
        in_flight: int = 2, generator: torch.Generator | None = None,
    ) -> None:
        where = f"Prefetcher of {store._where()}"
        for name, value, top in (("batch_size", batch_size, None), ("in_flight", in_flight, MAX_IN_FLIGHT)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1 or (top and value > top):
                bound = f"from 1 to {top}" if top else ">= 1"
                raise ValueError(f"{where}: {name} must be an int {bound}, got {value!r}")
        self.batch_size, self.in_flight, self.prioritized = int(batch_size), int(in_flight), bool(prioritized)
        self._out: queue.Queue[object] = queue.Queue(maxsize=self.in_flight)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._closed = False
        kwargs: dict[str, object] = {"n": self.batch_size, "prioritized": self.prioritized,
                                     "return_info": bool(return_info) or self.prioritized}
        for i in range(self.in_flight):
            own = dict(kwargs)
            if generator is not None:
                import torch

                seed = int(torch.randint(0, 2**62, (1,), generator=generator))
                own["generator"] = torch.Generator().manual_seed(seed)
            thread = threading.Thread(
                target=_work, args=(store, own, self._out, self._stop), name=f"tdstore-prefetch-{i}", daemon=True
            )
            self._threads.append(thread)
        self._finalizer = weakref.finalize(self, _stop, self._stop, self._out)
        for thread in self._threads:
            thread.start()

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> object:
        """The next batch (as ``store.sample`` returns it), waiting for one if none is ready."""
        if self._closed:
            raise StopIteration
        while True:
            try:
                item = self._out.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not any(t.is_alive() for t in self._threads):  # (closed meanwhile by another thread)
                    raise StopIteration from None
        if isinstance(item, _Failed):
            self.close()
            raise item.error
        return item

    def close(self, timeout: float | None = 30.0) -> None:
        """Stops the threads, after the sample each is in (waits up to ``timeout`` s for them)."""
        self._closed = True
        self._finalizer()
        for thread in self._threads:
            thread.join(timeout)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
