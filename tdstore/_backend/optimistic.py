"""The one retry loop of optimistic operations: plan against the cached layout, send, and when
the server says the layout changed meanwhile, refresh and try again, a bounded number of times.

Every store operation that plans from a cached layout (writes, indexed writes, appends,
compare-and-set read-modify-writes, reads that check the layout version they read at) runs
its body through :func:`optimistic`::

    def attempt(attempt: int) -> int:
        layout = self._layout()
        ...  # plan with layout; may raise StaleLayoutError (sent too late) or Retry()
        return conn.run(lambda c: _backend.commit(c, ..., expected=str(layout.lv)))

    return optimistic(attempt, where=self._where, what="a write", on_stale=refresh)

The body is a closure: the variables its lambdas capture belong to one attempt, so no
lambda needs default arguments to pin them (ruff's B023 stays on).

It gives up in one way: ``StaleLayoutError`` (or ``give_up``, for the compare-and-set loops
that have always raised ``WriteConflictError``) saying ``the layout of <store> kept changing
during <operation>; gave up after <n> tries``. That error is marked (``gave_up``), so an
outer optimistic loop lets it through rather than multiply the tries.

Reads pass ``lease=`` (a :class:`~tdstore._backend.lease.ReadLease`): after
``LEASE_AFTER`` lost tries the loop takes it, so that writers cannot change the layout
until the read returns (a bounded wait, whatever the churn; see
:mod:`tdstore._backend.lease`). A writer refused by such a lease (an error marked
``lease_busy``) waits here without spending a try, for at most ``WRITER_WAIT_MAX`` seconds.

The IO loop's own retries (NOSCRIPT reloads, a read's chunk tries, the staged transfer
restarts inside a read) are not this pattern: they run on the IO loop, where sleeping would
block it, and each retries one server step rather than a whole plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from tdstore._backend import lease as _lease
from tdstore._backend import loop as _io
from tdstore.errors import StaleLayoutError

__all__ = ["Retry", "optimistic", "give_up"]

_T = TypeVar("_T")


class Retry(Exception):
    """Raised by an optimistic body instead of ``continue``: try again.

    ``Retry()`` tries again at once (the body has already refreshed what it needs);
    ``Retry(stale=True)`` does what a ``StaleLayoutError`` does: back off, run ``on_stale``,
    try again.
    """

    def __init__(self, *, stale: bool = False) -> None:
        super().__init__("retry" + (" (stale layout)" if stale else ""))
        self.stale = stale


def give_up(
    where: str | Callable[[], str], what: str, tries: int, error: type[Exception] = StaleLayoutError
) -> Exception:
    """The error an optimistic loop gives up with (one message format for all of them)."""
    name = where() if callable(where) else where
    exc = error(f"the layout of {name} kept changing during {what}; gave up after {tries} tries")
    exc.gave_up = True  # type: ignore[attr-defined]
    return exc


def optimistic(
    attempt_fn: Callable[[int], _T],
    *,
    where: str | Callable[[], str],
    what: str,
    on_stale: Callable[[], object] | None = None,
    tries: int = _io.MAX_RETRIES,
    retry_on: tuple[type[BaseException], ...] = (StaleLayoutError,),
    backoff: Callable[[int], None] = _io.backoff,
    error: type[Exception] = StaleLayoutError,
    lease: _lease.ReadLease | None = None,
) -> _T:
    """Returns ``attempt_fn(attempt)`` for the first attempt (0, 1, ...) that neither raises
    one of ``retry_on`` nor :class:`Retry`.

    Args:
        attempt_fn: One attempt; gets its number, so that it can change course after a few
            (e.g. read layout and data in one step after ``ONE_STEP_AFTER`` tries).
        where: The store (or a callable giving it, called only when giving up).
        what: The operation, as the give-up message says it ("an indexed write", "extend()").
        on_stale: Run after the backoff when an attempt was stale (e.g. refresh the layout).
        tries: Attempts in all (default :data:`tdstore._backend.loop.MAX_RETRIES`).
        retry_on: The exceptions that mean "stale, try again" (default ``StaleLayoutError``;
            ``()`` where only :class:`Retry` retries). One marked ``gave_up`` (an inner
            optimistic loop's) is never retried.
        backoff: The wait after a stale attempt, given its number (default the IO loop's
            randomized :func:`~tdstore._backend.loop.backoff`).
        error: The exception class given up with (``StaleLayoutError``).
        lease: A read's lease, taken (and renewed) before every attempt from
            :data:`~tdstore._backend.lease.LEASE_AFTER` on, and dropped when the loop ends.
    """
    attempt = 0
    busy_since: float | None = None  # when a reader's lease first held the layout (monotonic clock)
    try:
        while attempt < tries:
            if lease is not None and attempt >= _lease.LEASE_AFTER:
                lease.take()
            try:
                return attempt_fn(attempt)
            except Retry as signal:
                if not signal.stale:
                    attempt += 1
                    continue
            except retry_on as exc:
                if getattr(exc, "gave_up", False):
                    raise
                left = _lease.busy_ms(exc)
                if left is not None:
                    # a reader's lease holds the layout still: wait for it, not a try spent, for
                    # at most WRITER_WAIT_MAX by the clock (the attempts' round trips included)
                    now = time.monotonic()
                    busy_since = now if busy_since is None else busy_since
                    remaining = busy_since + _lease.WRITER_WAIT_MAX - now
                    if remaining > 0:
                        time.sleep(min(0.02, left / 1000 + 0.001, remaining))
                        continue
            backoff(attempt)
            if on_stale is not None:
                on_stale()
            attempt += 1
        raise give_up(where, what, tries, error)
    finally:
        if lease is not None:
            lease.release()
