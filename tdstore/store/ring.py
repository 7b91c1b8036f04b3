"""Shared-buffer primitives: an atomic ring-buffer append and sampling of valid rows.

``extend`` reserves rows through a cursor kept on the server (``lua/reserve.lua``), then
writes them with one MULTI that also flags them as written (``tdstore/_backend/append.py``):
many processes can append to one preallocated buffer (``from_schema``) at once and never
get the same rows, and ``sample`` draws only rows flagged as written, so it never returns a
half-written or a reserved-but-unwritten row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from tensordict import TensorDictBase
from tensordict.utils import is_non_tensor, is_tensorclass

from tdstore._backend import append as _append_mod
from tdstore._backend.optimistic import optimistic
from tdstore._core import codec as _codec
from tdstore._core.keys import as_path as _as_path
from tdstore._core.planner import check_tensor
from tdstore.errors import CorruptMetadataError, SchemaError, StaleLayoutError
from tdstore.replay import priorities as _priorities
from tdstore.replay import rate_limit as _rate

if TYPE_CHECKING:
    from tdstore.store import TensorDictStore

__all__ = [
    "RingState", "Flags", "extend", "ring_state", "set_ring_total", "sample", "sample_drawn_first", "read_drawn", "read_flags",
    "written_count", "draw_written",
]


class RingState(NamedTuple):
    """The ring buffer's counters, read from the server in one step."""

    valid: int  #: rows holding appended data, flagged as written (at most min(total, capacity))
    total: int  #: rows ever appended (reserved: an append in flight counts)
    capacity: int  #: the size of the first batch dim
    cursor: int  #: the row the next append starts at (total % capacity)


class _ExtendSpec(NamedTuple):
    """What ``extend()`` needs of a layout: see :func:`extend_spec`."""

    batch: torch.Size
    capacity: int
    #: per tensor entry: (path, path relative to the handle, dtype, row shape, row bytes)
    leaves: tuple[tuple[tuple[str, ...], tuple[str, ...], torch.dtype, torch.Size, int], ...]
    relative: frozenset[tuple[str, ...]]  #: the relative paths of the tensor entries
    per_row: tuple[tuple[str, ...], ...]  #: the per-row non-tensor entries (extend() refuses them)


def extend(store: TensorDictStore, td: Any) -> torch.Tensor:
    """:meth:`TensorDictStore.extend` (its documentation is there)."""
    if is_tensorclass(td):
        td = td._tensordict
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"extend() takes a TensorDict, got {type(td).__name__}")
    conn = store._conn

    def once(_attempt: int) -> torch.Tensor:
        layout = store._layout()
        spec = extend_spec(store, layout)
        batch, capacity = spec.batch, spec.capacity
        n = td.batch_size[0] if td.batch_dims else 0
        if td.batch_dims == 0 or td.batch_size[1:] != batch[1:]:
            raise SchemaError(
                f"extend() into {store._where()} takes rows of batch shape [n, {', '.join(map(str, batch[1:]))}]"
                f"; got batch_size={list(td.batch_size)}"
            )
        if not 1 <= n <= capacity:
            raise SchemaError(f"extend() appends 1 to {capacity} rows at once into {store._where()}, got {n}")
        # non-tensor columns are not appended: refuse rather than leave old values beside new rows
        non_tensor = [k for k, v in td.items(True, False) if is_non_tensor(v)]
        if non_tensor or spec.per_row:
            key = _as_path(non_tensor[0]) if non_tensor else spec.per_row[0][len(store._path) :]
            name = key[0] if len(key) == 1 else key
            why = (
                f"td holds the non-tensor entry {name!r}" if non_tensor
                else f"its non-tensor entry {name!r} holds one value per row, which the new rows would not get"
            )
            raise SchemaError(
                f"extend() into {store._where()} appends tensor entries only, and {why}. Nothing was "
                "written; write non-tensor columns with store[rows] = td"
            )
        given = {k if isinstance(k, tuple) else (k,) for k in td.keys(True, True)}
        if given != spec.relative:
            missing = sorted(str(store._path + k) for k in spec.relative - given)
            extra = sorted(str(store._path + k) for k in given - spec.relative)
            raise SchemaError(
                f"extend() writes every tensor entry of {store._where()} at once: missing {missing}, unknown {extra}"
            )
        groups = []
        keep = []
        for path, rel, dtype, row_shape, row_bytes in spec.leaves:
            value = td.get(rel)
            if value.shape[1:] != row_shape or value.shape[0] != n:
                raise SchemaError(
                    f"extend(): entry {path!r} of {store._where()} takes rows of shape "
                    f"{list(row_shape)}, got {list(value.shape[1:])}"
                )
            try:
                flat, view = _codec.tensor_view(value if value.dtype == dtype else value.to(dtype))
            except (NotImplementedError, RuntimeError):
                # a meta, sparse or nested tensor: the clear TypeError of store[k] = value
                # (checked here, off the hot path, only when torch refused)
                check_tensor(value, path, store._where())
                raise
            keep.append(flat)
            groups.append((path, row_bytes, view))
        plan = _append_mod.AppendPlan(
            conn.keys, groups, lv=layout.lv, n=n, capacity=capacity, sub=store._path, reservation=reservation,
            new_rows=_priorities.new_rows(store, layout),  # (None unless priorities are on)
        )
        start = conn.append(plan)
        if start == _append_mod.RATE_BLOCKED:
            start = _wait_to_append(store, plan, n)
        if start == _append_mod.ABORTED:
            raise _append_mod.stale()
        return (start + torch.arange(n)) % capacity

    # the rows reserved by a try whose write was aborted are written by the next try
    reservation = _append_mod.Reservation()
    return optimistic(once, where=store._where, what="extend()", on_stale=lambda: store._layout(refresh=True))

