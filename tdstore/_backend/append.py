"""Appends in two steps, with no row byte passing through Lua (issue 16).

1. **Reserve** (``lua/reserve.lua``, a tiny script): checks the layout version (and the data
   keys when it re-plans), advances the ring cursor by ``n`` and clears the rows' "written"
   flags (``keys.flags``, one byte per row).
2. **Write**: a MULTI of the rows' SETRANGEs (each chunk's, for a chunked entry), the
   SETRANGE that sets the rows' flags, the write version's INCR and the HINCRBY of the
   append counter of the sub-store appended to (``keys.appends``, not the meta hash: the
   number of appends is the sum of its fields), then EXEC.

The connection WATCHes the meta hash and the fence counter from before the reserve until
EXEC. The meta hash changes with every layout change and never with an append, so
appenders do not abort each other, and a layout change between the two steps (an entry
added or deleted, the store re-created) aborts the write instead of redirecting its
SETRANGEs. The flags are the record of the appends in flight: a reserve that comes round
to a row reserved before and finds its flag still clear (its appender is slow, or died
between the two steps) takes it over and bumps the fence. The slow appender's EXEC is
then aborted, and it never writes rows that are now another appender's.

After an aborted EXEC the client re-plans under the current layout and checks its
reservation again (``"keep"``): no later reservation reached its rows (the cursor is at
most a ring past them) and the store is the same one, so it writes the same rows; else
(or when it was made for another capacity) it reserves new ones. An appender that dies
between the two steps leaves its rows unflagged: :meth:`~tdstore.TensorDictStore.sample`
never draws them, and the ring reuses them when it comes round.

**One packet when uncontended** (:func:`append_direct` only). After an append's EXEC, the
same packet WATCHes the meta hash and the ring cursor again and reads the layout version,
the expiry, the cursor and the flags of the next ``max(n, ARM_ROWS)`` rows, where the
ring came round to them; the connection is kept out of the pool ("armed",
as ``armed_write`` does for row writes). When the cursor is where this append left it and
those flags are set (no append is in flight on those rows), the next append of at most as
many rows needs no reserve step: one MULTI writes the rows at that cursor, sets their flags and INCRBYs the
cursor, and re-arms after EXEC. Any change of the watched keys in between (another
append or reservation, a layout change, a cursor set) makes EXEC do nothing; the append
then takes the two steps above, and the next ``COOL_APPENDS`` appends of the handle do too
(appenders of one ring would otherwise keep aborting each other's armed MULTI, each time
after sending its rows). An armed append reserves nothing, so there is nothing in flight
to take over and no fence to watch.

The try is written once, as an operation of :mod:`tdstore._backend.drive` (``_append_op``:
the commands come from :class:`AppendPlan`, which does no I/O), and two drivers run it:

* :func:`append_direct`, on the store's blocking direct client (see
  ``Connection.direct_client``), from the calling thread: one packet armed, else two, the
  payload sent from the tensors' memory (as ``armed_write.write_runs_direct``);
* :func:`append_watched`, on the IO loop (fakeredis, TLS, custom connection classes,
  cluster): the same two steps on a connection of the asyncio pool, none kept armed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis.exceptions
import torch

from tdstore._backend.armed_write import ArmedSlot, _s
from tdstore._backend.drive import Checkout, ConnOp, Discard, Exchange, Release, Usable, run_async, run_blocking
from tdstore._backend.protocols import AsyncClient, AsyncPipeline, SyncClient
from tdstore._backend.scripts import ScriptRunner
from tdstore._backend.step import ReadStep, read_snapshot
from tdstore._backend.translate import ReserveReplyLost
from tdstore._core.chunks import setrange_commands
from tdstore._core.keys import CURSOR_MAX, StoreKeys, encode_path
from tdstore._core.layout import Arg, Command
from tdstore.errors import (
    CorruptMetadataError,
    DataLostError,
    OutcomeUnknownError,
    StaleLayoutError,
    TDStoreError,
    translate_response_error,
)

__all__ = [
    "Reservation", "AppendPlan", "ArmedRing", "COOL_APPENDS", "append_direct", "append_watched", "ABORTED", "RATE_BLOCKED",
    "ring_counts", "ring_flags", "flag_bytes", "append_counters",
]



def parse_cursor(raw: Any, keys: StoreKeys) -> int:
    """The ring cursor from its GET reply (None: 0); CorruptMetadataError for anything else
    than a decimal count at most :data:`CURSOR_MAX`."""
    if raw is None:
        return 0
    text = raw if isinstance(raw, bytes) else str(raw).encode()
    if not text.isdigit() or len(text) > 16 or int(text) > CURSOR_MAX:
        raise CorruptMetadataError(
            f"the ring cursor {keys.ring} of TensorDictStore(td_id={keys.td_id!r}) holds {text[:40]!r}: "
            f"expected a row count from 0 to 2**52. Set it with the replay buffer's empty(), or clear_redis() the store"
        )
    return int(text)


#: What a driver returns when EXEC was aborted (the layout changed, or the fence moved).
ABORTED = -1
#: What a driver returns when the ring's rate limiter held the append back: nothing was
#: reserved nor written (:attr:`AppendPlan.rate_timeout` then holds the limiter's timeout).
RATE_BLOCKED = -2

#: Appends that take the two steps after an armed one was aborted by another client's
#: append (see the module docstring): each aborted armed MULTI cost the server its rows' bytes.
COOL_APPENDS = 64

#: An armed connection checks the flags of the next max(n, ARM_ROWS) rows (the next append
#: may be larger than the last).
ARM_ROWS = 64


@dataclass
class ArmedRing:
    """A direct connection left WATCHing a ring's meta hash and cursor after an append."""

    client: SyncClient  #: the client whose pool lent ``connection``
    connection: redis.connection.Connection
    lv: str  #: the layout version read after the WATCH
    exp: str  #: the store's expiry ("" for none)
    cursor: int  #: the ring cursor read after the WATCH: the next append's rows start there
    rows: int  #: an append of at most this many rows finds its rows written (none in flight)
    #: False: a connection kept for the next append's two steps, with no WATCH (the
    #: handle's appends are cooling down): spared the pool's checkout and return
    watching: bool = True


