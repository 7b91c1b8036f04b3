"""Proportional prioritized replay on the server (issue 26, item 1; docs/replay.md).

The semantics are those of TorchRL's ``PrioritizedSampler`` (Schaul et al. 2016): a row of
priority ``q`` holds the value ``p = (q + eps) ** alpha``, is drawn with probability
``p / sum(p)``, and comes with the importance weight ``(p / min(p)) ** -beta`` (the weight
``(N * P(i)) ** -beta`` divided by the largest weight of the buffer). A new row gets the max
priority given so far (1 while none was), in the MULTI that writes it.

The tree, the generations and the max priority live in four strings of the store
(``StoreKeys.replay_keys()``, laid out in ``lua/lib/prio.lua``), the settings in the meta
field ``"prio"``. Every change is one script step (``lua/prio_*.lua``): a sample draws its
rows in one EVALSHA, an update of any number of rows is one EVALSHA, and an append's new
rows get their priority inside the append's MULTI (``AppendPlan(new_rows=...)``). No row
byte passes through Lua.

A prioritized sample is two steps: the draw (rows, their generations, their values and
the ring cursor) and the read of the rows with the cursor and their flags in the same
snapshot. A row that a reservation reached in between (an append came round to it), or whose
flag is clear there (a read from a promoted replica that lacks the write which flagged it),
is drawn again, so every row returned holds the bytes of the generation returned with it;
where the cursor went back, a third step checks the rows' generations and flags
(``lua/prio_check.lua``).

The tree's values are little-endian doubles where the server's Lua has ``struct`` (the
settings' ``"enc": "f64"``), else ``%.17g`` text (``"text"``: fakeredis); see
``lua/lib/prio.lua``.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np
import torch

from tdstore._backend import append as _append
from tdstore._backend import priorities as _io
from tdstore.errors import CorruptMetadataError, SchemaError, StaleLayoutError, StoreNotFoundError
from tdstore.replay import rate_limit as _rate

if TYPE_CHECKING:
    from tensordict import TensorDictBase

    from tdstore._core.keys import StoreKeys
    from tdstore.store import TensorDictStore

__all__ = [
    "PrioritySettings", "DEFAULT_ARITY", "ENCODINGS", "enable", "disable", "settings", "sample", "draw", "update",
    "new_rows", "set_ring_total", "tree_problems", "tree_report", "mass",
]

#: The arity of the tree (children per inner node): measured best (benchmarks/bench_priority_structures.py).
DEFAULT_ARITY = 8
#: Width in bytes of a value in the tree's strings, by encoding, and of a generation (lua/lib/prio.lua).
_PW = {"text": 23, "f64": 8}
_GW = 16
#: The encodings of the tree's values: little-endian doubles where the server's Lua has the
#: struct library (Redis, Valkey, KeyDB), else text (fakeredis); the server chooses at enable.
ENCODINGS = ("f64", "text")
#: The largest double: a tree's values are finite.
_P_MAX = 1.7976931348623157e308
#: Draw steps before a sample gives up on rows that keep being appended to under it.
_REDRAWS = 32


class PrioritySettings(NamedTuple):
    """The settings of a store's prioritized replay, as kept on the server."""

    alpha: float
    beta: float
    eps: float
    arity: int  #: children per inner node of the tree
    capacity: int  #: the ring's rows the tree covers
    #: how the tree's values are stored: "f64" (doubles) or "text" (where the server's Lua has no struct)
    encoding: str = "text"


def _capacity(store: TensorDictStore, what: str) -> int:
    capacity = store.batch_size[0] if store.batch_dims else 0
    if capacity < 1:
        raise ValueError(f"{what} on {store._where()}: a ring needs a first batch dim of at least 1 row")
    return capacity


def _real(value: Any, name: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)) or float(value) < 0:
        raise ValueError(f"{what}: {name} must be a finite number >= 0, got {value!r}")
    return float(value)


