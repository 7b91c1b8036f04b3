"""Rate limiting of a ring buffer, kept on the server: Reverb's ``MinSize`` and ``SampleToInsertRatio``.

A limiter keeps actors and learners in step across processes and machines: a sample waits
until the ring holds ``min_size`` rows, and, with ``samples_per_insert``, samples and
inserts wait while ``inserts * samples_per_insert - samples`` would leave the band
``samples_per_insert * min_size ± error_buffer`` (Reverb's ``RateLimiter`` with its
``SampleToInsertRatio`` offsets). A row counts as one insert, and a sample of n rows as n
samples.

The settings and the counts live in one hash on the server (``StoreKeys.rate``, written by
``lua/rate_limit.lua``). An append counts its rows in its reserve step (``lua/reserve.lua``):
the check and the count are one step with the reservation, so appenders in any number of
processes never overshoot between them. A sample counts its rows in one script call
(``lua/rate_sample.lua``) before it draws, with a token of its own: a call whose reply was
lost and that is sent again counts the sample once. A call held back changes nothing and is tried
again after a bounded, growing pause (1 ms doubling to 50 ms, with jitter): a wait sends
at most about 20 calls a second, never a busy loop. Past the limiter's ``timeout`` the call
raises :class:`~tdstore.errors.RateLimitTimeoutError`, having written or counted nothing.

What differs from Reverb, on purpose:

* the ring's size (for ``min_size``) is the rows it holds, ``min(rows ever appended,
  capacity)``; a row the ring overwrote counts as deleted, as Reverb's FIFO remover does;
* a reservation is counted when it is made: an appender that dies between its reserve and
  its write (its rows never become valid) still counted its rows;
* emptying the ring (``set_ring_total(0)``, the replay buffer's ``empty()``) starts the counts
  at 0 again, as a Reverb table reset does; removing the limiter drops them.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from tdstore._backend import rate as _rate_io
from tdstore.errors import CorruptMetadataError, RateLimitTimeoutError

if TYPE_CHECKING:
    from tdstore.store.core import TensorDictStore

__all__ = ["RateLimit", "set_rate_limit", "clear_rate_limit", "rate_limit", "wait", "acquire_samples"]

#: The bounds stored for a limiter with no ratio (``MinSize``): no count of inserts and
#: samples reaches them.
_UNBOUNDED = 1e300
#: The first and the longest pause between two tries of a call the limiter holds back (s).
FIRST_PAUSE, LONGEST_PAUSE = 0.001, 0.05


class RateLimit(NamedTuple):
    """A ring's rate limiter, as read from the server (``store.rate_limit()``)."""

    min_size: int  #: rows the ring must hold before a sample
    samples_per_insert: float | None  #: None: a minimum size only (Reverb's ``MinSize``)
    min_diff: float  #: the lowest ``inserts * samples_per_insert - samples`` a sample may leave
    max_diff: float  #: the highest an insert may leave
    timeout: float | None  #: seconds a call waits before it gives up (None: no limit)
    inserts: int  #: rows appended since the limiter was set (or the ring emptied)
    samples: int  #: rows sampled since then


def set_rate_limit(
    store: TensorDictStore,
    min_size: int = 1,
    samples_per_insert: float | None = None,
    error_buffer: float | tuple[float, float] | None = None,
    timeout: float | None = None,
) -> None:
    """:meth:`TensorDictStore.set_rate_limit` (its documentation is there)."""
    where = store._where()
    capacity = store.batch_size[0] if store.batch_dims else 0
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"set_rate_limit() on {where}: min_size must be an int >= 1, got {min_size!r}")
    if capacity < 1 or min_size > capacity:
        raise ValueError(
            f"set_rate_limit() on {where}: min_size={min_size} is more rows than the ring holds "
            f"(capacity {capacity}): no sample could ever go"
        )
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0 or math.isinf(timeout)):
        raise ValueError(f"set_rate_limit() on {where}: timeout must be None or seconds >= 0, got {timeout!r}")
    if samples_per_insert is None:
        if error_buffer is not None:
            raise ValueError(f"set_rate_limit() on {where}: error_buffer needs samples_per_insert")
        spi, lo, hi = 1.0, -_UNBOUNDED, _UNBOUNDED
    else:
        if isinstance(samples_per_insert, bool) or not isinstance(samples_per_insert, (int, float)) or not (
            0 < samples_per_insert < math.inf
        ):
            raise ValueError(f"set_rate_limit() on {where}: samples_per_insert must be a number > 0, got {samples_per_insert!r}")
        spi = float(samples_per_insert)
        if error_buffer is None:
            raise ValueError(
                f"set_rate_limit() on {where}: samples_per_insert needs error_buffer (Reverb's SampleToInsertRatio): "
                f"at least max(1, samples_per_insert) = {max(1.0, spi)}"
            )
        if isinstance(error_buffer, tuple):
            if len(error_buffer) != 2 or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in error_buffer):
                raise ValueError(f"set_rate_limit() on {where}: error_buffer must be a number or (min_diff, max_diff), got {error_buffer!r}")
            lo, hi = float(error_buffer[0]), float(error_buffer[1])
        elif isinstance(error_buffer, bool) or not isinstance(error_buffer, (int, float)) or not math.isfinite(error_buffer):
            raise ValueError(f"set_rate_limit() on {where}: error_buffer must be a number or (min_diff, max_diff), got {error_buffer!r}")
        else:
            offset = spi * min_size
            lo, hi = offset - float(error_buffer), offset + float(error_buffer)
        if hi - lo < 2 * max(1.0, spi):
            raise ValueError(
                f"set_rate_limit() on {where}: the error buffer must be at least max(1, samples_per_insert) = "
                f"{max(1.0, spi)} on each side (min_diff={lo}, max_diff={hi}): a smaller one could block "
                "every sample or every insert"
            )
        if lo > spi * min_size:
            raise ValueError(
                f"set_rate_limit() on {where}: min_diff={lo} is above samples_per_insert * min_size = "
                f"{spi * min_size}: no sample could go once min_size rows are in"
            )
    to = "" if timeout is None else str(math.ceil(timeout * 1000))
    args = ["set", str(min_size), repr(spi), repr(lo), repr(hi), to]
    _call(store, "rate_limit", args)


