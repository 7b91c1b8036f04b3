"""Workers of tests/test_append_steps.py (importable by spawned processes).

Every appended row carries its writer: ``tag = (proc, seq, i)`` and ``obs`` filled with
``proc * 1000 + seq``, with ``proc >= 1`` so that a row never written (all zeros) is told
apart. Every loop is bounded in count and in time.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from tensordict import TensorDict

from tdstore import TensorDictStore


def batch(proc: int, seq: int, rows: int) -> TensorDict:
    tag = torch.tensor([[proc, seq, i] for i in range(rows)], dtype=torch.int64)
    return TensorDict(tag=tag, obs=torch.full((rows, 8), float(proc * 1000 + seq)), batch_size=[rows])


def bad_rows(td: TensorDict) -> tuple[int, int]:
    """(torn rows, rows never written) among rows read: a torn row mixes two appends."""
    tag, obs = td["tag"], td["obs"]
    unwritten = (tag == 0).all(dim=-1) & (obs == 0).all(dim=-1)
    torn = (obs != obs[..., :1]).any(dim=-1) | (obs[..., 0] != (tag[..., 0] * 1000 + tag[..., 1]).to(obs.dtype))
    return int((torn & ~unwritten).sum()), int(unwritten.sum())


def appender(conn: dict[str, Any], td_id: str, sub: tuple[str, ...], proc: int, count: int, rows: int,
             duration: float, cool: int | None = None, pause: float = 0.0) -> list[int]:
    """Appends ``count`` batches of ``rows`` rows into ``store[sub]``; returns the rows it got.

    ``cool``: ``COOL_APPENDS`` (appends that take the two steps after an armed one was
    aborted); ``pause``: a random pause of up to that many seconds after each append. Both
    make appends go armed (one packet) as well as in two steps, and armed ones get aborted.
    """
    import random

    from tdstore._backend import append as _append

    if cool is not None:
        _append.COOL_APPENDS = cool
    rng = random.Random(proc)
    store = TensorDictStore.from_store(td_id=td_id, **conn)
    target = store[sub] if sub else store
    end = time.time() + duration
    out: list[int] = []
    for seq in range(count):
        if time.time() > end:
            break
        out.extend(target.extend(batch(proc, seq, rows)).tolist())
        if pause:
            time.sleep(rng.uniform(0, pause))
    store.close()
    return out


def sampler(conn: dict[str, Any], td_id: str, n: int, rounds: int, duration: float, dead: int) -> tuple[int, int, int, int]:
    """Samples until ``rounds`` or ``duration``: (rows sampled, torn, never written, rows of the killed appender ``dead``)."""
    store = TensorDictStore.from_store(td_id=td_id, **conn)
    end = time.time() + duration
    sampled = torn = unwritten = of_dead = 0
    for _ in range(rounds):
        if time.time() > end:
            break
        try:
            td = store.sample(n)
        except ValueError:  # nothing appended yet
            time.sleep(0.001)
            continue
        t, u = bad_rows(td)
        torn, unwritten = torn + t, unwritten + u
        of_dead += int((td["tag"][:, 0] == dead).sum())
        sampled += n
    store.close()
    return sampled, torn, unwritten, of_dead


def stuck_appender(conn: dict[str, Any], td_id: str, proc: int, reserved: Any) -> None:
    """Appends once, but stops for good between the reserve and the write (the test kills it there)."""
    from tdstore._backend import append as _append

    def hang(self: Any, start: int, exp: str) -> Any:
        reserved.set()
        time.sleep(120)
        raise RuntimeError("not killed")

    _append.AppendPlan.write_commands = hang  # type: ignore[method-assign]
    store = TensorDictStore.from_store(td_id=td_id, **conn)
    store.extend(batch(proc, 0, 3))


def layout_changer(conn: dict[str, Any], td_id: str, rounds: int, duration: float) -> int:
    """Adds and deletes entries beside the appended ones (each a layout change); returns how many."""
    store = TensorDictStore.from_store(td_id=td_id, **conn)
    cap = store.batch_size[0]
    end = time.time() + duration
    changes = 0
    for i in range(rounds):
        if time.time() > end:
            break
        store["side", f"k{i}"] = torch.zeros(cap, 8)
        changes += 1
        if i > 0:
            del store["side", f"k{i - 1}"]
            changes += 1
    store.close()
    return changes


def cursor_setter(conn: dict[str, Any], td_id: str, rounds: int, duration: float, seed: int) -> int:
    """Sets the ring cursor (as TorchRL's empty() and load_state_dict() do) to random counts
    from 0 to twice the capacity, ``rounds`` times or for ``duration`` seconds; returns how many."""
    import random

    from tdstore._backend import priorities as _backend

    rng = random.Random(seed)
    store = TensorDictStore.from_store(td_id=td_id, **conn)
    conn_ = store._conn
    cap = store.batch_size[0]
    end = time.time() + duration
    done = 0
    for _ in range(rounds):
        if time.time() > end:
            break
        total = rng.choice([0, 0, rng.randint(1, cap // 4), rng.randint(1, cap), rng.randint(cap, 2 * cap)])
        assert conn_.run(lambda c, t=total: _backend.set_ring_total(c, conn_.keys, conn_.runner, t, cap))
        done += 1
        time.sleep(rng.uniform(0.0, 0.003))
    store.close()
    return done


def ring_checker(conn: dict[str, Any], td_id: str, n: int, rounds: int, duration: float) -> tuple[int, int, int, int, int]:
    """Reads ``ring_state()`` and samples until ``rounds`` or ``duration``: (checks, rows
    counted as written past the cursor's rows, rows sampled, torn, never written)."""
    store = TensorDictStore.from_store(td_id=td_id, **conn)
    cap = store.batch_size[0]
    end = time.time() + duration
    checks = over = sampled = torn = unwritten = 0
    for _ in range(rounds):
        if time.time() > end:
            break
        state = store.ring_state()
        checks += 1
        over += max(0, state.valid - min(state.total, cap))
        try:
            td = store.sample(n)
        except ValueError:  # no row counted as written
            continue
        t, u = bad_rows(td)
        torn, unwritten = torn + t, unwritten + u
        sampled += n
    store.close()
    return checks, over, sampled, torn, unwritten