def _wait_to_append(store: TensorDictStore, plan: _append_mod.AppendPlan, n: int) -> int:
    """Tries the append ``plan`` again while the rate limiter holds it back (see
    :func:`tdstore.replay.rate_limit.wait`); returns what the last try returned."""
    got = _append_mod.RATE_BLOCKED

    def attempt() -> tuple[bool, str]:
        nonlocal got
        got = store._conn.append(plan)
        return got != _append_mod.RATE_BLOCKED, plan.rate_timeout

    _rate.wait(store, f"extend() of {n} rows", attempt, held=plan.rate_timeout)
    return got


def extend_spec(store: TensorDictStore, layout: Any) -> _ExtendSpec:
    """What ``extend()`` checks and writes under ``layout`` (memoized per layout)."""
    key = ("extend", store._path)
    spec: _ExtendSpec | None = layout.memo.get(key)
    if spec is not None:
        return spec
    batch = torch.Size(store._node(layout).batch_size or ())
    if not batch:
        raise SchemaError(f"extend() needs a store with a batch dim; {store._where()} has none")
    nb, depth = len(batch), len(store._path)
    leaves = []
    per_row = []
    for path, meta in store._descendants(layout, store._path):
        if meta.is_tensor:
            dtype = _codec.entry_dtype(meta)
            row_shape = torch.Size(tuple(batch[1:]) + tuple((meta.shape or ())[nb:]))
            leaves.append((path, path[depth:], dtype, row_shape, _codec.tensor_nbytes(row_shape, dtype)))
        elif meta.is_non_tensor and meta.stack:
            per_row.append(path)
    spec = _ExtendSpec(batch, batch[0], tuple(leaves), frozenset(leaf[1] for leaf in leaves), tuple(per_row))
    layout.memo[key] = spec
    return spec

def ring_state(store: TensorDictStore) -> RingState:
    """:meth:`TensorDictStore.ring_state` (its documentation is there)."""
    conn = store._conn
    cursor, lv, flagged, exists = conn.read_step(lambda _runner: _append_mod.ring_counts(conn.keys))
    if lv is None:
        raise store._not_found()
    total = _append_mod.parse_cursor(cursor, conn.keys)
    capacity = store.batch_size[0] if store.batch_dims else 0
    # a flag byte is 0 or 1 and only reserved rows are flagged: never more valid than total
    valid = min(flagged, capacity, total) if exists else min(total, capacity)
    return RingState(valid, total, capacity, total % capacity if capacity else 0)

def set_ring_total(store: TensorDictStore, total: int) -> None:
    """:meth:`TensorDictStore.set_ring_total` (its documentation is there)."""
    capacity = store.batch_size[0] if store.batch_dims else 0
    if capacity < 1:
        raise ValueError(f"set_ring_total() on {store._where()}: a ring needs a first batch dim of at least 1 row")
    # (with the priority tree's rebuild in the same MULTI: a no-op where priorities are off)
    if not _priorities.set_ring_total(store, total, capacity):
        raise store._not_found()