def enable(
    store: TensorDictStore, alpha: float, beta: float, eps: float = 1e-8, arity: int = DEFAULT_ARITY,
    encoding: str | None = None,
) -> None:
    """:meth:`TensorDictStore.enable_priorities` (its documentation is there).

    ``encoding``: one of :data:`ENCODINGS`; None (the default) lets the server choose "f64"
    where its Lua has struct. "f64" on a server without it raises ValueError."""
    what = f"enable_priorities() on {store._where()}"
    capacity = _capacity(store, "enable_priorities()")
    a, b, e = _real(alpha, "alpha", what), _real(beta, "beta", what), _real(eps, "eps", what)
    if a > 1e6 or b > 1e6:
        raise ValueError(f"{what}: alpha and beta must be at most 1e6, got {alpha!r} and {beta!r}")
    if isinstance(arity, bool) or not isinstance(arity, numbers.Integral) or not 2 <= int(arity) <= 64:
        raise ValueError(f"{what}: arity must be an int from 2 to 64, got {arity!r}")
    fields: dict[str, object] = {"alpha": a, "beta": b, "eps": e, "k": int(arity), "cap": capacity}
    if encoding is not None:
        if encoding not in ENCODINGS:
            raise ValueError(f"{what}: encoding must be one of {ENCODINGS} or None, got {encoding!r}")
        fields["enc"] = encoding
    text = json.dumps(fields)
    conn = store._conn
    try:
        conn.run(lambda c: _io.call(c, conn.runner, "prio_build", _io.build_keys(conn.keys), ["enable", text]))
    except StoreNotFoundError:
        raise store._not_found() from None
    except SchemaError as err:
        raise ValueError(f"{what}: {err}") from None
    conn.layout = None  # the layout version moved (the appends re-plan with the tree's command)


def disable(store: TensorDictStore) -> bool:
    """:meth:`TensorDictStore.disable_priorities` (its documentation is there)."""
    conn = store._conn
    try:
        done = conn.run(lambda c: _io.call(c, conn.runner, "prio_build", _io.build_keys(conn.keys), ["off"]))
    except StoreNotFoundError:
        raise store._not_found() from None
    conn.layout = None
    return bool(done)


def _parse_settings(raw: Any, where: str) -> PrioritySettings:
    try:
        got = json.loads(raw)
        out = PrioritySettings(
            float(got["alpha"]), float(got["beta"]), float(got["eps"]), int(got["k"]), int(got["cap"]), got.get("enc", "text"),
        )
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise CorruptMetadataError(f"the priority settings of {where} are damaged: {raw!r:.100}") from err
    if out.encoding not in ENCODINGS:
        raise CorruptMetadataError(f"the priority settings of {where} are damaged (encoding {out.encoding!r}): {raw!r:.100}")
    return out


def settings(store: TensorDictStore) -> PrioritySettings | None:
    """:meth:`TensorDictStore.priority_settings` (its documentation is there)."""
    raw = store._layout(refresh=True).meta.get("prio")
    return None if raw is None else _parse_settings(raw, store._where())


def new_rows(store: TensorDictStore, layout: Any) -> Any:
    """The ``new_rows`` command builder of an append under ``layout`` (:class:`AppendPlan`):
    None when priorities are off there (memoized per layout: nothing more to send)."""
    memo = layout.memo.get("prio_new")
    if memo is None:
        conn = store._conn
        memo = layout.memo["prio_new"] = (
            _io.new_rows_command(conn.keys, conn.runner) if layout.meta.get("prio") is not None else False
        )
    return memo or None


def set_ring_total(store: TensorDictStore, total: int, capacity: int) -> bool:
    """The ring's cursor set and the tree rebuilt (its rows at the initial priority), one MULTI."""
    conn = store._conn
    return bool(conn.run(lambda c: _io.set_ring_total(c, conn.keys, conn.runner, total, capacity)))


# --------------------------------------------------------------------------- #
# sampling
# --------------------------------------------------------------------------- #


def _gens(blob: Any, count: int, where: str) -> torch.Tensor:
    """``count`` generations from their 16-digit text, back to back."""
    raw = np.frombuffer(bytes(blob), dtype=np.uint8)
    if raw.size != count * _GW or ((raw < 48) | (raw > 57)).any():
        raise CorruptMetadataError(f"the generations of {where} are damaged (not {count} counts of 16 digits)")
    digits = (raw.reshape(count, _GW).astype(np.int64) - 48)
    return torch.from_numpy(digits @ (10 ** np.arange(_GW - 1, -1, -1, dtype=np.int64)))