@dataclass
class Reservation:
    """The rows one ``extend()`` call holds across its tries: where they start, the layout
    version they were reserved under, and whether it reserved yet."""

    start: int = 0  #: the cursor value the rows start at
    lv: str = ""  #: the layout version the reserve found (the "keep" check's)
    n: int = 0
    capacity: int = 0
    held: bool = False


class AppendPlan:
    """The commands of one append try and the meaning of their replies (no I/O).

    ``groups``: ``(path, row bytes, payload)`` per tensor entry, ``payload`` the ``n`` rows'
    bytes back to back; ``sub``: the path of the sub-store appended to (its append counter);
    ``new_rows``: for a store with priorities on (``tdstore/replay/priorities.py``), the
    command giving the rows their priority and generation from the cursor value they start
    at and their count (an EVAL of ``lua/prio_new.lua``), sent in the MULTI that sets their flags; None
    (priorities off): the MULTI carries nothing more.
    """

    def __init__(
        self, keys: StoreKeys, groups: Sequence[tuple[tuple[str, ...], int, Any]], *, lv: int, n: int,
        capacity: int, sub: tuple[str, ...], reservation: Reservation,
        new_rows: Callable[[int, int], Command] | None = None,
    ) -> None:
        self.keys, self.groups, self.lv, self.n, self.capacity = keys, groups, lv, n, capacity
        self.sub, self.res, self.new_rows = sub, reservation, new_rows
        self.rate_timeout = ""  #: the rate limiter's timeout in ms, when it held this append back
        if reservation.held and (reservation.n, reservation.capacity) != (n, capacity):
            reservation.held = False  # another capacity: the old rows cannot be written
        reservation.n, reservation.capacity = n, capacity

    # -- step 1 ------------------------------------------------------------------------
    def watch_command(self) -> Command:
        return ("WATCH", self.keys.meta, self.keys.fence)

    def reserve_keys_args(self, mode: str) -> tuple[list[str], list[str]]:
        keys, res = self.keys, self.res
        # (the write version: checked only; the rate limiter: read when the meta hash says "lim")
        kl = [keys.meta, keys.ring, keys.flags, keys.fence, keys.wv, keys.rate]
        args = [str(self.lv), str(self.n), str(self.capacity), mode, str(res.start), res.lv or "0"]
        if mode == "new":
            return kl, args  # the data keys are checked by the write's replies (see check())
        for path, row_bytes, _payload in self.groups:
            chunking = keys.chunks.get(path)
            kl.extend(keys.entry_keys(path, chunking))
            args += [str(row_bytes), str(chunking.size) if chunking is not None else "0"]
        return kl, args

    def mode(self) -> str:
        return "keep" if self.res.held else "new"

    def rate_blocked(self, reply: Any) -> bool:
        """Whether the reserve script's reply says the rate limiter held the append back
        (then :attr:`rate_timeout` is the limiter's timeout in ms, "" for none)."""
        if int(reply[0]) != RATE_BLOCKED:
            return False
        self.rate_timeout = _s(reply[3]) if len(reply) > 3 else ""
        return True

    def reserved(self, reply: Any) -> tuple[int, str] | None:
        """(start, expiry) from the reserve script's reply; None when the reservation was taken over."""
        start, exp = int(reply[0]), _s(reply[1])
        if start < 0:
            self.res.held = False
            return None
        self.res.held, self.res.start, self.res.lv = True, start, _s(reply[2])
        return start, exp

    # -- step 2 ------------------------------------------------------------------------
    def _runs(self, start: int) -> tuple[int, int, list[tuple[tuple[str, ...], list[tuple[int, int]], Any]]]:
        """(first row, rows before the wrap, ``(path, byte runs, payload)`` per entry) of rows from cursor ``start``."""
        n, capacity = self.n, self.capacity
        row0 = start % capacity
        first = min(n, capacity - row0)
        groups = []
        for path, row_bytes, payload in self.groups:
            runs = [(row0 * row_bytes, first * row_bytes)]
            if first < n:
                runs.append((0, (n - first) * row_bytes))
            groups.append((path, runs, payload))
        return row0, first, groups

    def write_commands(self, start: int, exp: str, *, armed: bool = False) -> list[Command]:
        """The commands between MULTI and EXEC: the rows' SETRANGEs, their flags (``armed``:
        and the cursor's INCRBY, there being no reservation), the write version's INCR and
        the append counter's HINCRBY."""
        keys, n = self.keys, self.n
        row0, first, groups = self._runs(start)
        out: list[Command] = [
            ("SETRANGE", key, offset, data) for key, offset, data in setrange_commands(keys, groups)
        ]
        self._setranges = len(out)
        out.append(("SETRANGE", keys.flags, row0, b"\x01" * first))
        if first < n:
            out.append(("SETRANGE", keys.flags, 0, b"\x01" * (n - first)))
        if self.new_rows is not None:
            out.append(self.new_rows(start, n))  # (priorities on: the rows' priority and generation)
        if armed:
            out.append(("INCRBY", keys.ring, n))
        out.append(("INCR", keys.wv))
        out.append(("HINCRBY", keys.appends, "a:" + encode_path(self.sub), 1))
        if exp:
            # these may be created here: they expire with the store (the meta hash is WATCHed)
            for key in (keys.wv, keys.appends) + ((keys.ring, keys.flags) if armed else ()):
                out.append(("PEXPIREAT", key, int(exp)))
        return out

    # -- the armed connection (one packet) ------------------------------------------------
    def _armed_rows(self) -> int:
        """The rows whose flags an arming checks: an armed append of at most as many may go."""
        return min(self.capacity, max(self.n, ARM_ROWS))

    def _reused(self, cursor: int, n: int) -> list[tuple[int, int]]:
        """The flag ranges (first and last row) of the rows an append of ``n`` rows at
        ``cursor`` would take that were reserved before (the ring came round to them)."""
        capacity = self.capacity
        if cursor + n <= capacity:
            return []
        row0 = cursor % capacity
        first = min(n, capacity - row0)
        out = [(row0, row0 + first - 1)] if cursor >= capacity else []
        if first < n:
            out.append((0, n - first - 1))
        return out

    def arm_commands(self, after: int) -> list[Command]:
        """WATCH and the reads that arm a connection for the next append (sent after an
        EXEC that left the cursor at ``after``): the layout version, the expiry, the cursor
        and the flags of the next ``max(n, ARM_ROWS)`` rows where the ring came round to
        them (all set: no append is in flight there)."""
        keys = self.keys
        out: list[Command] = [
            ("WATCH", keys.meta, keys.ring), ("HMGET", keys.meta, "lv", "exp", "lim"), ("GET", keys.ring),
        ]
        out += [("GETRANGE", keys.flags, lo, hi) for lo, hi in self._reused(after, self._armed_rows())]
        return out

    def armed_state(self, client: SyncClient, connection: redis.connection.Connection, replies: Sequence[Any], after: int) -> ArmedRing | None:
        """What the replies of :meth:`arm_commands` leave the connection armed with; None when
        it cannot append in one packet (another client appended meanwhile, an append is in
        flight on the next rows, the store is gone...)."""
        rows = self._armed_rows()
        ranges = self._reused(after, rows)
        if len(replies) != 3 + len(ranges) or any(isinstance(r, Exception) for r in replies):
            return None
        meta = replies[1]
        if not isinstance(meta, list) or meta[0] is None or _s(replies[2]) != str(after):
            return None
        if len(meta) > 2 and meta[2] is not None:
            return None  # a rate limiter counts every append in its reserve step: none goes armed
        for (lo, hi), flags in zip(ranges, replies[3:], strict=True):
            if flags != b"\x01" * (hi - lo + 1):
                return None
        return ArmedRing(client, connection, _s(meta[0]), _s(meta[1]), after, rows)

    def usable(self, armed: ArmedRing) -> bool:
        """Whether this append may go out on ``armed`` (same layout, rows checked free, no
        reservation of its own to write first)."""
        return (
            armed.lv == str(self.lv) and self.n <= armed.rows and not self.res.held
            and armed.cursor + self.n <= CURSOR_MAX  # (past it: the reserve script refuses the cursor)
        )

    def check(self, start: int, result: list[Any]) -> None:
        """Raises what the EXEC's replies report: a refused command, or a data key that was
        missing (evicted between the steps: the SETRANGE created it short)."""
        for reply in result:
            if isinstance(reply, redis.exceptions.ResponseError):
                exc = translate_response_error(reply)
                if not isinstance(exc, TDStoreError):
                    # the other commands of the MULTI ran (a server does not roll back): an
                    # error a driver would retry must not make it send the append again
                    exc = CorruptMetadataError(
                        f"the server refused part of an append to {self.keys.base} (a key of the store holds "
                        f"another type of value, damaged or written by hand?), after applying the rest: {reply}"
                    )
                raise exc from reply
        lengths = [int(r) for r in result[: self._setranges]]
        if lengths != self._full_lengths(start):
            raise DataLostError(
                f"an entry appended to at {self.keys.base} is registered but its bytes were gone from the server"
            )

    def _full_lengths(self, start: int) -> list[int]:
        """The full length of the key of each SETRANGE of :meth:`write_commands`, in order."""
        keys, capacity = self.keys, self.capacity
        if not keys.chunks or all(keys.chunks.get(path) is None for path, _rb, _p in self.groups):
            # (the common case, on the hot path) one SETRANGE per run of each entry's one key
            pieces = 1 if self.n <= capacity - start % capacity else 2
            return [capacity * rb for _p, rb, _d in self.groups for _ in range(pieces)]
        row_bytes = {path: rb for path, rb, _ in self.groups}
        out = []
        for path, runs, payload in self._runs(start)[2]:
            chunking = keys.chunks.get(path)
            total = capacity * row_bytes[path]
            index = {} if chunking is None else {key: k for k, key in enumerate(keys.entry_keys(path, chunking))}
            for key, _offset, _data in setrange_commands(keys, [(path, runs, payload)]):
                if chunking is None:
                    out.append(total)
                else:
                    out.append(min(chunking.size, total - index[key] * chunking.size))
        return out


