"""Read leases: the bound on how long a read waits while writers keep changing the layout.

An optimistic read plans from the layout it has, reads the bytes with the layout version, and
reads again when the version changed in between. Writers that add and delete keys faster than
it reads could outrun it for ever. So after :data:`LEASE_AFTER` lost tries a read takes a
*lease* on the store's layout (``lua/lease.lua``: a field of the hash ``<prefix>:{<td_id>}:rl``,
reader nonce -> deadline on the server's clock) and keeps it until it returns. While a lease is
live, every layout change (``lua/commit.lua`` with a layout-version bump, the WATCHed indexed
write that creates entries) is refused with ``TDS_BUSY``, and the writer's client waits
(:func:`call_commit`, or :func:`~tdstore._backend.optimistic.optimistic` for the WATCHed write)
and sends it again. The reader's next try therefore finds the layout it refreshed: at most two
tries under the lease (one to refresh a stale cached layout, one to read).

The bounds (see docs/guarantees.md, "Reads under layout churn"):

* a reader: :data:`LEASE_AFTER` optimistic tries, one lease call, at most two tries;
* a writer: waits while leases are live, each at most its length (:func:`lease_ms`:
  :data:`LEASE_MS` plus the time to read the store at :data:`LEASE_BYTES_PER_MS`, at most
  :data:`LEASE_MAX_MS`); readers take
  one only after losing :data:`LEASE_AFTER` tries to layout changes, and drop it when done, so
  a lease of a reader that died delays writers by at most its length. A writer gives up waiting
  after :data:`WRITER_WAIT_MAX` seconds on the clock (``StaleLayoutError``, marked ``gave_up`` so that
  its optimistic loop raises it rather than waiting again).

A reader that cannot take a lease (a read-only user or replica) keeps to optimistic tries.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import redis.exceptions

from tdstore._backend.protocols import AsyncClient
from tdstore._backend.scripts import ScriptRunner
from tdstore._core.keys import StoreKeys
from tdstore.errors import ServerPermissionError, StaleLayoutError, StoreNotFoundError

if TYPE_CHECKING:
    from tdstore._backend.connection import Connection

__all__ = [
    "LEASE_AFTER",
    "LEASE_MS",
    "LEASE_BYTES_PER_MS",
    "LEASE_MAX_MS",
    "WRITER_WAIT_MAX",
    "ReadLease",
    "lease_ms",
    "busy_ms",
    "call_commit",
    "leased",
    "busy_error",
]

#: Optimistic tries a read loses to layout changes before it takes a lease.
LEASE_AFTER = 4
#: The length of a lease (ms) for a small read ...
LEASE_MS = 2000
#: ... plus one ms per this many bytes the read returns (50 MB/s), so a long read keeps it ...
LEASE_BYTES_PER_MS = 50_000
#: ... up to this length (ms): what a reader that died can hold writers back (a try that
#: reads for longer may still be outrun once its lease ends; it renews the lease on its next try).
LEASE_MAX_MS = 60_000
#: Seconds a writer waits for readers' leases to end before it gives up (``StaleLayoutError``).
WRITER_WAIT_MAX = 30.0
#: The longest single wait of a writer between two tries (seconds).
_POLL_MAX = 0.02
#: The doubling of a writer's wait stops after this many polls (2**10 ms already passes
#: :data:`_POLL_MAX`); an uncapped ``2**polls`` overflows a float at poll 1024.
_POLL_DOUBLINGS = 10


def poll_delay(polls: int, left_ms: int) -> float:
    """A writer's wait (seconds) before its try number ``polls + 1``: doubling from 1 ms, at
    most :data:`_POLL_MAX`, and no longer than the ``left_ms`` of the lease that refused it."""
    return min(0.001 * 2.0 ** min(max(polls, 0), _POLL_DOUBLINGS), _POLL_MAX, max(left_ms, 0) / 1000 + 0.001)

_BUSY_RE = re.compile(r"TDS_BUSY\b.*? for (\d+) ms")


def lease_ms(nbytes: int) -> int:
    """The length of a lease for a read of ``nbytes`` bytes."""
    return min(LEASE_MS + max(0, int(nbytes)) // LEASE_BYTES_PER_MS, max(LEASE_MS, LEASE_MAX_MS))


class ReadLease:
    """One read's lease; :func:`~tdstore._backend.optimistic.optimistic` takes it after
    :data:`LEASE_AFTER` lost tries (and renews it before each later try) and drops it at the end.

    ``conn`` is the store's connection (``run``, ``keys``, ``runner``); ``nbytes`` gives the
    bytes the read returns (called when the lease is taken), for the lease's length.
    """

    __slots__ = ("conn", "nbytes", "nonce", "held", "usable")

    def __init__(self, conn: Connection, nbytes: Callable[[], int] | None = None) -> None:
        self.conn = conn
        self.nbytes = nbytes
        self.nonce = uuid.uuid4().hex
        self.held = False
        self.usable = True

    def take(self) -> None:
        """Takes (or renews) the lease; a server that refuses it leaves the read optimistic."""
        if not self.usable:
            return
        conn, nonce = self.conn, self.nonce
        try:
            ms = lease_ms(self.nbytes() if self.nbytes is not None else 0)
        except Exception:  # noqa: BLE001 - a size hint only (the layout may be damaged: the read says so)
            ms = LEASE_MS
        try:
            conn.run(lambda c: conn.runner.call(c, "lease", [conn.keys.rl, conn.keys.meta], ["take", nonce, str(ms)]))
        except StoreNotFoundError:
            return  # the read itself reports it
        except (ServerPermissionError, redis.exceptions.ResponseError):
            self.usable = False  # read-only user or replica: optimistic tries only
            return
        self.held = True

    def release(self) -> None:
        """Drops the lease if held (a failure to drop it leaves it to end at its deadline)."""
        if not self.held:
            return
        self.held = False
        conn, nonce = self.conn, self.nonce
        try:
            conn.run(lambda c: conn.runner.call(c, "lease", [conn.keys.rl, conn.keys.meta], ["drop", nonce]))
        except Exception:  # noqa: BLE001 - it ends at its deadline; the read's own result stands
            pass


def busy_ms(exc: BaseException) -> int | None:
    """The ms left on the readers' leases when ``exc`` is a ``TDS_BUSY`` refusal, else None."""
    if getattr(exc, "lease_busy", None) is not None:
        return int(exc.lease_busy)  # type: ignore[attr-defined]
    cause = exc.__cause__
    match = _BUSY_RE.search(str(cause)) if cause is not None else None
    return int(match.group(1)) if match else None


