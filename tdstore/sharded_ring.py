"""The ring buffer of a :class:`~tdstore.ShardedStore`: a replay buffer across cluster masters.

Block ``i`` of a sharded buffer is shard ``i``: a :class:`~tdstore.TensorDictStore` with a
hash tag of its own, so the shards spread over a Redis Cluster's masters, and each shard has
the atomic ring of a single store (``tdstore/store/ring.py``). This collaborator makes the
shards one buffer:

* ``extend(td)`` appends all of ``td`` to one shard, one atomic step of that shard, and
  returns the rows' indices in the whole buffer's numbering (``index // block_rows`` is the
  shard). A handle takes the shards in turn, starting at a per-process random offset so that
  writers spread; ``shard=`` (per call) or ``pin_shard=`` (per handle) pins one.
* ``sample(n)`` first decides how many rows each shard gives: a multinomial draw weighed by
  the shards' valid rows (their ring states read in one parallel round), or, prioritized, by
  their priority mass (the roots of their trees). The shards are then sampled in parallel and
  the rows shuffled together, so each row of the batch is a draw from the union: uniform over
  all valid rows, or in proportion to ``p`` over all rows. The importance weights are those
  of the union, ``(p / min p over all shards) ** -beta``.
* A shard that cannot be reached fails the sample with
  :class:`~tdstore.errors.ShardUnavailableError` (naming the shard, its td_id and its node);
  ``skip_unavailable=True`` draws all ``n`` rows from the reachable shards instead. A short
  batch is never returned.
"""

from __future__ import annotations

import math
import numbers
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import redis.exceptions
import torch
from tensordict import TensorDictBase

from tdstore.errors import ServerUnavailableError, ShardUnavailableError, clause
from tdstore.replay import priorities as _priorities
from tdstore.store import ring as _ring

if TYPE_CHECKING:
    from tdstore.store import TensorDictStore
    from tdstore.store.ring import RingState

__all__ = ["ShardedRing", "ShardedRingState"]

T = TypeVar("T")

#: What a shard whose master is down raises (after the store's retry policy gave up).
_UNREACHABLE = (
    ServerUnavailableError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    OSError,
)


@dataclass(frozen=True)
class ShardedRingState:
    """The ring counters of every shard, read in one parallel round, and their sums."""

    valid: int  #: valid rows of all shards (each shard's rows flagged as written)
    total: int  #: rows ever appended, all shards together
    capacity: int  #: rows of the whole buffer
    shards: tuple[RingState, ...]  #: each shard's :class:`~tdstore.store.ring.RingState`