# --------------------------------------------------------------------------- #
# the operation, and its two drivers
# --------------------------------------------------------------------------- #


def _raise_reply(reply: Any) -> None:
    if isinstance(reply, redis.exceptions.ResponseError):
        exc = translate_response_error(reply)
        raise exc from (reply if exc is not reply else None)
    if isinstance(reply, Exception):
        raise reply


def _connection_broke(plan: AppendPlan, err: BaseException) -> OutcomeUnknownError:
    return OutcomeUnknownError(
        f"the connection to the server broke during an append to {plan.keys.base}: it may or may "
        "not have been applied (a re-sent append would take new rows)"
    )


def _unwatch(client: SyncClient, connection: redis.connection.Connection) -> ConnOp[None]:
    """Gives ``connection`` back to the pool without its WATCH; never raises (it runs after
    an append was applied: an error here must not make the caller send it again)."""
    try:
        replies = yield Exchange(connection, [("UNWATCH",)])
        if any(isinstance(r, Exception) for r in replies):
            raise ValueError(replies)
    except Exception:  # noqa: BLE001 - the connection is dropped instead (disconnecting forgets the WATCH)
        yield Discard(client, connection)
        return
    yield Release(client, connection)


def _kept(client: SyncClient, connection: redis.connection.Connection, *, watching: bool) -> ArmedRing:
    """A connection kept in the slot for the next append's two steps, not armed (no layout
    version: :meth:`AppendPlan.usable` refuses it); ``watching``: its WATCH is still on."""
    return ArmedRing(client, connection, "", "", 0, 0, watching=watching)