def sample(
    store: TensorDictStore, n: int, *, generator: torch.Generator | None = None, prioritized: bool = False,
    return_info: bool = False,
) -> Any:
    """:meth:`TensorDictStore.sample` (its documentation is there)."""
    if prioritized:
        batch, info = _priorities.sample(store, n, generator=generator)
        return (batch, info) if return_info else batch
    got = sample_drawn_first(store, n, generator) if store._conn.ring_full else None
    if got is not None:
        batch, idx = got
    else:
        batch, idx = read_written(store, n, generator)
    return (batch, {"index": idx}) if return_info else batch


def sample_drawn_first(store: TensorDictStore, n: int, generator: torch.Generator | None) -> tuple[TensorDictBase, torch.Tensor] | None:
    """A uniform sample of a full ring in one server step: ``n`` rows drawn among all its
    rows and read by :func:`read_drawn`; a row whose flag is clear (an append in flight, or
    one that died between its two steps) is drawn again by :func:`draw_written` and read
    (rejection: each row is uniform among the written ones). None, with nothing kept, when
    the snapshot shows the ring not full or rate-limited: the caller reads the flags first."""
    capacity = store.batch_size[0] if store.batch_dims else 0
    if capacity < 1:
        return None
    got = read_drawn(store, torch.randint(0, capacity, (n,), generator=generator))
    if got is None:
        return None
    batch, idx, ok = got
    if bool(ok.all()):
        return batch, idx
    more, redrawn = read_written(store, int((~ok).sum()), generator)
    stay, order = _redraw_order(ok)
    return torch.cat([batch[stay], more])[order], torch.cat([idx[stay], redrawn])[order]  # type: ignore[index]


def read_written(
    store: TensorDictStore, n: int, generator: torch.Generator | None, read: Flags | None = None
) -> tuple[TensorDictBase, torch.Tensor]:
    """``n`` rows drawn by :func:`draw_written` (from ``read``, when given) and read in one
    snapshot with their flags: ``(batch, idx)``. A row whose flag is clear in that snapshot is
    drawn again, from the flags read anew, and read the same way (at most :data:`_REDRAWS`
    times): an append may have reserved it since the flags were read (its bytes are the old
    row's, whole), and after a failover the promoted replica may lack the write that flagged
    it (its bytes were never written there). Either way the sample never returns it."""
    capacity = store.batch_size[0] if store.batch_dims else 0
    read = read if read is not None else read_flags(store)
    idx = draw_written(store, n, generator, read)
    if not read.exists:
        return store[idx], idx  # (a ring appended to before the flags existed: nothing to check)
    got = _read_flagged(store, idx, capacity)
    if got is None:
        return store[idx], idx
    batch, ok = got
    for _ in range(_REDRAWS):
        if bool(ok.all()):
            return batch, idx
        # (the rate limiter counted the whole sample already: the redraw is not counted again)
        redrawn = draw_written(store, int((~ok).sum()), generator, read_flags(store)._replace(limited=False))
        more = _read_flagged(store, redrawn, capacity)
        if more is None:
            more = (store[redrawn], torch.ones(redrawn.numel(), dtype=torch.bool))
        stay, order = _redraw_order(ok)
        batch = torch.cat([batch[stay], more[0]])[order]  # type: ignore[index]
        idx = torch.cat([idx[stay], redrawn])[order]
        ok = torch.cat([ok[stay], more[1]])[order]
    if bool(ok.all()):
        return batch, idx
    raise StaleLayoutError(
        f"sample() from {store._where()}: kept drawing rows whose flags were clear when read ({int((~ok).sum())} "
        f"of {n} after {_REDRAWS} draws); appends may be failing between their two steps"
    )


