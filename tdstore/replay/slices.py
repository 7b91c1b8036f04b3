"""Trajectory slices chosen on the server (issue 26, item 3; docs/replay.md).

``store.sample_slices(num_slices, slice_len, end_key=... | traj_key=...)`` returns
``num_slices * slice_len`` rows, slice after slice, as TorchRL's ``SliceSampler`` does (a
flat batch): each slice is ``slice_len`` rows consecutive in append order (wrapping round
the ring's end), within one episode, never across the ring's write position, and only
rows flagged as written.

The episode index is the column every append already writes: the ``end_key`` entry (a
bool ``done``: one byte per row) or the ``traj_key`` entry (an integer id per row). A
sample is three steps, as a prioritized sample is (``tdstore/replay/priorities.py``):

1. the draw (``lua/slice_draw.lua``, one EVALSHA): each start drawn from a uniform given by
   the client, uniformly by age among the ring's window starts or by the priority tree,
   its window tested with a GETRANGE of the column (and of the flags) and rejected when
   invalid, the next uniform used; when rejection keeps failing, a scan of the ring draws
   exactly among the valid windows (or says there is none);
2. the read of the rows, in one snapshot (``store[idx]``);
3. the check (``lua/slice_check.lua``): a window whose oldest row was reserved again
   (the cursor passed it by the capacity), whose flags were cleared or, prioritized, whose
   start's generation moved, is drawn again (up to 32 times, then ``StaleLayoutError``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple, cast

import torch

from tdstore._backend import slices as _io
from tdstore._core import codec as _codec
from tdstore._core.keys import as_path
from tdstore.errors import CorruptMetadataError, SchemaError, StaleLayoutError, StoreNotFoundError
from tdstore.replay import priorities as _priorities
from tdstore.replay import rate_limit as _rate

if TYPE_CHECKING:
    from tensordict import TensorDictBase

    from tdstore.store import TensorDictStore

__all__ = ["sample"]

#: Draw steps before a sample gives up on windows that keep being appended to under it.
_REDRAWS = 32
#: Layout changes (TDS_STALE from the draw) followed before giving up.
_LAYOUT_TRIES = 4


class _Column(NamedTuple):
    """The episode column of a sample: its data key, kind ("end" or "traj") and item size."""

    key: str
    kind: str
    itemsize: int
    lv: int
    capacity: int


class _LayoutMoved(Exception):
    """The draw found another layout version than the one the column was resolved under."""


class _Drawn(NamedTuple):
    starts: torch.Tensor  # int64 absolute positions
    cursors: torch.Tensor  # int64: the cursor when each start was drawn
    values: torch.Tensor  # float64: p of each start row (prioritized)
    gens: torch.Tensor  # int64 (prioritized)
    p_min: float
    beta: float


def _count(value: object, name: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ValueError(f"{what}: {name} must be an int >= 1, got {value!r}")
    return int(value)


def _column(store: TensorDictStore, end_key: object, traj_key: object, what: str, refresh: bool) -> _Column:
    """The episode column, checked: one element per row, bool or integer (``end_key``), integer (``traj_key``)."""
    if (end_key is None) == (traj_key is None):
        raise ValueError(f"{what}: give exactly one of end_key (the done/end flags) or traj_key (a trajectory id per row)")
    kind, key = ("end", end_key) if end_key is not None else ("traj", traj_key)
    name = "end_key" if kind == "end" else "traj_key"
    try:
        rel = as_path(key)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what}: {name} {key!r} is not a key: {err}") from None
    layout = store._layout(refresh=refresh)
    batch = tuple(store._node(layout).batch_size or ())
    capacity = batch[0] if batch else 0
    if capacity < 1:
        raise ValueError(f"{what}: a ring needs a first batch dim of at least 1 row")
    path = store._path + rel
    meta = layout.entries.get(path)
    shown = rel[0] if len(rel) == 1 else rel
    if meta is None or not meta.is_tensor:
        found = "not in the store" if meta is None else "not a tensor entry"
        raise SchemaError(f"{what}: the {name} {shown!r} is {found}; it must be a tensor with one element per row")
    dtype = _codec.entry_dtype(meta)
    is_int = not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
    if kind == "end" and not (dtype == torch.bool or is_int):
        raise SchemaError(f"{what}: the end_key {shown!r} holds {dtype}; it must be bool or an integer dtype (non-zero: the episode ends)")
    if kind == "traj" and not is_int:
        raise SchemaError(f"{what}: the traj_key {shown!r} holds {dtype}; it must be an integer dtype (one trajectory id per row)")
    shape = tuple(meta.shape or ())
    if len(shape) < len(batch) or shape[0] != capacity or math.prod(shape[1:]) != 1:
        raise SchemaError(
            f"{what}: the {name} {shown!r} has shape {list(shape)}; it must hold one element per row of the "
            f"ring of {capacity} rows (shape [{capacity}] or [{capacity}, 1])"
        )
    if meta.chunk is not None:
        raise SchemaError(
            f"{what}: the {name} {shown!r} is chunked over several server strings, which sample_slices() does not read; "
            "make the store with a larger chunk_bytes"
        )
    return _Column(store._conn.keys.data(path), kind, dtype.itemsize, layout.lv, capacity)


def _draw(
    store: TensorDictStore, col: _Column, length: int, n: int, prioritized: bool,
    generator: torch.Generator | None, acquire: Callable[[], bool] | None, what: str,
) -> _Drawn:
    """``n`` window starts drawn by the server (one EVALSHA each round; rounds where
    rejection found too few scan the ring instead). ``acquire``: as in
    :func:`tdstore.replay.priorities._draw`, called once where the draw says the ring has
    a rate limiter; when it had to wait, the starts are drawn again."""
    conn = store._conn
    keys = _io.draw_keys(conn.keys, col.key)
    starts: list[torch.Tensor] = []
    cursors: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    gens: list[torch.Tensor] = []
    need = n
    scan = False
    p_min, beta = math.inf, 0.0
    where = store._where()
    in_flight: Iterator[None] | None = None  # (the waits for rows the limiter counted, not yet written)
    for round_ in range(_REDRAWS):
        extra = 0 if scan else 3 * need + 16
        u = torch.rand(need + extra, dtype=torch.float64, generator=generator)
        mode = ("p" if prioritized else "u") + ("s" if scan else "")
        args = [str(col.lv), col.kind, str(col.itemsize), str(col.capacity), str(length), mode, str(need), *map(repr, u.tolist())]
        try:
            reply = cast("list[object]", conn.script("slice_draw", keys, args))
        except StaleLayoutError:
            raise _LayoutMoved from None
        except StoreNotFoundError:
            raise store._not_found() from None
        except CorruptMetadataError as err:
            raise CorruptMetadataError(f"{what}: {err}") from err
        status = int(cast("int", reply[0]))
        if status == 0:
            raise ValueError(f"{what}: priorities are off; call enable_priorities() first, or sample with prioritized=False")
        if acquire is not None and int(cast("int", reply[3])) == 1:
            waited, acquire = acquire(), None
            in_flight = _rate.in_flight_pauses()
            if waited or status < 0:
                continue  # (held back a while, or drawn before the limiter agreed: draw again)
        if status < 0:
            if in_flight is not None and next(in_flight, False) is None:
                continue  # the rows the limiter counted may not be written yet
            raise ValueError(
                f"{what}: no valid slice of {length} rows (no episode of at least {length} written rows in the ring "
                "yet, or, prioritized, none with a positive priority); extend() more first"
            )
        got = torch.tensor([int(a) for a in cast("list[int]", reply[1])], dtype=torch.int64)
        k = got.numel()
        cursor = int(cast("bytes", reply[2]))
        if prioritized:
            try:
                vals = torch.tensor([float(v) for v in bytes(cast("bytes", reply[4])).split()], dtype=torch.float64)
                p_min = min(p_min, float(cast("bytes", reply[6])))
                beta = _priorities._parse_settings(reply[7], where).beta
            except ValueError as err:
                raise CorruptMetadataError(f"{what}: the server's draw is damaged: {err}") from err
            if vals.numel() != k:
                raise CorruptMetadataError(f"{what}: the server's draw is damaged")
            values.append(vals)
            gens.append(_priorities._gens(reply[5], k, where))
        starts.append(got)
        cursors.append(torch.full((k,), cursor, dtype=torch.int64))
        need -= k
        if need == 0:
            if not prioritized:
                empty = torch.zeros(n, dtype=torch.float64)
                return _Drawn(torch.cat(starts), torch.cat(cursors), empty, empty.to(torch.int64), p_min, beta)
            return _Drawn(torch.cat(starts), torch.cat(cursors), torch.cat(values), torch.cat(gens), p_min, beta)
        # rejection found fewer than a quarter of what it was asked, or still not all after
        # three rounds: few windows are valid, the next round scans the ring
        scan = scan or k * 4 < need + k or round_ >= 2
    raise StaleLayoutError(
        f"{what}: kept drawing windows being written ({need} of {n} after {_REDRAWS} draws); appends may be failing "
        "between their two steps"
    )


def _weights(values: torch.Tensor, p_min: float, beta: float) -> torch.Tensor:
    """TorchRL's importance weights, ``(p / min(p)) ** -beta`` as float32 (as priorities.sample)."""
    if not 0 < p_min < math.inf:
        return torch.ones_like(values, dtype=torch.float32)
    return torch.pow(values / p_min, -beta).to(torch.float32)