def _park(
    slot: ArmedSlot, client: SyncClient, connection: redis.connection.Connection, plan: AppendPlan, replies: Sequence[Any], after: int
) -> ConnOp[None]:
    """Keeps ``connection`` armed in ``slot`` when the re-arming ``replies`` allow it.

    Else (another appender appended meanwhile, mostly) the handle's next appends
    take the two steps without arming (the cool-down); the connection stays in the slot
    for them, still WATCHing (their first packet starts with UNWATCH), or goes back to
    the pool after an UNWATCH when another thread's is there.
    """
    armed = plan.armed_state(client, connection, replies, after)
    if armed is None:
        slot.contended(COOL_APPENDS)
        # kept for the next append's two steps, which send the UNWATCH in their first packet
        if not slot.keep(_kept(client, connection, watching=True)):  # type: ignore[arg-type]
            yield from _unwatch(client, connection)
        return
    displaced = slot.put(armed)  # type: ignore[arg-type]
    if displaced is not None:
        yield Discard(displaced.client, displaced.connection)  # (another thread's; the append is applied)


def _append_op(client: SyncClient | AsyncClient, sha: str, plan: AppendPlan, slot: ArmedSlot | None) -> ConnOp[int]:
    """One append try, for either driver: one packet on an armed connection of ``slot``, else
    two (WATCH and the reserve script; then the MULTI of the rows). ``sha``: the reserve
    script's; ``slot`` None: no connection kept between appends (the IO loop's driver).

    Returns:
        The cursor value the rows start at, or :data:`ABORTED` when EXEC did nothing (the
        layout changed or the fence moved: re-plan and try again).

    Raises:
        the reserve script's errors (NOSCRIPT too: nothing was reserved); :class:`OutcomeUnknownError`
        when the connection broke after the write was sent (it may or may not have been
        applied); redis-py's errors before that (nothing was written; a reservation may have
        been made, whose rows stay unflagged).
    """
    connection: Any = None
    armed: ArmedRing | None = None
    unwatch = False
    if slot is not None:
        cooling = slot.cooling()  # (counts this append)
        held: ArmedRing | None = slot.take(client)  # type: ignore[assignment]
        if held is not None and not (yield Usable(held.connection, idle=True)):
            yield Discard(held.client, held.connection)
        elif held is not None and held.watching and not cooling and plan.usable(held):
            armed = held
        elif held is not None:
            # the two steps on it (kept connected: a new connection costs the server more),
            # its WATCH ended in the same packet
            connection, unwatch = held.connection, held.watching
    if armed is not None:
        assert slot is not None
        connection, start = armed.connection, armed.cursor
        commands = [("MULTI",), *plan.write_commands(start, armed.exp, armed=True), ("EXEC",)]
        sent = len(commands)
        try:
            replies = yield Exchange(connection, commands + plan.arm_commands(start + plan.n))
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as err:
            yield Discard(client, connection)
            raise _connection_broke(plan, err) from err
        except BaseException:
            yield Discard(client, connection)
            raise
        result = replies[sent - 1]
        if isinstance(result, list):
            yield from _park(slot, client, connection, plan, replies[sent:], start + plan.n)  # type: ignore[arg-type]
            plan.check(start, result)
            return start
        if isinstance(result, redis.exceptions.ResponseError):
            yield from _park(slot, client, connection, plan, replies[sent:], start + plan.n)  # type: ignore[arg-type]
            first = next((r for r in replies[1 : sent - 1] if isinstance(r, Exception)), None)
            _raise_reply(first if first is not None else result)
        # EXEC did nothing: another client appended (or reserved) meanwhile, or the layout
        # changed. Nothing was written: the two steps follow on this connection.
        meta = replies[sent + 1] if len(replies) > sent + 1 else None
        if isinstance(meta, list) and _s(meta[0]) == armed.lv:
            slot.contended(COOL_APPENDS)
        unwatch = True
    elif connection is None:
        connection = yield Checkout(client)
    sent_write = False
    try:
        while True:
            keys, args = plan.reserve_keys_args(plan.mode())
            first_commands: list[Command] = [("UNWATCH",)] if unwatch else []
            first_commands += [plan.watch_command(), ("EVALSHA", sha, len(keys), *keys, *args)]
            got_replies = yield Exchange(connection, first_commands)
            unwatch = False
            watch, reply = got_replies[-2], got_replies[-1]
            _raise_reply(watch)
            _raise_reply(reply)
            if plan.rate_blocked(reply):
                # nothing reserved: the connection goes back without its WATCH
                yield from _unwatch(client, connection)  # type: ignore[arg-type]
                return RATE_BLOCKED
            got = plan.reserved(reply)
            if got is not None:
                break
        start, exp = got
        commands = [("MULTI",), *plan.write_commands(start, exp), ("EXEC",)]
        arm = slot is not None and slot.cool <= 0  # re-armed unless appends are cooling down
        sent_write = True
        replies = yield Exchange(connection, commands + (plan.arm_commands(start + plan.n) if arm else []))
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as err:
        yield Discard(client, connection)
        if sent_write:
            raise _connection_broke(plan, err) from err
        if isinstance(err, redis.exceptions.TimeoutError):
            raise  # (a slow server: reported as the call's timeout, never sent again)
        # the reserve step was in flight: the append may be sent again (ReserveReplyLost)
        raise ReserveReplyLost(
            f"the connection broke during the reserve step of an append to {plan.keys.base}: {err}"
        ) from err
    except BaseException:
        yield Discard(client, connection)  # forgets the WATCH
        raise
    sent = len(commands)
    if arm:
        assert slot is not None
        yield from _park(slot, client, connection, plan, replies[sent:], start + plan.n)  # type: ignore[arg-type]
    elif slot is None or not slot.keep(_kept(client, connection, watching=False)):  # type: ignore[arg-type]
        yield Release(client, connection)  # EXEC ended the WATCH
    result = replies[sent - 1]
    if isinstance(result, redis.exceptions.ResponseError):
        # EXECABORT: a command was refused when queued (e.g. over maxmemory); nothing ran
        first = next((r for r in replies[1 : sent - 1] if isinstance(r, Exception)), None)
        _raise_reply(first if first is not None else result)
    if result is None:
        return ABORTED
    plan.check(start, result)
    return start