class _Failed:
    """A shard's call that raised: kept so that the caller decides (raise or skip)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class ShardedRing:
    """The ring over the shards of one :class:`~tdstore.ShardedStore` handle (see the module docstring)."""

    def __init__(
        self,
        shards: Sequence[TensorDictStore],
        block_rows: int,
        where: Callable[[], str],
        pool: Callable[[], ThreadPoolExecutor],
        pin_shard: int | None = None,
    ) -> None:
        self._shards = tuple(shards)
        self._block_rows = int(block_rows)
        self._where = where
        self._pool = pool
        self._pin = self._check_shard(pin_shard, "pin_shard") if pin_shard is not None else None
        self._lock = threading.Lock()
        # (a per-process start, so that writers that all start now do not all fill shard 0 first)
        self._next = (os.getpid() + int.from_bytes(os.urandom(4), "little")) % len(self._shards)

    # ------------------------------------------------------------------ helpers
    def _check_shard(self, shard: object, name: str) -> int:
        if (
            isinstance(shard, bool)
            or not isinstance(shard, numbers.Integral)
            or not 0 <= int(shard) < len(self._shards)
        ):
            raise ValueError(
                f"{name} of {self._where()} must be a shard number from 0 to {len(self._shards) - 1}, got {shard!r}"
            )
        return int(shard)

    @property
    def pin_shard(self) -> int | None:
        return self._pin

    @pin_shard.setter
    def pin_shard(self, shard: int | None) -> None:
        self._pin = self._check_shard(shard, "pin_shard") if shard is not None else None

    def _unavailable(self, shard: int, error: BaseException) -> ShardUnavailableError:
        store = self._shards[shard]
        return ShardUnavailableError(
            f"shard {shard} (td_id {store.td_id!r}) of {self._where()} could not be reached on "
            f"{store._conn.describe()}: {clause(error)}. Nothing was returned (sample(n, skip_unavailable=True) "
            "draws from the reachable shards only)"
        )

    def _all(self, fn: Callable[[int], T], shards: Sequence[int]) -> list[T | _Failed]:
        """``fn(shard)`` for every shard at once (the block thread pool); a shard that cannot be
        reached gives a :class:`_Failed`, any other error is raised."""

        def call(shard: int) -> T | _Failed:
            try:
                return fn(shard)
            except redis.exceptions.ResponseError as err:
                if isinstance(err, redis.exceptions.ClusterDownError) or str(err).startswith("CLUSTERDOWN"):
                    return _Failed(err)
                raise
            except _UNREACHABLE as err:
                return _Failed(err)

        if len(shards) == 1:
            return [call(shards[0])]
        return list(self._pool().map(call, shards))

    # ------------------------------------------------------------------ appends
    def extend(self, td: TensorDictBase, shard: int | None = None) -> torch.Tensor:
        """Appends ``td`` to one shard (one atomic step); its rows' indices in the whole buffer."""
        if shard is not None:
            target = self._check_shard(shard, "shard")
        elif self._pin is not None:
            target = self._pin
        else:
            with self._lock:
                target = self._next
                self._next = (self._next + 1) % len(self._shards)
        local = self._shards[target].extend(td)
        return local + target * self._block_rows

    # ------------------------------------------------------------------ ring state
    def ring_state(self) -> ShardedRingState:
        """Every shard's ring state, read in one parallel round."""
        got = self._all(lambda i: self._shards[i].ring_state(), range(len(self._shards)))
        states = []
        for shard, state in enumerate(got):
            if isinstance(state, _Failed):
                raise self._unavailable(shard, state.error) from state.error
            states.append(state)
        return ShardedRingState(
            valid=sum(s.valid for s in states),
            total=sum(s.total for s in states),
            capacity=sum(s.capacity for s in states),
            shards=tuple(states),
        )

    # ------------------------------------------------------------------ sampling
    def sample(
        self,
        n: int,
        *,
        generator: torch.Generator | None = None,
        prioritized: bool = False,
        return_info: bool = False,
        skip_unavailable: bool = False,
        drawn_first: bool = True,
    ) -> TensorDictBase | tuple[TensorDictBase, dict[str, torch.Tensor]]:
        """``n`` rows drawn (with replacement) from the union of the shards: see the module docstring.

        ``drawn_first``: where every shard is known full, try :meth:`_sample_drawn_first` first."""
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"sample() from {self._where()}: n must be an int >= 1, got {n!r}")
        n = int(n)
        if drawn_first and not prioritized and all(s._conn.ring_full for s in self._shards):
            fast = self._sample_drawn_first(n, generator, skip_unavailable)
            if fast is not None:
                batch, index = fast
                return (batch, {"index": index}) if return_info else batch
        what = "sample(prioritized=True)" if prioritized else "sample()"
        everyone = list(range(len(self._shards)))
        # 1. the weight of each shard: its valid rows, or its priority mass (one parallel round)
        weights = torch.zeros(len(self._shards), dtype=torch.float64)
        least = torch.full((len(self._shards),), math.inf, dtype=torch.float64)
        beta = 0.0
        reachable: list[int] = []
        flags: dict[int, _ring.Flags] = {}
        if prioritized:
            masses = self._all(lambda i: _priorities.mass(self._shards[i]), everyone)
            for shard, got in enumerate(masses):
                if isinstance(got, _Failed):
                    if not skip_unavailable:
                        raise self._unavailable(shard, got.error) from got.error
                    continue
                if got is None:
                    raise ValueError(
                        f"{what} from {self._where()}: priorities are off on shard {shard} "
                        f"(td_id {self._shards[shard].td_id!r}); call enable_priorities() first"
                    )
                settings, total, low = got
                beta = settings.beta
                weights[shard] = total
                if low > 0:
                    least[shard] = low
                reachable.append(shard)
        else:
            # each shard's flags: its weight (the rows flagged as written), and then its draw,
            # so that a shard costs its master the one flags read of a plain store's sample
            reads = self._all(lambda i: _ring.read_flags(self._shards[i]), everyone)
            for shard, read in enumerate(reads):
                if isinstance(read, _Failed):
                    if not skip_unavailable:
                        raise self._unavailable(shard, read.error) from read.error
                    continue
                weights[shard] = float(_ring.written_count(self._shards[shard], read))
                flags[shard] = read
                reachable.append(shard)
        if not reachable:
            raise ShardUnavailableError(
                f"{what} from {self._where()}: none of its {len(self._shards)} shards could be reached"
            )
        # per-shard generators drawn from the caller's: reproducible, and no generator shared by threads
        seeds = torch.randint(0, 2**62, (len(self._shards),), generator=generator).tolist()

        # 2. how many rows each shard gives; 3. the shards sampled in parallel (a shard that
        # fails here, under skip_unavailable, has its rows drawn again among the others)
        parts: dict[int, tuple[TensorDictBase, dict[str, torch.Tensor]]] = {}
        need = n
        for _ in range(len(self._shards) + 1):
            live = torch.zeros_like(weights)
            live[reachable] = weights[reachable]
            if float(live.sum()) <= 0:
                raise ValueError(
                    f"{what} from {self._where()}: no row "
                    + ("has a priority to draw" if prioritized else "was appended yet")
                    + (" in the reachable shards" if len(reachable) < len(self._shards) else "")
                    + " (extend() first)"
                )
            counts = torch.bincount(
                torch.multinomial(live, need, replacement=True, generator=generator), minlength=len(self._shards)
            )
            asked = [s for s in reachable if int(counts[s]) > 0]

            def draw(shard: int, counts: torch.Tensor = counts) -> tuple[TensorDictBase, dict[str, torch.Tensor]]:
                gen = torch.Generator().manual_seed(int(seeds[shard]) + len(parts))
                store = self._shards[shard]
                if prioritized:
                    got = store.sample(int(counts[shard]), generator=gen, prioritized=True, return_info=True)
                    return got  # type: ignore[no-any-return]
                # (as store.sample() draws, from the flags read above: the same rows, one read fewer;
                # read with their flags, a row no longer flagged drawn again)
                batch, idx = _ring.read_written(store, int(counts[shard]), gen, flags[shard])
                return batch, {"index": idx}

            results = self._all(draw, asked)
            need = 0
            for shard, got in zip(asked, results, strict=True):
                if isinstance(got, _Failed):
                    if not skip_unavailable:
                        raise self._unavailable(shard, got.error) from got.error
                    reachable.remove(shard)
                    need += int(counts[shard])
                    continue
                if shard in parts:  # (a second round: rows taken over from a shard that failed)
                    old_batch, old_info = parts[shard]
                    got = (
                        torch.cat([old_batch, got[0]]),
                        {k: torch.cat([old_info[k], v]) for k, v in got[1].items()},
                    )
                parts[shard] = got
            if need == 0:
                break
            if not reachable:
                raise ShardUnavailableError(
                    f"{what} from {self._where()}: every shard asked for rows failed; none of its shards can be reached"
                )
        else:  # pragma: no cover - each round drops a shard, so the loop ends before
            raise ShardUnavailableError(f"{what} from {self._where()}: shards kept failing")

        # 4. one batch: global indices, the union's weights, the rows shuffled together
        order = sorted(parts)
        batch = torch.cat([parts[s][0] for s in order])
        index = torch.cat([parts[s][1]["index"] + s * self._block_rows for s in order])
        info: dict[str, torch.Tensor] = {"index": index}
        if prioritized:
            p_min = float(least[reachable].min()) if reachable else math.inf
            weight_parts = []
            for s in order:
                w = parts[s][1]["_weight"].to(torch.float64)
                # a shard's weights are (p / its least p) ** -beta; the union's divide by the least of all
                if math.isfinite(p_min) and math.isfinite(float(least[s])) and p_min > 0:
                    w = w * (float(least[s]) / p_min) ** -beta
                weight_parts.append(w)
            info["_weight"] = torch.cat(weight_parts).to(torch.float32)
            info["generation"] = torch.cat([parts[s][1]["generation"] for s in order])
        shuffle = torch.randperm(n, generator=generator)
        batch = batch[shuffle]
        info = {k: v[shuffle] for k, v in info.items()}
        return (batch, info) if return_info else batch

    def _sample_drawn_first(
        self, n: int, generator: torch.Generator | None, skip_unavailable: bool
    ) -> tuple[TensorDictBase, torch.Tensor] | None:
        """A uniform sample of the union of full shards, one server step per shard: the rows
        are drawn among all rows of all shards (a shard in proportion to its capacity), each
        shard's read in one snapshot with its flags (:func:`~tdstore.store.ring.read_drawn`),
        and the rows found not written are drawn again from the union by the general path
        (rejection: every row of the batch is uniform over the written rows of all shards).
        None when a shard's snapshot shows it not full or rate-limited, or (skipping) one
        failed: the general path then samples."""
        caps = torch.tensor([float(s.batch_size[0]) for s in self._shards], dtype=torch.float64)
        counts = torch.bincount(
            torch.multinomial(caps, n, replacement=True, generator=generator), minlength=len(self._shards)
        ).tolist()
        asked = [s for s, c in enumerate(counts) if c > 0]
        rows = {s: torch.randint(0, int(caps[s]), (counts[s],), generator=generator) for s in asked}
        got = self._all(lambda s: _ring.read_drawn(self._shards[s], rows[s]), asked)
        batches: list[TensorDictBase] = []
        index: list[torch.Tensor] = []
        rejected = 0
        for shard, part in zip(asked, got, strict=True):
            if isinstance(part, _Failed):
                if not skip_unavailable:
                    raise self._unavailable(shard, part.error) from part.error
                return None
            if part is None:
                return None
            batch, idx, ok = part
            keep = ok.nonzero().flatten()
            batches.append(batch if keep.numel() == ok.numel() else batch[keep])
            index.append(idx[keep] + shard * self._block_rows)
            rejected += ok.numel() - keep.numel()
        if rejected:
            extra, info = self.sample(
                rejected, generator=generator, return_info=True, skip_unavailable=skip_unavailable, drawn_first=False
            )  # type: ignore[misc]
            batches.append(extra)
            index.append(info["index"])
        shuffle = torch.randperm(n, generator=generator)
        return torch.cat(batches)[shuffle], torch.cat(index)[shuffle]

    # ------------------------------------------------------------------ priorities
    def enable_priorities(self, alpha: float, beta: float, eps: float, arity: int) -> None:
        """``enable_priorities`` on every shard (the first alone: bad settings reach no shard)."""
        first, *rest = range(len(self._shards))
        self._shards[first].enable_priorities(alpha, beta, eps, arity=arity)
        if rest:
            list(self._pool().map(lambda i: self._shards[i].enable_priorities(alpha, beta, eps, arity=arity), rest))

    def disable_priorities(self) -> bool:
        return any(list(self._pool().map(lambda s: s.disable_priorities(), self._shards)))

    def update_priority(
        self,
        index: torch.Tensor | Sequence[int],
        priority: torch.Tensor | Sequence[float] | float,
        generation: torch.Tensor | Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Routes each row's update to its shard (one step per shard, in parallel); which were applied.

        Every argument is checked before any shard is sent anything."""
        what = f"update_priority() on {self._where()}"
        idx = torch.as_tensor(index)
        if idx.dtype == torch.bool or idx.is_floating_point() or idx.is_complex():
            raise ValueError(f"{what}: index must hold integers, got dtype {idx.dtype}")
        idx = idx.reshape(-1).to(torch.int64)
        rows = sum(int(s.batch_size[0]) for s in self._shards)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= rows):
            bad = idx[(idx < 0) | (idx >= rows)][0].item()
            raise ValueError(f"{what}: row {bad} is out of the buffer's range 0 to {rows - 1}; nothing was changed")
        pri = torch.as_tensor(priority)
        if pri.is_complex() or pri.dtype == torch.bool:
            raise ValueError(f"{what}: priority must hold real numbers, got dtype {pri.dtype}")
        pri = pri.detach().reshape(-1).to(torch.float64).cpu()
        if pri.numel() == 1 and idx.numel() != 1:
            pri = pri.expand(idx.numel())
        if pri.numel() != idx.numel():
            raise ValueError(
                f"{what}: {idx.numel()} rows and {pri.numel()} priorities; give one priority per row (or one for all)"
            )
        if not bool(torch.isfinite(pri).all()) or bool((pri < 0).any()):
            bad_p = pri[~torch.isfinite(pri) | (pri < 0)][0].item()
            raise ValueError(f"{what}: priorities must be finite and >= 0, got {bad_p}; nothing was changed")
        gen: torch.Tensor | None = None
        if generation is not None:
            gen = torch.as_tensor(generation)
            if gen.dtype == torch.bool or gen.is_floating_point() or gen.is_complex():
                raise ValueError(f"{what}: generation must hold integers, got dtype {gen.dtype}")
            gen = gen.reshape(-1).to(torch.int64)
            if gen.numel() != idx.numel():
                raise ValueError(
                    f"{what}: {idx.numel()} rows and {gen.numel()} generations; give one generation per row"
                )
            if gen.numel() and int(gen.min()) < 0:
                raise ValueError(f"{what}: generations are counts >= 0, got {int(gen.min())}")
        applied = torch.zeros(idx.numel(), dtype=torch.bool)
        if idx.numel() == 0:
            return applied
        shard_of = torch.div(idx, self._block_rows, rounding_mode="floor")
        targets = torch.unique(shard_of).tolist()

        def send(shard: int) -> tuple[torch.Tensor, torch.Tensor]:
            pos = (shard_of == shard).nonzero().squeeze(1)
            local = idx[pos] - shard * self._block_rows
            done = self._shards[shard].update_priority(local, pri[pos], None if gen is None else gen[pos])
            return pos, done

        results = self._all(send, targets)
        for shard, got in zip(targets, results, strict=True):
            if isinstance(got, _Failed):
                raise self._unavailable(shard, got.error) from got.error
            pos, done = got
            applied[pos] = done
        return applied
