"""How long a large read makes the server's other clients wait, and how long it takes.

    python benchmarks/bench_read_stall.py --server valkey --size 256

A server runs one client's commands at a time, so a client reading a big entry delays
everyone else by as long as the server spends on its commands back to back. For one
``[16, n]`` float32 entry of ``--size`` MiB on the unix socket, each case reads it once per
round while another process PINGs the server in a loop and reports its slowest PING:

* ``store["x"]`` with the default read window (``_large.READ_WINDOW`` GETRANGE pieces of
  ``_large.READ_PIECE`` bytes sent at a time) and with a window of 8;
* raw redis-py ``GET`` + ``torch.frombuffer`` (the server builds the whole reply at once).

Cells: median over ``--repeat`` rounds (cases interleaved) of the read time and of the
worst PING seen during the read.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import time
from typing import Any

import torch
from _common import base_parser, bench_server, byte_view, fmt_ms, load_average, parse, print_table, server_banner
from bench_large import CONFIG

from tdstore import TensorDictStore
from tdstore._backend import large as _large

ROWS = 16


def _probe(path: str, stop: Any, ready: Any, out: Any) -> None:
    """PINGs the server until ``stop``; puts its slowest PING (seconds) and the PING count."""
    import redis

    client = redis.Redis(unix_socket_path=path)
    client.ping()
    worst, count = 0.0, 0
    ready.set()
    while not stop.is_set():
        t0 = time.perf_counter()
        client.ping()
        worst = max(worst, time.perf_counter() - t0)
        count += 1
    out.put((worst, count))


def _with_probe(ctx: Any, path: str, read: Any) -> tuple[float, float]:
    stop, ready, out = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_probe, args=(path, stop, ready, out))
    proc.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the PING process did not start")
        time.sleep(0.05)
        t0 = time.perf_counter()
        read()
        elapsed = time.perf_counter() - t0
        stop.set()
        worst, count = out.get(timeout=60)
    finally:
        stop.set()
        proc.join(30)
    if count == 0:
        raise RuntimeError("the PING process sent nothing during the read")
    return elapsed, worst


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256, help="entry size in MiB (default 256)")
    args = parse(parser)
    ctx = mp.get_context("spawn")
    shape = (ROWS, args.size * 2**20 // 4 // ROWS)
    value = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    default_window = _large.READ_WINDOW
    with bench_server(args.server, CONFIG) as handle:
        print(f"# bench_read_stall: one {args.size} MiB entry, unix socket; {server_banner(handle)}")
        print(f"# load average at start: {load_average()}")
        path = handle.unix_socket_path
        store = TensorDictStore(batch_size=[ROWS], unix_socket_path=path)
        store["x"] = value
        import redis.asyncio

        loop = asyncio.new_event_loop()
        raw = redis.asyncio.Redis(unix_socket_path=path, socket_timeout=None)
        key = "bench:stall:raw"
        loop.run_until_complete(raw.set(key, byte_view(value)))

        def ours(window: int) -> Any:
            def read() -> None:
                _large.READ_WINDOW = window
                try:
                    got = store["x"]
                finally:
                    _large.READ_WINDOW = default_window
                assert got.shape == value.shape

            return read

        def raw_get() -> None:
            data = loop.run_until_complete(raw.get(key))
            got = torch.frombuffer(data, dtype=torch.float32).reshape(shape)
            assert got.shape == value.shape

        assert torch.equal(store["x"], value)
        cases = {
            f"store['x'], window {default_window} (default)": ours(default_window),
            "store['x'], window 8": ours(8),
            "raw GET + frombuffer": raw_get,
        }
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
        names = list(cases)
        for r in range(args.warmup + args.repeat):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                result = _with_probe(ctx, path, cases[name])
                if r >= args.warmup:
                    runs[name].append(result)
        loop.run_until_complete(raw.delete(key))
        loop.run_until_complete(raw.aclose())
        loop.close()
        store.clear_redis()
        store.close()
    rows = []
    for name, results in runs.items():
        reads = [t for t, _ in results]
        stalls = [s for _, s in results]
        rows.append([name, fmt_ms(statistics.median(reads)), fmt_ms(statistics.median(stalls)), fmt_ms(max(stalls))])
    print_table(
        f"a {args.size} MiB read and the other clients' wait",
        ["read", "read ms (median)", "worst PING ms (median)", "worst PING ms (max)"],
        rows,
        [f"{args.repeat} rounds after {args.warmup} warm-ups, cases interleaved; the PINGs come from another process",
         f"piece size {_large.READ_PIECE // 2**20} MiB; load average at end: {load_average()}"],
    )


if __name__ == "__main__":
    main()