def append_direct(client: SyncClient, runner: ScriptRunner, plan: AppendPlan, slot: ArmedSlot | None = None) -> int:
    """One append try on a blocking client, from the calling thread (:func:`_append_op`, run by
    :func:`tdstore._backend.drive.run_blocking`): one packet on an armed connection of
    ``slot``, else two. A NOSCRIPT raises (the caller then tries through the IO loop)."""
    return run_blocking(_append_op(client, runner.sha("reserve"), plan, slot))


async def append_watched(client: AsyncClient, runner: ScriptRunner, plan: AppendPlan) -> int:
    """:func:`append_direct` on an asyncio client, on the IO loop (the same operation, run by
    :func:`tdstore._backend.drive.run_async`, with no connection kept between appends); the
    reserve script is loaded and the try made again after a NOSCRIPT (nothing was reserved)."""
    try:
        return await run_async(_append_op(client, runner.sha("reserve"), plan, None))
    except redis.exceptions.NoScriptError:
        await runner.ensure_loaded(client, "reserve")
    return await run_async(_append_op(client, runner.sha("reserve"), plan, None))


def stale() -> StaleLayoutError:
    return StaleLayoutError("the layout changed, or the ring came round to this append's rows, between its two steps")


# --------------------------------------------------------------------------- #
# reads of the ring's counters and flags (ring_state, sample, the compare-and-set)
# --------------------------------------------------------------------------- #