class _Drawn(NamedTuple):
    rows: torch.Tensor  # int64
    values: torch.Tensor  # float64: p of each row
    gens: torch.Tensor  # int64
    p_min: float
    beta: float
    cursor: int | None  # the ring cursor at the draw (the earliest of its rounds); None: not known


def _draw(
    store: TensorDictStore, n: int, generator: torch.Generator | None, acquire: Callable[[], bool] | None = None,
) -> _Drawn:
    """``n`` rows drawn by the server (one EVALSHA each round; a round that drew rows being
    appended to asks again for the rest).

    ``acquire``: where the draw says the ring has a rate limiter, called once before any row
    is kept (it counts the sample, waiting while the limiter holds it back); when it had to
    wait, the rows are drawn again from the tree as it is now."""
    conn = store._conn
    keys = conn.keys
    where = store._where()
    binary = conn.lua_has_struct  # (the uniforms as doubles: lua/prio_draw.lua)
    rows: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    gens: list[torch.Tensor] = []
    need = n
    p_min, beta = math.inf, 0.0
    cursor: int | None = None
    known = True  # (every round's reply gave its cursor)
    in_flight: Iterator[None] | None = None  # (the waits for rows the limiter counted, not yet written)
    for _ in range(_REDRAWS):
        u = torch.rand(need + max(8, need // 4), dtype=torch.float64, generator=generator)
        args: list[str | bytes] = (
            [str(need), "f64", u.numpy().astype("<f8").tobytes()] if binary else [str(need), *map(repr, u.tolist())]
        )
        reply = cast("list[Any]", conn.script("prio_draw", _io.draw_keys(keys), args))
        status = int(reply[0])
        if status == 0:
            raise ValueError(f"sample(prioritized=True) from {where}: priorities are off; call enable_priorities() first")
        if acquire is not None and int(reply[6] if len(reply) > 6 else reply[-1]) == 1:  # (lim: {1, ..., lim, cursor} or {-1, lim})
            waited, acquire = acquire(), None
            in_flight = _rate.in_flight_pauses()
            if waited or status < 0:
                continue  # (held back a while, or drawn before the limiter agreed: draw again)
        if status < 0:
            if in_flight is not None and next(in_flight, False) is None:
                continue  # the rows the limiter counted are not written yet
            raise ValueError(f"sample(prioritized=True) from {where}: no row with a priority to draw (extend() first)")
        got = torch.tensor([int(r) for r in reply[1]], dtype=torch.int64)
        k = got.numel()
        try:
            drawn = _parse_settings(reply[5], where)
            vals = _draw_values(reply[2], drawn.encoding, k)
            # (the least over the rounds: every row drawn is worth at least it, its weight at most 1)
            p_min = min(p_min, float(reply[4]))
            beta = drawn.beta
        except ValueError as err:
            raise CorruptMetadataError(f"sample(prioritized=True) from {where}: the server's draw is damaged: {err}") from err
        rows.append(got)
        values.append(vals)
        gens.append(_gens(reply[3], k, where))
        at = _draw_cursor(reply, keys)
        known = known and at is not None
        if at is not None:
            cursor = at if cursor is None else min(cursor, at)
        need -= k
        if need == 0:
            return _Drawn(torch.cat(rows), torch.cat(values), torch.cat(gens), p_min, beta, cursor if known else None)
    raise StaleLayoutError(
        f"sample(prioritized=True) from {where}: kept drawing rows not written yet ({need} of {n} after "
        f"{_REDRAWS} draws); appends may be failing between their two steps"
    )


def _draw_values(blob: bytes | bytearray | memoryview, encoding: str, count: int) -> torch.Tensor:
    """The p of the ``count`` rows of a draw's reply: little-endian doubles on a tree of
    doubles (``encoding`` "f64"), else their text joined by spaces. ValueError: damaged."""
    raw = bytes(blob)
    if encoding == "f64":
        if len(raw) != 8 * count:
            raise ValueError(f"{len(raw)} bytes of values for {count} rows")
        out = torch.from_numpy(np.frombuffer(raw, dtype="<f8").astype(np.float64))
    else:
        out = torch.tensor([float(v) for v in raw.split()], dtype=torch.float64)
        if out.numel() != count:
            raise ValueError(f"{out.numel()} values for {count} rows")
    if not bool(((out >= 0) & (out <= _P_MAX)).all()):
        raise ValueError("a value that is not a finite number >= 0")
    return out


def _draw_cursor(reply: Sequence[object], keys: StoreKeys) -> int | None:
    """The ring cursor a draw read (its reply's 8th item), or None where the reply has none
    (or it does not parse: the sample then checks its rows by their generations)."""
    if len(reply) < 8:
        return None
    try:
        return _append.parse_cursor(reply[7] or None, keys)
    except CorruptMetadataError:
        return None


def _snapshot_check(keys: StoreKeys, d: _Drawn, seen: list[list[object]], capacity: int) -> torch.Tensor | None:
    """Which drawn rows the snapshot of the read (``draw_check_prefix``'s replies) shows as not
    to be returned: reached by a reservation from the draw to the cursor read after the rows,
    or not flagged as written. None
    where the snapshot cannot tell (no snapshot, the cursor went back, a damaged reply, or no
    drawn row flagged, as where the flags are gone): the caller then checks the rows'
    generations and flags in a step of their own (``lua/prio_check.lua``)."""
    if not seen or d.cursor is None:
        return None
    try:
        _cursor, _limited, flags, after = _append.parse_draw_check(keys, seen[-1])
        moved = _append.reserved_since(d.rows, d.cursor, _append.parse_cursor(after, keys), capacity)
    except CorruptMetadataError:
        return None
    if moved is None:
        return None
    flagged = _append.rows_flagged(flags, d.rows, capacity)
    if flagged is None:
        return None
    if not bool(flagged.any()):
        return None
    return moved | ~flagged


def _weights(values: torch.Tensor, p_min: float, beta: float) -> torch.Tensor:
    """TorchRL's importance weights: ``(p / min(p)) ** -beta``, as float32."""
    if not 0 < p_min < math.inf:
        return torch.ones_like(values, dtype=torch.float32)
    return torch.pow(values / p_min, -beta).to(torch.float32)


def draw(store: TensorDictStore, n: int, *, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """``n`` rows drawn by priority, without reading them: ``{"index", "_weight", "generation"}``.

    The rows were flagged as written when drawn; their bytes are not read, so nothing says
    they still hold that generation (:func:`sample` checks it)."""
    _check_n(store, n)
    d = _draw(store, int(n), generator)
    return {"index": d.rows, "_weight": _weights(d.values, d.p_min, d.beta), "generation": d.gens}


def generations(store: TensorDictStore, rows: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """The generation each of ``rows`` holds now (0: not appended since priorities were
    enabled), read in one snapshot; runs of consecutive rows are read as one range."""
    s = settings(store)
    if s is None:
        raise ValueError(f"{store._where()}: priorities are off (enable_priorities first)")
    flat = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
    if not flat.numel():
        return torch.zeros(0, dtype=torch.long)
    if int(flat.min()) < 0 or int(flat.max()) >= s.capacity:
        raise IndexError(f"{store._where()}: rows out of range [0, {s.capacity})")
    order = torch.unique(flat)
    breaks = torch.nonzero(order[1:] != order[:-1] + 1).reshape(-1) + 1
    bounds = [0, *breaks.tolist(), order.numel()]
    runs = [(int(order[a]), b - a) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    conn = store._conn
    blobs = cast("list[Any]", conn.run(lambda c: _io.read_generations(c, conn.keys, runs, _GW)))
    where = store._where()
    found = torch.cat([_gens(blob, count, where) for blob, (_first, count) in zip(blobs, runs, strict=True)])
    return found[torch.searchsorted(order, flat)]


def _check_n(store: TensorDictStore, n: Any) -> None:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"sample() from {store._where()}: n must be an int >= 1, got {n!r}")


def sample(
    store: TensorDictStore, n: int, *, generator: torch.Generator | None = None
) -> tuple[TensorDictBase, dict[str, torch.Tensor]]:
    """:meth:`TensorDictStore.sample` with ``prioritized=True``: ``(batch, info)``."""
    _check_n(store, n)
    n = int(n)
    conn = store._conn
    keys = conn.keys
    where = store._where()
    index = torch.empty(n, dtype=torch.int64)
    gens = torch.empty(n, dtype=torch.int64)
    values = torch.empty(n, dtype=torch.float64)
    todo = torch.arange(n)
    parts: list[tuple[torch.Tensor, Any]] = []
    p_min, beta = math.inf, 0.0
    capacity = _capacity(store, "sample()")
    acquire: Callable[[], bool] | None = lambda: _rate.acquire_samples(store, n, capacity)  # noqa: E731
    for _ in range(_REDRAWS):
        d, acquire = _draw(store, todo.numel(), generator, acquire), None  # (a sample counts once)
        p_min, beta = min(p_min, d.p_min), d.beta
        # the rows, with the cursor and their flags read just before them (in one snapshot,
        # or between two MULTIs that show no write but appends meanwhile) and the cursor
        # after them: a row no reservation reached from the draw to that cursor still holds
        # the generation drawn (appends move it), so no check step; and it is flagged still,
        # unless the read went to a promoted replica that lacks the write which flagged it
        # (its bytes there are not that row's): such a row is drawn again
        seen: list[list[object]] = []
        prefix = _append.draw_check_prefix(keys, capacity, d.rows) if d.cursor is not None else ()
        bracket = _append.draw_check_bracket(keys) if d.cursor is not None else None
        batch = store._read_index(d.rows, prefix=prefix, sink=seen.append, bracket=bracket)
        moved = _snapshot_check(keys, d, seen, capacity)
        if moved is not None:
            ok = ~moved
        else:  # (the cursor went back, or the read went another way: check the rows' generations)
            rows = d.rows.tolist()
            gen_blob, flags = cast("list[Any]", conn.script("prio_check", [keys.flags, keys.prio_gens, keys.ring], list(map(str, rows))))
            try:
                now = _gens(gen_blob, len(rows), where)
            except CorruptMetadataError:
                now = torch.full((len(rows),), -1, dtype=torch.int64)  # (the tree went: drawn again, or refused)
            ok = (now == d.gens) & (torch.frombuffer(bytearray(flags), dtype=torch.uint8) == ord("1"))
        positions = todo[ok]
        index[positions], gens[positions], values[positions] = d.rows[ok], d.gens[ok], d.values[ok]
        parts.append((positions, batch if bool(ok.all()) else batch[ok]))
        todo = todo[~ok]
        if todo.numel() == 0:
            break
    else:
        raise StaleLayoutError(
            f"sample(prioritized=True) from {where}: the rows drawn kept being appended to before they were read "
            f"({todo.numel()} of {n} after {_REDRAWS} draws)"
        )
    if len(parts) == 1:
        out = parts[0][1]
    else:
        order = torch.cat([p for p, _ in parts])
        out = torch.cat([b for _, b in parts])[torch.argsort(order)]
    return out, {"index": index, "_weight": _weights(values, p_min, beta), "generation": gens}


# --------------------------------------------------------------------------- #
# updates
# --------------------------------------------------------------------------- #


def update(store: TensorDictStore, index: Any, priority: Any, generation: Any = None) -> torch.Tensor:
    """:meth:`TensorDictStore.update_priority` (its documentation is there)."""
    what = f"update_priority() on {store._where()}"
    capacity = _capacity(store, "update_priority()")
    idx = torch.as_tensor(index)
    if idx.dtype == torch.bool or idx.is_floating_point() or idx.is_complex():
        raise ValueError(f"{what}: index must hold integers, got dtype {idx.dtype}")
    idx = idx.reshape(-1).to(torch.int64)
    pri = torch.as_tensor(priority)
    if pri.is_complex() or pri.dtype == torch.bool:
        raise ValueError(f"{what}: priority must hold real numbers, got dtype {pri.dtype}")
    pri = pri.detach().reshape(-1).to(torch.float64).cpu()
    if pri.numel() == 1 and idx.numel() != 1:
        pri = pri.expand(idx.numel())
    if pri.numel() != idx.numel():
        raise ValueError(f"{what}: {idx.numel()} rows and {pri.numel()} priorities; give one priority per row (or one for all)")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= capacity):
        bad = idx[(idx < 0) | (idx >= capacity)][0].item()
        raise ValueError(f"{what}: row {bad} is out of the ring's range 0 to {capacity - 1}")
    if not bool(torch.isfinite(pri).all()) or bool((pri < 0).any()):
        bad_p = pri[~torch.isfinite(pri) | (pri < 0)][0].item()
        raise ValueError(f"{what}: priorities must be finite and >= 0, got {bad_p}")
    gen_arg = ""
    if generation is not None:
        gen = torch.as_tensor(generation)
        if gen.dtype == torch.bool or gen.is_floating_point() or gen.is_complex():
            raise ValueError(f"{what}: generation must hold integers, got dtype {gen.dtype}")
        gen = gen.reshape(-1).to(torch.int64)
        if gen.numel() != idx.numel():
            raise ValueError(f"{what}: {idx.numel()} rows and {gen.numel()} generations; give one generation per row")
        if gen.numel() and int(gen.min()) < 0:
            raise ValueError(f"{what}: generations are counts >= 0, got {int(gen.min())}")
    if idx.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    conn = store._conn
    keys = conn.keys
    args: list[str | bytes]
    if conn.lua_has_struct:  # (doubles and fixed-width generations: a quarter of the text's parse)
        gen_f64 = b""
        if generation is not None:
            if gen.numel() and int(gen.max()) >= 10**_GW:
                raise ValueError(f"{what}: generations are counts below 10**{_GW}, got {int(gen.max())}")
            gen_f64 = (f"%0{_GW}d" * gen.numel() % tuple(gen.tolist())).encode()
        args = [idx.to(torch.float64).numpy().astype("<f8").tobytes(), pri.numpy().astype("<f8").tobytes(), gen_f64, "f64"]
    else:
        gen_arg = " ".join(map(str, gen.tolist())) if generation is not None else ""
        args = [" ".join(map(str, idx.tolist())), " ".join(map(repr, pri.tolist())), gen_arg]
    try:
        reply = cast("list[Any]", conn.script("prio_update", [keys.meta, keys.ring, *keys.replay_keys()], args))
    except StoreNotFoundError:
        raise store._not_found() from None
    status = int(reply[0])
    if status == 0:
        raise ValueError(f"{what}: priorities are off; call enable_priorities() first")
    if status < 0:
        why = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
        raise ValueError(f"{what}: {why}; nothing was changed")
    return torch.frombuffer(bytearray(reply[1]), dtype=torch.uint8) == ord("1")


# --------------------------------------------------------------------------- #
# the checker
# --------------------------------------------------------------------------- #


def _values(blob: bytes, encoding: str, what: str) -> np.ndarray:
    width = _PW[encoding]
    if len(blob) % width:
        raise CorruptMetadataError(f"{what} is {len(blob)} bytes, not a multiple of {width}")
    if encoding == "f64":
        return np.frombuffer(blob, dtype="<f8").astype(np.float64)
    try:
        return np.frombuffer(blob, dtype=f"S{width}").astype(np.float64)
    except ValueError as err:
        raise CorruptMetadataError(f"{what} holds text that is not numbers: {err}") from err


def tree_problems(s: PrioritySettings, leaves_b: bytes, tree_b: bytes, rel: float = 1e-9) -> tuple[np.ndarray, list[str]]:
    """The leaves of a tree's raw strings, and what is wrong with it (empty: consistent):
    every inner node must equal the sum of its children (to ``rel``) and hold their least
    positive value (lua/lib/prio.lua)."""
    problems: list[str] = []
    leaves = _values(leaves_b, s.encoding, "the leaves")
    if leaves.size != s.capacity:
        return leaves, [f"{leaves.size} leaves for {s.capacity} rows"]
    sizes = [s.capacity]
    while sizes[-1] > 1 or len(sizes) == 1:
        sizes.append(-(-sizes[-1] // s.arity))
    inner = _values(tree_b, s.encoding, "the inner levels").reshape(-1, 2) if tree_b else np.zeros((0, 2))
    if inner.shape[0] != sum(sizes[1:]):
        return leaves, [f"{inner.shape[0]} inner nodes, expected {sum(sizes[1:])}"]
    offsets: dict[int, int] = {}  # (the inner levels lie root first)
    off = 0
    for level in range(len(sizes) - 1, 0, -1):
        offsets[level] = off
        off += sizes[level]
    below_sum, below_min = leaves, np.where(leaves > 0, leaves, 0.0)
    for level in range(1, len(sizes)):
        nodes = inner[offsets[level] : offsets[level] + sizes[level]]
        for j in range(sizes[level]):
            kids_s = below_sum[j * s.arity : (j + 1) * s.arity]
            kids_m = below_min[j * s.arity : (j + 1) * s.arity]
            want_s = float(sum(kids_s.tolist()))
            pos = kids_m[kids_m > 0]
            want_m = float(pos.min()) if pos.size else 0.0
            if not math.isclose(nodes[j, 0], want_s, rel_tol=rel, abs_tol=1e-300):
                problems.append(f"level {level} node {j}: sum {nodes[j, 0]!r}, children sum to {want_s!r}")
            if not math.isclose(nodes[j, 1], want_m, rel_tol=rel, abs_tol=1e-300):
                problems.append(f"level {level} node {j}: min {nodes[j, 1]!r}, children's least {want_m!r}")
        below_sum, below_min = nodes[:, 0], nodes[:, 1]
    return leaves, problems[:20]


def tree_report(store: TensorDictStore, rel: float = 1e-9) -> dict[str, Any] | None:
    """The tree read in one snapshot and checked (:func:`tree_problems`); for tests and diagnosis.

    Returns ``{"settings", "leaves" (float64 array), "gens" (int64 tensor, or None when
    damaged), "max" (float, or None when no priority was given yet), "flags" (bytes or
    None), "problems" (list of str: empty when consistent)}``; None when priorities are off."""
    conn = store._conn
    raw, leaves_b, tree_b, gens_b, max_b, flags, _cursor = cast("list[Any]", conn.run(lambda c: _io.read_tree(c, conn.keys)))
    if raw is None:
        return None
    where = store._where()
    s = _parse_settings(raw, where)
    leaves, problems = tree_problems(s, bytes(leaves_b or b""), bytes(tree_b or b""), rel)
    gens = _gens(gens_b, s.capacity, where) if gens_b and len(gens_b) == s.capacity * _GW else None
    if gens is None:
        problems.append("the generations are not one 16-digit count per row")
    text = bytes(max_b or b"").strip()
    return {"settings": s, "leaves": leaves, "gens": gens, "max": float(text) if text else None, "flags": flags, "problems": problems}


def mass(store: TensorDictStore) -> tuple[PrioritySettings, float, float] | None:
    """``(settings, sum of p, least positive p)`` of the store's tree, read in one snapshot
    (its root node); None when priorities are off. A sharded buffer weighs its shards by it."""
    conn = store._conn
    raw, root = cast("list[Any]", conn.run(lambda c: _io.read_root(c, conn.keys)))
    if raw is None:
        return None
    where = store._where()
    s = _parse_settings(raw, where)
    try:
        blob = bytes(root or b"")
        if s.encoding == "f64":
            if len(blob) < 16:
                raise ValueError("short")
            total, least = (float(v) for v in np.frombuffer(blob[:16], dtype="<f8"))
        else:
            total, least = (float(v) for v in blob[:46].split())
    except ValueError:
        raise CorruptMetadataError(f"the priority tree of {where} is damaged: its root is {root!r:.100}") from None
    if not (math.isfinite(total) and total >= 0 and math.isfinite(least) and least >= 0):
        raise CorruptMetadataError(f"the priority tree of {where} is damaged: its root is {root!r:.100}")
    return s, total, least
