"""The one IO event loop of the process, and :func:`sync` to run coroutines on it.

Every store of the process shares one daemon thread that runs an asyncio loop; blocking
methods submit coroutines to it and wait with a timeout. The loop is created lazily,
forgotten in a child after ``fork()`` (the thread does not survive a fork; the child builds
a new loop on first use), and stopped at interpreter exit.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import gc
import os
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

from tdstore._backend.protocols import AsyncClient
from tdstore.errors import EventLoopError

__all__ = ["get_loop", "sync", "loop_generation", "backoff", "MAX_RETRIES", "DEFAULT_TIMEOUT"]

T = TypeVar("T")

#: Seconds a blocking call waits for the server before it raises ``TimeoutError``.
DEFAULT_TIMEOUT = 120.0

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_generation = 0
#: The asyncio clients tdstore built on this process's loop (not the ones a user passed in):
#: disconnected at exit, so that no "unclosed Connection/transport" ResourceWarning is printed
_CLIENTS: weakref.WeakSet[AsyncClient] = weakref.WeakSet()
#: Pools of tracked clients that were garbage collected unclosed (a store dropped without
#: close()): held until their disconnect, scheduled on the IO loop, is done. A connection
#: left to the garbage collector would close its transport from whatever thread collects
#: it ("Non-thread-safe operation invoked on an event loop other than the current one"
#: under python -X dev) or after the loop is closed ("unclosed Connection", "loop is closed").
_PENDING: set[Any] = set()
#: Pools of clients made before a fork(), collected in the child: their sockets are the
#: parent's, never closed here (not even by garbage collection).
_INHERITED_POOLS: list[object] = []  # (kept referenced only)
#: Set once the IO loop was stopped at interpreter exit: nothing is scheduled on a loop after.
_exiting = False


def _run(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    loop.run_forever()


def get_loop() -> asyncio.AbstractEventLoop:
    """The process's IO loop, started on first use."""
    global _loop, _thread
    loop = _loop
    if loop is not None:
        return loop
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=_run, args=(loop,), name="tdstore-io", daemon=True)
            thread.start()
            _loop, _thread = loop, thread
        return _loop


def track(client: AsyncClient) -> AsyncClient:
    """Registers an asyncio client built by tdstore, to disconnect it at interpreter exit; returns it.

    A client collected unclosed has its pool disconnected on the IO loop (see :data:`_PENDING`).
    """
    _CLIENTS.add(client)
    finalizer = weakref.finalize(client, _collected, client.connection_pool, _generation)
    finalizer.atexit = False  # type: ignore[misc]  # (typeshed lacks it) at exit _shutdown() disconnects the live ones
    return client


def exiting() -> bool:
    """Whether the IO loop was stopped at interpreter exit (its clients are disconnected)."""
    return _exiting


async def aclose(client: AsyncClient) -> None:
    """Closes a tracked client and disconnects its pool (on the IO loop, the one that owns it).

    ``Redis.aclose()`` leaves alone a pool passed in as ``connection_pool=``, which tdstore's
    clients all are: their connections stayed open until the garbage collector closed them.
    """
    try:
        await client.aclose()
    finally:
        await client.connection_pool.disconnect()


def _collected(pool: Any, generation: int) -> None:
    """A tracked client was collected: disconnects its pool on the loop that owns it."""
    if generation != _generation:
        _INHERITED_POOLS.append(pool)  # made before a fork(): the parent's sockets
        return
    loop = _loop
    if loop is None or _exiting:
        return  # no loop (never started, or stopped at exit after disconnecting every pool)

    async def disconnect() -> None:
        try:
            await pool.disconnect()
        finally:
            _PENDING.discard(pool)

    _PENDING.add(pool)
    try:
        loop.call_soon_threadsafe(lambda: loop.create_task(disconnect()))
    except RuntimeError:  # the loop is closed
        _PENDING.discard(pool)


def loop_generation() -> int:
    """A number that changes whenever the IO loop is replaced (after a fork).

    Clients are bound to the loop that created them; a store rebuilds its client when the
    generation it recorded differs from this one.
    """
    return _generation


