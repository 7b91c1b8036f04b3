"""Worker functions of the multi-process race tests (importable by spawned processes).

Each worker connects with ``TensorDictStore.from_store``, runs a loop bounded in count
and in time, and returns counts that the test asserts on.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict

from tdstore import TensorDictStore

DTYPES = {1: torch.float32, 2: torch.int16, 3: torch.float64, 4: torch.uint8}


def _open(conn: dict[str, Any], td_id: str, **kwargs: Any) -> TensorDictStore:
    return TensorDictStore.from_store(td_id=td_id, **conn, **kwargs)


def warm_up(seconds: float) -> int:
    """Keeps a pool worker busy so that every worker gets started (and imports torch) up front."""
    time.sleep(seconds)
    return 0


def disjoint_writer(conn: dict[str, Any], td_id: str, proc: int, nproc: int, rounds: int, mode: str, duration: float) -> int:
    deadline = time.time() + duration
    store = _open(conn, td_id)
    n = store.batch_size[0]
    rows = list(range(proc, n, nproc))
    written = 0
    for k in range(1, rounds + 1):
        if time.time() > deadline:
            break
        if mode == "int":
            for r in rows:
                store[r] = TensorDict(x=torch.full((3,), float(k)), y=torch.tensor(k), batch_size=[])
            written += len(rows)
            continue
        if mode == "slice":
            idx: Any = slice(proc, None, nproc)
        elif mode == "list":
            idx = list(rows)
        else:
            mask = torch.zeros(n, dtype=torch.bool)
            mask[rows] = True
            idx = mask
        m = len(rows)
        store[idx] = TensorDict(x=torch.full((m, 3), float(k)), y=torch.full((m,), k), batch_size=[m])
        written += m
    store.close()
    return written


def monotonic_reader(conn: dict[str, Any], td_id: str, duration: float) -> tuple[int, int, int]:
    """Reads every row repeatedly; a row whose value goes down reverted to an older write."""
    store = _open(conn, td_id)
    last = None
    reverts = torn = checked = 0
    end = time.time() + duration
    while time.time() < end and checked < 200_000:
        snap = store[:]
        x, y = snap["x"], snap["y"]
        torn += int(((x != x[:, :1]).any(dim=1) | (x[:, 0] != y.to(x.dtype))).sum())
        if last is not None:
            reverts += int((y < last).sum())
        last = y
        checked += y.numel()
    store.close()
    return checked, reverts, torn


def const_writer(conn: dict[str, Any], td_id: str, proc: int, rounds: int, duration: float) -> int:
    """Writes random, overlapping rows; every element of a row gets the same constant."""
    deadline = time.time() + duration
    store = _open(conn, td_id)
    rng = random.Random(proc)
    n = store.batch_size[0]
    done = 0
    for k in range(rounds):
        if time.time() > deadline:
            break
        rows = rng.sample(range(n), rng.randint(1, 8))
        c = float(proc * 100_000 + k)
        m = len(rows)
        value = TensorDict(
            obs=torch.full((m, 1024), c, dtype=torch.float64), act=torch.full((m, 4), int(c)), batch_size=[m]
        )
        value["tag"] = NonTensorStack(*[f"w{int(c)}" for _ in range(m)])  # a non-tensor entry of the same row
        store[torch.tensor(rows)] = value
        done += 1
    store.close()
    return done


def row_reader(conn: dict[str, Any], td_id: str, duration: float, seed: int) -> tuple[int, int]:
    store = _open(conn, td_id)
    gen = torch.Generator().manual_seed(seed)
    n = store.batch_size[0]
    checked = torn = 0
    end = time.time() + duration
    while time.time() < end and checked < 200_000:
        rows = store[torch.randint(0, n, (32,), generator=gen)]
        obs, act = rows["obs"], rows["act"]
        bad = (obs != obs[:, :1]).any(dim=1) | (act != act[:, :1]).any(dim=1) | (act[:, 0].to(torch.float64) != obs[:, 0])
        tags = rows["tag"]
        bad |= torch.tensor([tag != f"w{int(a)}" for tag, a in zip(tags, act[:, 0].tolist(), strict=True)])
        torn += int(bad.sum())
        checked += 32
    store.close()
    return checked, torn


def replacer(conn: dict[str, Any], td_id: str, rounds: int, duration: float) -> int:
    deadline = time.time() + duration
    store = _open(conn, td_id)
    n = store.batch_size[0]
    done = 0
    for k in range(rounds):
        if time.time() > deadline:
            break
        width = k % 4 + 1
        store["x"] = torch.full((n, width), width, dtype=DTYPES[width])
        done += 1
    store.close()
    return done


def shape_reader(conn: dict[str, Any], td_id: str, duration: float, cache: bool) -> tuple[int, int]:
    store = _open(conn, td_id, cache_metadata=cache)
    checked = wrong = 0
    end = time.time() + duration
    i = 0
    while time.time() < end and checked < 100_000:
        i += 1
        value = store["x"] if i % 2 else store[1:3]["x"]
        width = value.shape[-1]
        if width not in DTYPES or value.dtype != DTYPES[width] or not bool((value == width).all()):
            wrong += 1
        checked += 1
    store.close()
    return checked, wrong


def key_creator(conn: dict[str, Any], td_id: str, proc: int, count: int) -> int:
    store = _open(conn, td_id)
    for j in range(count):
        store[f"p{proc}_{j}"] = torch.full((store.batch_size[0],), proc * 1000 + j)
    store.close()
    return count


def rmw_worker(conn: dict[str, Any], td_id: str, proc: int, count: int) -> int:
    """Increments the "n" sub-store with apply_, += and add_ (read-modify-write)."""
    store = _open(conn, td_id)
    counters = store["n"]
    for j in range(count):
        if (proc + j) % 3 == 0:
            counters.apply_(lambda t: t + 1)
        elif (proc + j) % 3 == 1:
            counters += 1
        else:
            counters.add_(1)
    store.close()
    return count


def blind_writer(conn: dict[str, Any], td_id: str, proc: int, count: int) -> int:
    """Meanwhile runs update_, fill_ and zero_ on the "z" sub-store (writes without a read)."""
    store = _open(conn, td_id)
    other = store["z"]
    for j in range(count):
        if j % 3 == 0:
            other.update_({"v": torch.full((4,), float(j))})
        elif j % 3 == 1:
            other.fill_("v", float(proc))
        else:
            other.zero_()
    store.close()
    return count


def locked_writer(conn: dict[str, Any], td_id: str, proc: int, attempts: int) -> int:
    """Tries to add keys to a locked store; returns how many writes got through."""
    store = _open(conn, td_id)
    through = 0
    for j in range(attempts):
        try:
            store[f"w{proc}_{j}"] = torch.zeros(store.batch_size[0])
            through += 1
        except RuntimeError:
            pass
    store.close()
    return through


def appender(conn: dict[str, Any], td_id: str, proc: int, count: int, rows: int) -> list[int]:
    store = _open(conn, td_id)
    out: list[int] = []
    for seq in range(count):
        tag = torch.tensor([[proc, seq, i] for i in range(rows)], dtype=torch.int64)
        got = store.extend(TensorDict(tag=tag, obs=torch.full((rows, 8), float(proc * 1000 + seq)), batch_size=[rows]))
        out.extend(got.tolist())
    store.close()
    return out


def killed_writer(conn: dict[str, Any], td_id: str, size: int, started: Any) -> None:
    """Rewrites two large entries with the same counter until killed by the test (at most 60 s)."""
    store = _open(conn, td_id)
    end = time.time() + 60
    i = 0
    while time.time() < end:
        i += 1
        store.update({"a": torch.full((size,), i, dtype=torch.int32), "b": torch.full((size,), i, dtype=torch.int32)})
        if i == 2:
            started.set()
