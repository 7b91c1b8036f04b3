"""The price of ``durability=`` (issue 27, item 4): wall time and the master's main-thread CPU per
write, for the default, ``"replicas:1"`` (WAIT 1) and ``"fsync"`` (WAITAOF 1 0), against raw
redis-py sending the same bytes with the same wait in the same packet.

One run, on servers this script starts (loopback only): a Valkey master with one replica, both
with ``appendonly yes`` and ``appendfsync everysec`` (so the default and ``replicas:1`` pay the
append-only file too, and ``fsync`` adds only the wait for its fsync). Two writes:

* ``extend`` of ``--rows`` rows of ``--row-bytes`` bytes to a ring;
* ``store[i] = row``, an indexed write of one row;

raw: one SETRANGE of the same bytes into a string as big as the store's, with the same wait.
The cases run interleaved, in rounds.

The master's CPU comes from ``INFO cpu`` (``used_cpu_*_main_thread``) over each span, less its
idle rate. Ratios: each mode against the default (the price), and tdstore against raw redis-py
with the same wait (the overhead, goal: at or under 1.0x wall).

    python benchmarks/bench_durability.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import redis
import torch
from _common import fmt_ratio, load_average, print_table, server_cpu
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore.server import start_replication

MODES = (None, "replicas:1", "fsync")
ROUNDS = 5
WAITS: dict[str | None, tuple[Any, ...]] = {None: (), "replicas:1": ("WAIT", 1, 1000), "fsync": ("WAITAOF", 1, 0, 1000)}


def _idle_rate(client: redis.Redis, seconds: float = 1.0) -> float:
    before, t0 = server_cpu(client), time.monotonic()
    time.sleep(seconds)
    return (server_cpu(client) - before) / (time.monotonic() - t0)


def _span(client: redis.Redis, idle: float, fn: Callable[[], None], count: int) -> tuple[float, float]:
    """(median wall µs, master CPU µs) per call of ``fn`` over ``count`` calls."""
    walls = []
    cpu0, t0 = server_cpu(client), time.monotonic()
    for _ in range(count):
        start = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - start)
    elapsed = time.monotonic() - t0
    cpu = max(0.0, server_cpu(client) - cpu0 - idle * elapsed)
    return statistics.median(walls) * 1e6, cpu / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--row-bytes", type=int, default=1024, help="(rows of 21 KB make the replica's own work the noise on 2 cores)")
    parser.add_argument("--count", type=int, default=600, help="writes per case")
    parser.add_argument("--quick", action="store_true", help="a small run (the test's)")
    args = parser.parse_args()
    if args.quick:
        args.count = 50
    print(
        f"# bench_durability: valkey master + 1 replica, appendonly yes (everysec); extend of {args.rows} rows of "
        f"{args.row_bytes} B, indexed write of 1 row; {args.count} writes per case; load average {load_average()}"
    )
    # (no automatic AOF rewrite: its fork would land on whichever case runs then)
    config = {"appendonly": "yes", "appendfsync": "everysec", "auto-aof-rewrite-percentage": "0"}
    with start_replication("valkey", replicas=1, config=config) as group:
        kwargs = group.connection_kwargs()
        master = group.node_client(group.master_index())
        raw = group.node_client(group.master_index())
        idle = _idle_rate(master)
        width = args.row_bytes // 4
        batch = TensorDict(obs=torch.ones(args.rows, width), batch_size=[args.rows])
        row = torch.full((width,), 2.0)
        payload = batch["obs"].numpy().tobytes()
        one_row = row.numpy().tobytes()
        capacity = max(args.rows * 64, 1024)
        counter = [0]

        def raw_case(key: str, wait: tuple[Any, ...], data: bytes) -> Callable[[], None]:
            """SETRANGE of ``data`` into a ring string as big as the store's (the same work), with the wait."""

            def once() -> None:
                counter[0] += 1
                pipe = raw.pipeline(transaction=False)
                pipe.setrange(key, (counter[0] * len(data)) % (capacity * len(one_row) - len(data) + 1), data)
                if wait:
                    pipe.execute_command(*wait)
                pipe.execute()

            return once

        cases: dict[tuple[str, str | None], Callable[[], None]] = {}
        stores = []
        for mode in MODES:
            extra = {} if mode is None else {"durability": mode}
            store = TensorDictStore.from_schema({"obs": ([width], torch.float32)}, batch_size=[capacity], **kwargs, **extra)
            stores.append(store)

            def indexed(s: TensorDictStore = store) -> None:
                counter[0] += 1
                s[counter[0] % capacity] = TensorDict(obs=row, batch_size=[])

            cases[("extend", mode)] = lambda s=store: s.extend(batch)
            cases[("indexed", mode)] = indexed
            key = f"bench-durability:{mode}"
            raw.setrange(key, capacity * len(one_row) - 1, b"\0")
            cases[("raw extend", mode)] = raw_case(key, WAITS[mode], payload)
            cases[("raw indexed", mode)] = raw_case(key, WAITS[mode], one_row)
        try:
            for fn in cases.values():  # warm: connections armed, scripts loaded
                for _ in range(5):
                    fn()
            # interleaved rounds: drift (the machine, the append-only file) falls on every case alike
            walls: dict[tuple[str, str | None], list[float]] = {name: [] for name in cases}
            cpus: dict[tuple[str, str | None], float] = dict.fromkeys(cases, 0.0)
            per_round = max(1, args.count // ROUNDS)
            for _ in range(ROUNDS):
                for name, fn in cases.items():
                    wall, cpu = _span(master, idle, fn, per_round)
                    walls[name].append(wall)
                    cpus[name] += cpu / ROUNDS
            results = {name: (statistics.median(walls[name]), cpus[name]) for name in cases}
        finally:
            for store in stores:
                store.clear_redis()
                store.close()
            for mode in MODES:
                raw.delete(f"bench-durability:{mode}")
        rows = []
        for op in ("extend", "indexed"):
            for mode in MODES:
                wall, cpu = results[(op, mode)]
                raw_wall, raw_cpu = results[(f"raw {op}", mode)]
                base_wall, base_cpu = results[(op, None)]
                rows.append(
                    [
                        op, mode or "default", f"{wall:.0f}", f"{cpu:.1f}", fmt_ratio(wall, base_wall),
                        fmt_ratio(cpu, base_cpu), f"{raw_wall:.0f}", f"{raw_cpu:.1f}", fmt_ratio(wall, raw_wall),
                        fmt_ratio(cpu, raw_cpu),
                    ]
                )
        print_table(
            "The price of durability= (valkey, 1 replica, loopback)",
            [
                "write", "durability", "wall µs", "master CPU µs", "wall vs default", "CPU vs default",
                "raw wall µs", "raw CPU µs", "wall vs raw", "CPU vs raw",
            ],
            rows,
            notes=[
                "raw: redis-py, SETRANGE of the same bytes with the same WAIT/WAITAOF in the same pipeline",
                "wall: median per write; master CPU: INFO cpu main thread over the span, less the idle rate",
            ],
        )
        master.close()
        raw.close()


if __name__ == "__main__":
    main()