def clear_rate_limit(store: TensorDictStore) -> None:
    """:meth:`TensorDictStore.clear_rate_limit` (its documentation is there)."""
    _call(store, "rate_limit", ["clear"])


def rate_limit(store: TensorDictStore) -> RateLimit | None:
    """:meth:`TensorDictStore.rate_limit` (its documentation is there)."""
    conn = store._conn
    keys = conn.keys
    raw: list[Any] = conn.run(lambda c: _rate_io.read_limiter(c, keys))
    if raw[0] is None:
        return None
    try:
        text = [v.decode() if isinstance(v, bytes) else v for v in raw]
        min_size, spi, lo, hi = int(text[0]), float(text[1]), float(text[2]), float(text[3])
        timeout = int(text[4]) / 1000 if text[4] else None
        inserts, samples = int(text[5] or 0), int(text[6] or 0)
    except (TypeError, ValueError) as err:
        raise CorruptMetadataError(f"the rate limiter {keys.rate} of {store._where()} is damaged: {raw!r:.200}") from err
    unbounded = lo <= -_UNBOUNDED and hi >= _UNBOUNDED
    return RateLimit(min_size, None if unbounded else spi, lo, hi, timeout, inserts, samples)


def _call(store: TensorDictStore, name: str, args: list[str]) -> object:
    conn = store._conn
    keys = conn.keys
    from tdstore.errors import StoreNotFoundError

    try:
        return conn.run(lambda c: conn.runner.call(c, name, [keys.meta, keys.rate], args))
    except StoreNotFoundError:
        raise store._not_found() from None


def _timeout_s(raw: str) -> float | None:
    return int(raw) / 1000 if raw else None


def wait(store: TensorDictStore, what: str, attempt: Callable[[], tuple[bool, str]], held: str | None = None) -> None:
    """Calls ``attempt()`` until it goes (``(True, _)``), pausing between tries; ``attempt``
    returns ``(False, the limiter's timeout in ms or "")`` when held back. ``held``: the
    caller's first try was held back already, with that timeout. Raises
    :class:`RateLimitTimeoutError` once the limiter's timeout has passed since the first try."""
    start = time.monotonic()
    pause = FIRST_PAUSE
    tries = 0
    while True:
        if held is not None:
            went, raw, held = False, held, None
        else:
            went, raw = attempt()
        tries += 1
        if went:
            return
        limit = _timeout_s(raw)
        waited = time.monotonic() - start
        if limit is not None and waited >= limit:
            raise RateLimitTimeoutError(
                f"{what} on {store._where()}: the rate limiter held it back for {waited:.3f} s, past its timeout of "
                f"{limit:g} s ({tries} tries); nothing was applied. Samplers and appenders must both keep going "
                "for a ratio limiter to let either through (see store.rate_limit())"
            )
        sleep = pause * (0.5 + random.random())  # noqa: S311 - jitter, not security
        if limit is not None:
            sleep = min(sleep, max(limit - waited, 0.0) + 1e-4)
        time.sleep(sleep)
        pause = min(pause * 2, LONGEST_PAUSE)


#: How long a sample the limiter let through waits for the first of the rows it counted to be
#: written: the limiter counts rows when their append reserves them, written a moment later.
IN_FLIGHT_WAIT_S = 1.0


def in_flight_pauses() -> Iterator[None]:
    """Sleeps between the reads of a sample that the limiter let through but that found no
    row written yet: from 1 ms, doubling to 50 ms, for :data:`IN_FLIGHT_WAIT_S` in all; each
    step yields after its sleep, and the iterator ends when the time is up."""
    pause, deadline = 0.001, time.monotonic() + IN_FLIGHT_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
        yield


def acquire_samples(store: TensorDictStore, n: int, capacity: int) -> bool:
    """Counts a sample of ``n`` rows against the limiter, waiting while it holds the sample
    back. Returns whether it had to wait (the caller then reads the ring's state again)."""
    conn = store._conn
    keys = conn.keys
    waited = []

    # (one token for every try of this sample: a try whose reply was lost and that is sent again,
    # by Connection.script's fallback or the retry policy, is counted once; lua/rate_sample.lua)
    args = [str(n), str(capacity), os.urandom(8).hex()]

    def attempt() -> tuple[bool, str]:
        reply = cast("list[Any]", conn.script("rate_sample", [keys.meta, keys.ring, keys.rate], args))
        status = int(reply[0])
        if status == 0:
            waited.append(1)
            raw = reply[1]
            return False, raw.decode() if isinstance(raw, bytes) else str(raw or "")
        return True, ""

    wait(store, f"sample({n})", attempt)
    return bool(waited)