def _redraw_order(ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(stay, order)`` for putting rows drawn again in the places ``ok`` has clear:
    ``torch.cat([kept[stay], redrawn])[order]`` of anything with one item per row drawn."""
    stay = ok.nonzero().flatten()
    return stay, torch.argsort(torch.cat([stay, (~ok).nonzero().flatten()]))


def _read_flagged(store: TensorDictStore, idx: torch.Tensor, capacity: int) -> tuple[TensorDictBase, torch.Tensor] | None:
    """Rows ``idx`` read in one snapshot with their flags: ``(batch, written)``; None when the
    read went another way or the flags are gone: the caller reads the rows without the check,
    as where there are no flags."""
    got = _read_with_flags(store, idx, capacity)
    if got is None or (capacity <= _append_mod.FLAGS_READ_MAX and not got[3]):
        return None
    return got[0], _written(store, got[3], idx, capacity, full=False) & ~got[4]


def read_drawn(store: TensorDictStore, idx: torch.Tensor) -> tuple[TensorDictBase, torch.Tensor, torch.Tensor] | None:
    """Rows ``idx`` of a full ring, drawn before their flags were read, read in one snapshot
    with the cursor, the rate-limiter mark and their flags: ``(batch, idx, written)``, where
    ``written[i]`` says whether row ``idx[i]`` was flagged as written (the others are to be
    drawn again). None when the snapshot shows the ring not full, rate-limited, or without
    flags (nothing drawn is kept: the caller reads the flags first); it then also clears
    the connection's ``ring_full``."""
    conn = store._conn
    capacity = store.batch_size[0] if store.batch_dims else 0
    got = _read_with_flags(store, idx, capacity)
    if got is None:  # (read another way: a small store under churn is read whole)
        return None
    batch, cursor, limited, flags, reached = got
    if limited or _append_mod.parse_cursor(cursor, conn.keys) < capacity or not flags:
        conn.ring_full = False  # (no flags: a ring appended to before they existed, read as such)
        return None
    if isinstance(flags, list) and not any(flags):
        conn.ring_full = False
        return None  # (no row drawn is written: the flags may be gone; read them first)
    return batch, idx, _written(store, flags, idx, capacity, full=True) & ~reached


def _read_with_flags(
    store: TensorDictStore, idx: torch.Tensor, capacity: int
) -> tuple[TensorDictBase, object, bool, object, torch.Tensor] | None:
    """Rows ``idx`` read with the cursor, the rate-limiter mark and the flags (of the whole
    ring where it has at most ``FLAGS_READ_MAX`` rows, else of ``idx``) read just before
    them: ``(batch, cursor, limited, flags, reached)``; None when the read went another way
    (a small store under churn is read whole, without the prefix). The rows are read in one
    snapshot with the rest, or between two MULTIs that show that nothing but appends wrote
    meanwhile (``_append.draw_check_bracket``); ``reached[i]`` then says whether an append
    reserved row ``idx[i]`` meanwhile (its bytes may be torn: not to be kept)."""
    keys = store._conn.keys
    seen: list[list[object]] = []
    prefix = _append_mod.draw_check_prefix(keys, capacity, idx)
    batch = store._read_index(idx, prefix=prefix, sink=seen.append, bracket=_append_mod.draw_check_bracket(keys))
    if not seen:
        return None
    cursor, limited, flags, after = _append_mod.parse_draw_check(keys, seen[-1])
    reached = _append_mod.reserved_since(idx, _append_mod.parse_cursor(cursor, keys), _append_mod.parse_cursor(after, keys), capacity)
    if reached is None:  # (the bracket held: the cursor did not go back)
        raise CorruptMetadataError(f"sample() from {store._where()}: the ring cursor {keys.ring} went back during a read")
    return batch, cursor, limited, flags, reached


def _written(store: TensorDictStore, flags: object, idx: torch.Tensor, capacity: int, full: bool) -> torch.Tensor:
    """Whether each row of ``idx`` is flagged as written, from the flags :func:`_read_with_flags`
    read. ``full``: the snapshot showed the ring full, so the flags must cover every row; else
    the rows past their end (never reserved yet) are not written."""
    keys = store._conn.keys
    if full and isinstance(flags, bytes) and len(flags) < capacity:
        raise CorruptMetadataError(
            f"sample() from {store._where()}: the row flags {keys.flags} hold {len(flags)} bytes, "
            f"not one per row of the ring's {capacity}"
        )
    written = _append_mod.rows_flagged(flags, idx, capacity)
    if written is None:
        raise CorruptMetadataError(f"sample() from {store._where()}: the row flags {keys.flags} hold bytes other than 0 and 1")
    return written


class Flags(NamedTuple):
    """One snapshot of a ring's row flags (:func:`read_flags`): what a uniform draw chooses among."""

    cursor: bytes | None  #: the append cursor as stored
    exists: int  #: whether the flags string exists (a ring never appended to has none)
    flags: bytes | int | None  #: the flag bytes of the ring's rows, or (a large ring) their count
    limited: bool  #: whether a rate limiter is set


def read_flags(store: TensorDictStore) -> Flags:
    """The ring's flags, its cursor and whether it is rate-limited, in one server step."""
    conn = store._conn
    capacity = store.batch_size[0] if store.batch_dims else 0
    whole = capacity <= _append_mod.FLAGS_READ_MAX
    cursor, lv, exists, flags, limited = conn.read_step(lambda _runner: _append_mod.ring_flags(conn.keys, capacity, whole))
    if lv is None:
        raise store._not_found()
    # (the next sample may draw first: see sample_drawn_first)
    conn.ring_full = bool(exists) and not limited and capacity > 0 and _append_mod.parse_cursor(cursor, conn.keys) >= capacity
    return Flags(cast("bytes | None", cursor), exists, cast("bytes | int | None", flags), limited)


def _flag_bytes(store: TensorDictStore, flags: object) -> bytes:
    if not isinstance(flags, bytes) or flags.translate(None, b"\x00\x01"):
        raise CorruptMetadataError(
            f"sample() from {store._where()}: the row flags {store._conn.keys.flags} hold bytes other than 0 and 1"
        )
    return flags


def written_count(store: TensorDictStore, read: Flags) -> int:
    """How many rows a draw from ``read`` (:func:`read_flags`) chooses among: the rows flagged
    as written (all reserved rows where the ring has no flags yet)."""
    capacity = store.batch_size[0] if store.batch_dims else 0
    total = min(_append_mod.parse_cursor(read.cursor, store._conn.keys), capacity)
    if not read.exists:
        return total
    if capacity > _append_mod.FLAGS_READ_MAX:
        return min(int(read.flags or 0), total)
    return _flag_bytes(store, read.flags)[:capacity].count(1)


def draw_written(
    store: TensorDictStore, n: int, generator: torch.Generator | None, read: Flags | None = None
) -> torch.Tensor:
    """``n`` rows drawn uniformly (with replacement) among those flagged as written (as
    ``read`` shows them, when given: one :func:`read_flags` already made)."""
    conn = store._conn
    keys = conn.keys
    capacity = store.batch_size[0] if store.batch_dims else 0
    large = capacity > _append_mod.FLAGS_READ_MAX
    cursor, exists, flags, limited = read if read is not None else read_flags(store)
    if limited and capacity:
        # (held back a while: the ring moved on meanwhile. Or the flags were read before the
        # limiter agreed, and showed no row: read again)
        if _rate.acquire_samples(store, n, capacity) or not _any_written(cursor, exists, flags, large):
            cursor, exists, flags, _ = read_flags(store)
        # the limiter counts rows when their append reserves them: those it counted may all
        # still be in flight, written a moment later. Wait for the first (bounded)
        for _ in _rate.in_flight_pauses() if not _any_written(cursor, exists, flags, large) else ():
            cursor, exists, flags, _ = read_flags(store)
            if _any_written(cursor, exists, flags, large):
                break
    total = min(_append_mod.parse_cursor(cursor, keys), capacity)
    empty = ValueError(f"sample() from {store._where()}: no row was appended yet (extend() first)")
    if not exists:  # a store appended to before the flags existed, or never
        if total == 0:
            raise empty
        return torch.randint(0, total, (n,), generator=generator)
    if not large:
        flags = _flag_bytes(store, flags)
        if not flags:
            raise empty
        written = torch.frombuffer(bytearray(flags), dtype=torch.uint8)[:capacity].nonzero().flatten()
        if written.numel() == 0:
            raise empty
        return written[torch.randint(0, written.numel(), (n,), generator=generator)]
    if int(flags or 0) == 0 or total == 0:
        raise empty
    # a large ring: draw among the rows reserved so far, check their flags, redraw the
    # few that are not written (in flight, or left by a dead appender)
    idx = torch.randint(0, total, (n,), generator=generator)
    todo = torch.arange(n)
    for _ in range(_REDRAWS):
        rows = idx[todo].tolist()
        got = conn.run(lambda c, rows=rows: _append_mod.flag_bytes(c, keys, rows))
        bad = torch.tensor([not f for f in got], dtype=torch.bool)
        todo = todo[bad]
        if todo.numel() == 0:
            return idx
        idx[todo] = torch.randint(0, total, (todo.numel(),), generator=generator)
    raise StaleLayoutError(
        f"sample() from {store._where()}: kept drawing rows not written yet ({todo.numel()} of {n} after "
        f"{_REDRAWS} draws); appends may be failing between their two steps"
    )


def _any_written(cursor: bytes | None, exists: int, flags: bytes | int | None, large: bool) -> bool:
    """Whether a read of the ring's flags shows at least one written row (a damaged read
    counts as one: the caller then reports it)."""
    if not exists:
        return bool(cursor) and cursor != b"0"
    if large:
        return flags not in (None, 0, b"0")
    return not isinstance(flags, bytes) or b"\x01" in flags or bool(flags.translate(None, b"\x00\x01"))


#: Draws of the rows found unflagged before sample() of a large ring gives up.
_REDRAWS = 32