def ring_counts(keys: StoreKeys) -> ReadStep[tuple[object, object, int, int]]:
    """The cursor, the layout version, the flagged rows (BITCOUNT) and whether the flags exist,
    in one snapshot (a read step: ``Connection.read_step`` sends it)."""

    def parse(replies: list[object]) -> tuple[object, object, int, int]:
        cursor, lv, flagged, exists = replies
        _check_flags_reply(keys, flagged)
        return cursor, lv, _count(flagged), _count(exists)

    commands: list[Command] = [("GET", keys.ring), ("HGET", keys.meta, "lv"), ("BITCOUNT", keys.flags), ("EXISTS", keys.flags)]
    return ReadStep("snapshot", parse, commands)


def _count(reply: object) -> int:
    """An integer reply (BITCOUNT, EXISTS) as an int; None as 0."""
    return int(reply) if isinstance(reply, (int, bytes)) else 0


def _check_flags_reply(keys: StoreKeys, reply: Any) -> None:
    """A read of the row flags that the server refused (a key of another type) is damage."""
    if isinstance(reply, Exception):
        from tdstore.errors import CorruptMetadataError

        raise CorruptMetadataError(f"the row flags {keys.flags} of the store {keys.base} are not a string: {reply}")


def ring_flags(keys: StoreKeys, capacity: int, whole: bool) -> ReadStep[tuple[object, object, int, object, bool]]:
    """The cursor, the layout version, whether the flags exist, the flags of the ring's
    ``capacity`` rows (``whole``) or their count (BITCOUNT), and whether a rate limiter is set
    (the meta field "lim"), in one snapshot (a read step: ``Connection.read_step`` sends it)."""

    def parse(replies: list[object]) -> tuple[object, object, int, object, bool]:
        cursor, meta, exists, flags = replies
        _check_flags_reply(keys, flags)
        lv, limited = (meta[0], meta[1] is not None) if isinstance(meta, list) else (None, False)
        return cursor, lv, _count(exists), flags, limited

    flags: Command = ("GETRANGE", keys.flags, 0, max(capacity - 1, 0)) if whole else ("BITCOUNT", keys.flags)
    commands: list[Command] = [("GET", keys.ring), ("HMGET", keys.meta, "lv", "lim"), ("EXISTS", keys.flags), flags]
    return ReadStep("snapshot", parse, commands)


