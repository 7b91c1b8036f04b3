"""Ring-buffer appends from 1, 2 and 4 writer processes (issue "many writers").

    python benchmarks/bench_append.py --server valkey --seconds 3

Each writer appends batches of ``--batch`` rows (obs 84x84x3 uint8 = 21,168 B, action 4
float32, reward float32) for ``--seconds`` s:

* tdstore:  ``store.extend(td)`` on a ``from_schema`` buffer (the cursor is reserved and
  the rows written in one Lua step);
* raw:      what a careful redis-py user writes for the same bytes: ``INCRBY`` of a cursor
  key, then a MULTI of one SETRANGE per entry (or two when the batch wraps).

It prints rows/s and MB/s per writer count, the ratio tdstore/raw (of throughput; higher
is better for tdstore), and the latency of ``store[idx]`` (256 random valid rows) sampled
by the main process while the tdstore writers run.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time
from typing import Any

import torch
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore.server import start_server

CAPACITY = 4096
ROW_BYTES = 84 * 84 * 3 + 4 * 4 + 4
SCHEMA = {"obs": ([84, 84, 3], torch.uint8), "action": ([4], torch.float32), "reward": ([], torch.float32)}


def _batch(n: int, value: int) -> TensorDict:
    return TensorDict(
        obs=torch.full((n, 84, 84, 3), value % 251, dtype=torch.uint8),
        action=torch.full((n, 4), float(value)),
        reward=torch.full((n,), float(value)),
        batch_size=[n],
    )


def tds_writer(conn: dict[str, Any], td_id: str, batch: int, seconds: float, start: Any) -> tuple[int, float]:
    torch.set_num_threads(1)
    store = TensorDictStore.from_store(td_id=td_id, **conn)
    data = _batch(batch, 1)
    store.extend(data)  # warm up
    start[1].put(1)
    start[0].wait(60)
    rows = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        store.extend(data)
        rows += batch
    elapsed = time.perf_counter() - t0
    store.close()
    return rows, elapsed


def raw_writer(conn: dict[str, Any], prefix: str, batch: int, seconds: float, start: Any) -> tuple[int, float]:
    import redis.asyncio

    torch.set_num_threads(1)
    data = _batch(batch, 1)
    payloads = {
        "obs": memoryview(data["obs"].numpy()).cast("B"),
        "action": memoryview(data["action"].numpy()).cast("B"),
        "reward": memoryview(data["reward"].numpy()).cast("B"),
    }
    sizes = {"obs": 84 * 84 * 3, "action": 16, "reward": 4}

    async def run() -> tuple[int, float]:
        if "unix_socket_path" in conn:
            client = redis.asyncio.Redis(unix_socket_path=conn["unix_socket_path"])
        else:
            client = redis.asyncio.Redis(host=conn["host"], port=conn["port"])

        async def once() -> None:
            end = await client.incrby(f"{prefix}:cursor", batch)
            first = (end - batch) % CAPACITY
            head = min(batch, CAPACITY - first)
            async with client.pipeline(transaction=True) as pipe:
                for name, view in payloads.items():
                    size = sizes[name]
                    pipe.setrange(f"{prefix}:{name}", first * size, view[: head * size])
                    if head < batch:
                        pipe.setrange(f"{prefix}:{name}", 0, view[head * size :])
                await pipe.execute()

        await once()
        start[1].put(1)
        start[0].wait(60)
        rows = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            await once()
            rows += batch
        elapsed = time.perf_counter() - t0
        await client.aclose()
        return rows, elapsed

    return asyncio.run(run())


def _run(fn: Any, args: tuple, writers: int, seconds: float, sampler: Any = None) -> tuple[float, list[float]]:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        start = manager.Event()
        ready = manager.Queue()
        with ctx.Pool(writers) as pool:
            results = [pool.apply_async(fn, (*args, (start, ready))) for _ in range(writers)]
            # every writer connects and warms up before the clock starts
            for _ in range(writers):
                ready.get(timeout=120)
            start.set()
            latencies: list[float] = []
            if sampler is not None:
                t_end = time.perf_counter() + seconds
                while time.perf_counter() < t_end:
                    latencies.append(sampler())
            outs = [r.get(seconds + 120) for r in results]
    rows = sum(r for r, _ in outs)
    elapsed = max(e for _, e in outs)
    return rows / elapsed, latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default="valkey", choices=["valkey", "redis", "redis6"])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--writers", default="1,2,4")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with start_server(args.server) as srv:
        conn = srv.connection_kwargs(unix=True)
        print(f"server: {args.server} {srv.version} (unix socket); rows of {ROW_BYTES} B; batches of {args.batch}")
        print(f"{'writers':>7} | {'tdstore rows/s':>14} | {'MB/s':>7} | {'raw rows/s':>10} | {'MB/s':>7} | {'tdstore/raw':>11} | sample p50 / p99 ms")
        for writers in [int(w) for w in args.writers.split(",")]:
            store = TensorDictStore.from_schema(SCHEMA, batch_size=[CAPACITY], **conn)
            gen = torch.Generator().manual_seed(0)

            def sample(store: TensorDictStore = store, gen: torch.Generator = gen) -> float:
                valid = store.ring_state().valid
                idx = torch.randint(0, max(valid, 1), (256,), generator=gen)
                t = time.perf_counter()
                store[idx]
                return (time.perf_counter() - t) * 1000

            tds_rate, lat = _run(tds_writer, (conn, store.td_id, args.batch, args.seconds), writers, args.seconds, sample)
            raw_client = srv.sync_client()
            prefix = "rawbench"
            for name, (shape, dtype) in SCHEMA.items():
                nbytes = CAPACITY * int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
                raw_client.setrange(f"{prefix}:{name}", nbytes - 1, b"\0")
            raw_rate, _ = _run(raw_writer, (conn, prefix, args.batch, args.seconds), writers, args.seconds)
            raw_client.delete(*[f"{prefix}:{n}" for n in [*SCHEMA, "cursor"]])
            p50 = statistics.median(lat) if lat else float("nan")
            p99 = sorted(lat)[int(0.99 * (len(lat) - 1))] if lat else float("nan")
            mb = ROW_BYTES / 1e6
            print(
                f"{writers:>7} | {tds_rate:>14,.0f} | {tds_rate * mb:>7.1f} | {raw_rate:>10,.0f} | {raw_rate * mb:>7.1f} | "
                f"{tds_rate / raw_rate:>10.2f}x | {p50:.1f} / {p99:.1f} ({len(lat)} samples)"
            )
            store.clear_redis()
            store.close()


if __name__ == "__main__":
    main()