def sync(coro: Coroutine[Any, Any, T], timeout: float | None = DEFAULT_TIMEOUT) -> T:
    """Runs ``coro`` on the IO loop and returns its result, waiting at most ``timeout`` s.

    Raises:
        EventLoopError: when called from the IO loop's own thread (a callback of the loop
            calling a blocking store method would wait for itself forever).
        TimeoutError: when the coroutine did not finish in time; it is cancelled.
    """
    loop = get_loop()
    if threading.current_thread() is _thread:
        coro.close()
        raise EventLoopError(
            "a blocking tdstore method was called from inside tdstore's IO loop; "
            "call it from another thread"
        )
    # A lighter hop than asyncio.run_coroutine_threadsafe (about half the latency): one
    # call_soon_threadsafe that starts the task, and a done-callback that fills a
    # concurrent Future.
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    tasks: list[asyncio.Task[T]] = []

    def done(task: asyncio.Task[T]) -> None:
        if task.cancelled():
            future.cancel()
        elif task.exception() is not None:
            future.set_exception(task.exception())
        else:
            future.set_result(task.result())

    def start() -> None:
        task = loop.create_task(coro)
        tasks.append(task)
        task.add_done_callback(done)

    loop.call_soon_threadsafe(start)
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        loop.call_soon_threadsafe(lambda: [t.cancel() for t in tasks])
        raise TimeoutError(
            f"the server did not answer within {timeout} s (set timeout= on the store to wait longer)"
        ) from None
    except concurrent.futures.CancelledError:
        raise TimeoutError("the operation was cancelled (the IO loop is shutting down)") from None


#: Loops inherited through fork(). Never closed nor collected: their epoll instance is
#: shared with the parent, and closing the loop would unregister the parent's sockets.
_INHERITED_LOOPS: list[object] = []  # (kept referenced only)


def backoff(attempt: int) -> None:
    """Sleeps before retrying an optimistic write that lost a race (randomized, capped).

    The first retries go at once; later ones wait up to 1, 2, 4 ... 32 ms, at random, so
    that writers contending for one store do not keep refusing each other.
    """
    delay = backoff_seconds(attempt)
    if delay:
        import time

        time.sleep(delay)


def backoff_seconds(attempt: int) -> float:
    """The wait of :func:`backoff` (for a caller on the IO loop, which must not block it)."""
    if attempt < 2:
        return 0.0
    import random

    return random.uniform(0, 0.001 * (2 ** min(attempt - 2, 5)))


#: How many times an optimistic write re-plans after losing a race before it gives up.
MAX_RETRIES = 200


def _after_fork_in_child() -> None:
    global _loop, _thread, _lock, _generation
    # The IO thread does not exist in the child; its loop object must not be touched.
    if _loop is not None:
        _INHERITED_LOOPS.append((_loop, _thread))
    _loop = None
    _thread = None
    _lock = threading.Lock()
    _generation += 1
    _CLIENTS.clear()  # their connections belong to the parent's loop
    _INHERITED_POOLS.extend(_PENDING)
    _PENDING.clear()


def _shutdown() -> None:
    global _loop, _thread, _exiting
    # stores left in reference cycles (a handle dropped in a worker thread) are collected now,
    # while the loop runs: their clients' pools join _PENDING instead of being collected at
    # teardown, after the loop is gone
    gc.collect()
    loop, thread = _loop, _thread
    _exiting = True
    if loop is None or thread is None:
        return
    _loop = _thread = None

    async def _cancel_all() -> None:
        # the pools are listed before the tasks are cancelled: a cancelled disconnect of a
        # collected client's pool takes the pool out of _PENDING as it ends
        pools = [c.connection_pool for c in list(_CLIENTS)] + list(_PENDING)
        _CLIENTS.clear()
        _PENDING.clear()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # disconnected here, while the loop runs: a connection left open warns at teardown
        # ("unclosed Connection", "unclosed transport" under python -X dev)
        await asyncio.gather(*(pool.disconnect() for pool in pools), return_exceptions=True)

    try:
        asyncio.run_coroutine_threadsafe(_cancel_all(), loop).result(2)
    except Exception:  # noqa: BLE001 - best effort at exit
        pass
    loop.call_soon_threadsafe(loop.stop)
    thread.join(2)
    if not thread.is_alive():
        # closed here, while the interpreter is whole: a loop left open is closed by its
        # __del__ during interpreter teardown, after the sockets it watches (its self-pipe
        # among them) may be gone, which printed "Exception ignored in BaseEventLoop.__del__
        # ... ValueError: Invalid file descriptor: -1"
        try:
            loop.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_shutdown)