#: Rings of at most this many rows have their flags read whole by a sample, uniform or
#: prioritized (one GETRANGE in the snapshot of the rows' read); larger ones per row drawn (one
#: BITFIELD of GETs). Measured on Valkey 8.1 over TCP, with 256 rows drawn (docs/performance.md):
#: at 100,000 rows the whole read added about nothing to the server time of the rows' read,
#: the per-row one 0.14 ms (0.5-0.85 ms when the rows are 21 KB); from about 250,000 rows the
#: per-row read costs less.
FLAGS_READ_MAX = 1 << 17


def reserved_since(rows: torch.Tensor, before: int, after: int, capacity: int) -> torch.Tensor | None:
    """Which of ``rows`` reservations may have reached while the ring cursor went from
    ``before`` to ``after`` (positions ``before .. after - 1``, rows ``position % capacity``);
    None when the cursor went back (a cursor set by hand): the caller checks otherwise."""
    if after < before:
        return None
    span = after - before
    if span >= capacity:
        return torch.ones(rows.numel(), dtype=torch.bool)
    return torch.remainder(rows - before % capacity, capacity) < span


def bracket_reads(keys: StoreKeys) -> list[Command]:
    """What :func:`bracket_holds` compares, read before a sample's rows and again after them:
    the ring cursor, the layout version, the write version and the append counters (the
    write version less the appends counts the writes that are not appends)."""
    return [("GET", keys.ring), ("HGET", keys.meta, "lv"), ("GET", keys.wv), ("HGETALL", keys.appends)]


def bracket_holds(keys: StoreKeys, before: Sequence[object], after: Sequence[object]) -> bool:
    """Whether :func:`bracket_reads` read ``before`` and then ``after`` a read of ring rows
    show that nothing but appends wrote in between: the same layout version, no write but
    appends (every write moves the write version, an append its counter too, in the same
    MULTI or script), and a cursor that did not go back. An append writes only rows that
    its reservation, or its own MULTI, moved the cursor past, and rows reserved earlier are
    unflagged until written: the caller leaves out the rows the cursor reached between the
    two (:func:`reserved_since`). Anything damaged, missing or unexpected: False."""
    try:
        (c0, lv0, wv0, a0), (c1, lv1, wv1, a1) = before, after
        if lv0 is None or isinstance(lv0, Exception) or lv0 != lv1:
            return False
        counts = []
        for wv, appends in ((wv0, a0), (wv1, a1)):
            if isinstance(appends, list):  # (HGETALL's reply as the placed read parses it: field, value, ...)
                appends = dict(zip(appends[::2], appends[1::2], strict=True))
            got, raw = check_counters(keys, appends, wv)
            counts.append(int(raw or 0) - sum(int(v) for v in got.values()))
        return counts[0] == counts[1] and parse_cursor(c1, keys) >= parse_cursor(c0, keys)
    except (CorruptMetadataError, TypeError, ValueError):
        return False


def draw_check_prefix(keys: StoreKeys, capacity: int, rows: torch.Tensor) -> list[Command]:
    """Read commands for the snapshot of a sample's rows drawn before their flags were read
    (``store/ring.py``): the cursor, the meta field "lim" (a rate limiter is set) and the flags,
    of the whole ring where it has at most :data:`FLAGS_READ_MAX` rows (one GETRANGE), else
    of ``rows`` (one BITFIELD); then the rest of :func:`bracket_reads`, for
    :func:`draw_check_bracket`. :func:`parse_draw_check` reads the replies (and
    :func:`rows_flagged` the flags'), with the bracket's after them."""
    if capacity <= FLAGS_READ_MAX:
        flags: Command = ("GETRANGE", keys.flags, 0, max(capacity - 1, 0))
    else:
        args: list[Arg] = []
        for r in rows.tolist():
            args += ["GET", "u8", f"#{r}"]
        flags = ("BITFIELD", keys.flags, *args)
    return [("GET", keys.ring), ("HGET", keys.meta, "lim"), flags, *bracket_reads(keys)[1:]]