async def call_commit(
    client: AsyncClient,
    runner: ScriptRunner,
    key_list: list[str],
    args: list[str],
    tmps: Sequence[str] = (),
    busy: BaseException | None = None,
) -> int:
    """Calls the commit script (``key_list``, ``args``) and returns its result; while readers'
    leases refuse it (``TDS_BUSY``: its tmp keys are kept), waits and calls again.

    ``busy``: the ``TDS_BUSY`` refusal of a first call made elsewhere (in a MULTI). After
    :data:`WRITER_WAIT_MAX` seconds of waiting the ``tmps`` are deleted and ``StaleLayoutError``
    is raised.
    """
    # the bound is on the clock (sleeps overshoot, and each try is a round trip)
    start = time.monotonic()
    polls = 0
    while True:
        if busy is None:
            try:
                return int(await runner.call(client, "commit", key_list, args))
            except StaleLayoutError as exc:
                if busy_ms(exc) is None:
                    raise
                busy = exc
        left = busy_ms(busy) or 1
        waited = time.monotonic() - start
        if waited >= WRITER_WAIT_MAX:
            if tmps:
                await client.delete(*tmps)
            gave_up = StaleLayoutError(
                f"readers kept a lease on the layout of {key_list[0]} for {waited:.1f} s (the most a writer "
                f"waits: {WRITER_WAIT_MAX:g} s); the change was not made"
            )
            # the bound is on the writer's whole wait: its optimistic loop must not wait again
            gave_up.gave_up = True  # type: ignore[attr-defined]
            raise gave_up from busy
        await asyncio.sleep(min(poll_delay(polls, left), max(0.0, WRITER_WAIT_MAX - waited) + 0.001))
        polls += 1
        busy = None


async def leased(client: AsyncClient, keys: StoreKeys) -> int | None:
    """The ms left on the longest live lease of the store (None when none is), read on
    ``client`` (a WATCHing pipeline in immediate mode, or a client)."""
    leases = await client.hgetall(keys.rl)
    if not leases:
        return None
    sec, usec = await client.time()
    now = int(sec) * 1000 + int(usec) // 1000
    left = 0
    for value in leases.values():
        try:
            left = max(left, int(value) - now)
        except ValueError:
            continue  # not a deadline: no lease
    return left if left > 0 else None


def busy_error(keys: StoreKeys, left: int) -> StaleLayoutError:
    """The refusal of a layout change while a lease is live (``optimistic`` waits on it)."""
    exc = StaleLayoutError(f"a read lease holds the layout of {keys.meta} for {left} ms")
    exc.lease_busy = left  # type: ignore[attr-defined]
    return exc