def sample(
    store: TensorDictStore, num_slices: int, slice_len: int, *, end_key: object = None, traj_key: object = None,
    prioritized: bool = False, generator: torch.Generator | None = None,
) -> tuple[TensorDictBase, dict[str, torch.Tensor]]:
    """:meth:`TensorDictStore.sample_slices` with ``return_info=True`` (its documentation is there)."""
    what = f"sample_slices() from {store._where()}"
    num = _count(num_slices, "num_slices", what)
    length = _count(slice_len, "slice_len", what)
    for attempt in range(_LAYOUT_TRIES):
        col = _column(store, end_key, traj_key, what, refresh=attempt > 0)
        if length > col.capacity:
            raise ValueError(f"{what}: slice_len {length} is longer than the ring's {col.capacity} rows")
        try:
            return _sample(store, col, num, length, bool(prioritized), generator, what)
        except _LayoutMoved:
            continue
    raise StaleLayoutError(f"{what}: the store's layout kept changing under the draw ({_LAYOUT_TRIES} tries)")


def _sample(
    store: TensorDictStore, col: _Column, num: int, length: int, prioritized: bool,
    generator: torch.Generator | None, what: str,
) -> tuple[TensorDictBase, dict[str, torch.Tensor]]:
    conn = store._conn
    cap = col.capacity
    keys = _io.check_keys(conn.keys)
    starts = torch.empty(num, dtype=torch.int64)
    gens = torch.zeros(num, dtype=torch.int64)
    values = torch.zeros(num, dtype=torch.float64)
    todo = torch.arange(num)
    steps = torch.arange(length)
    parts: list[tuple[torch.Tensor, TensorDictBase]] = []
    p_min, beta = math.inf, 0.0
    acquire: Callable[[], bool] | None = lambda: _rate.acquire_samples(store, num * length, cap)  # noqa: E731
    for _ in range(_REDRAWS):
        d, acquire = _draw(store, col, length, todo.numel(), prioritized, generator, acquire, what), None  # (counts once)
        p_min, beta = min(p_min, d.p_min), d.beta
        rows = ((d.starts.unsqueeze(1) + steps) % cap).reshape(-1)
        # (each row once, in ring order: overlapping slices read their rows once, and runs of
        # rows go as ranges; the slices are then gathered on the client)
        uniq, inverse = torch.unique(rows, sorted=True, return_inverse=True)
        batch = store[uniq][inverse]
        args = [str(cap), str(length), *map(str, d.starts.tolist())]
        cursor_b, flags, gen_blob = cast("list[bytes]", conn.script("slice_check", keys, args))
        cursor = int(cursor_b or b"0")
        ok = torch.frombuffer(bytearray(flags), dtype=torch.uint8) == ord("1") if flags else torch.zeros(0, dtype=torch.bool)
        if ok.numel() != d.starts.numel():
            raise CorruptMetadataError(f"{what}: the server's check is damaged")
        # (the cursor went back: set_ring_total; past start + cap: the oldest row was reserved again)
        ok &= (cursor >= d.cursors) & (cursor <= d.starts + cap)
        if prioritized:
            try:
                now = _priorities._gens(gen_blob, d.starts.numel(), where=store._where())
            except CorruptMetadataError:
                now = torch.full((d.starts.numel(),), -1, dtype=torch.int64)  # (the tree went: drawn again, or refused)
            ok &= now == d.gens
        positions = todo[ok]
        starts[positions], gens[positions], values[positions] = d.starts[ok], d.gens[ok], d.values[ok]
        parts.append((positions, batch if bool(ok.all()) else batch[ok.repeat_interleave(length)]))
        todo = todo[~ok]
        if todo.numel() == 0:
            break
    else:
        raise StaleLayoutError(
            f"{what}: the windows drawn kept being appended to before they were read ({todo.numel()} of {num} after "
            f"{_REDRAWS} draws)"
        )
    if len(parts) == 1:
        out = parts[0][1]
    else:
        order = torch.cat([(p.unsqueeze(1) * length + steps).reshape(-1) for p, _ in parts])
        out = torch.cat([b for _, b in parts])[torch.argsort(order)]
    ring_starts = starts % cap
    info = {"index": ((starts.unsqueeze(1) + steps) % cap).reshape(-1), "start": ring_starts, "position": starts}
    if prioritized:
        info["_weight"] = _weights(values, p_min, beta)
        info["generation"] = gens
    return out, info