def draw_check_bracket(keys: StoreKeys) -> tuple[list[Command], Callable[[list[object], list[object]], bool]]:
    """The ``bracket`` of a read whose prefix is :func:`draw_check_prefix` (see
    ``step.with_prefix``): :func:`bracket_reads` again after the rows, and
    :func:`bracket_holds`, which lets the rows be read outside a MULTI."""

    def holds(before: list[object], after: list[object]) -> bool:
        return bracket_holds(keys, [before[0], *before[3:6]], after)

    return bracket_reads(keys), holds


def rows_flagged(flags: object, rows: torch.Tensor, capacity: int) -> torch.Tensor | None:
    """Whether each of ``rows`` is flagged as written, from the flags :func:`draw_check_prefix`
    read: the ring's whole (bytes; the rows past their end are not flagged) or the rows' (a
    BITFIELD's list). None where the reply is not flags: bytes other than 0 and 1, or not
    one 0 or 1 per row."""
    if isinstance(flags, bytes):
        marks = np.frombuffer(flags, dtype=np.uint8)  # (no copy: a sample reads 100 KB of flags)
        if marks.size and marks.max() > 1:
            return None
        if marks.size < capacity:
            marks = np.concatenate([marks, np.zeros(capacity - marks.size, dtype=np.uint8)])
        return torch.from_numpy(marks[rows.numpy()] == 1)
    if not isinstance(flags, list) or len(flags) != rows.numel() or any(f not in (0, 1) for f in flags):
        return None
    return torch.tensor(flags, dtype=torch.bool)


def parse_draw_check(keys: StoreKeys, replies: Sequence[object]) -> tuple[object, bool, object, object]:
    """The replies of :func:`draw_check_prefix` (and of :func:`draw_check_bracket`'s reads
    after the rows, when the read had them): ``(cursor, limited, flags, cursor after)``; the
    cursor after the rows is the one before where nothing was read after them."""
    cursor, lim, flags = replies[:3]
    after = replies[6] if len(replies) > 6 else cursor
    for reply in (cursor, lim, after):
        if isinstance(reply, Exception):
            raise CorruptMetadataError(f"the ring counters of the store {keys.base} cannot be read: {reply}")
    _check_flags_reply(keys, flags)
    return cursor, lim is not None, flags, after


async def flag_bytes(client: AsyncClient, keys: StoreKeys, rows: Sequence[int]) -> list[int]:
    """The flag byte of each of ``rows`` (one BITFIELD)."""
    args: list[Any] = []
    for r in rows:
        args += ["GET", "u8", f"#{r}"]
    return list(await client.execute_command("BITFIELD", keys.flags, *args))


async def append_counters(client: AsyncClient, keys: StoreKeys) -> tuple[dict[Any, Any], Any]:
    """The append counters and the write version, in one snapshot (for a compare-and-set)."""

    def build(pipe: AsyncPipeline) -> None:
        pipe.hgetall(keys.appends)
        pipe.get(keys.wv)

    counters, wv = await read_snapshot(client, keys, build)
    return check_counters(keys, counters, wv)


def check_counters(keys: StoreKeys, counters: Any, wv: Any) -> tuple[dict[Any, Any], Any]:
    """``(counters, wv)`` as read, once both are what the scripts write: a hash of decimal
    counts and a decimal write version (or none). Damage (another type, garbage, a float)
    raises :class:`~tdstore.errors.CorruptMetadataError` naming the key and the store."""
    from tdstore._core.layout import counter_damage
    from tdstore.errors import CorruptMetadataError

    if isinstance(counters, Exception) or not isinstance(counters, dict):
        raise CorruptMetadataError(f"the append counters {keys.appends} of the store {keys.base} are not a hash: {counters!r:.200}")
    for name, raw in counters.items():
        damage = counter_damage(raw, keys.appends, f"the append counter {name!r:.80} of")
        if damage is not None:
            raise damage
    damage = counter_damage(wv, keys.wv)
    if damage is not None:
        raise damage
    return counters, wv
