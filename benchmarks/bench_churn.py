"""Readers under layout churn: how long a read waits while other processes add and delete keys.

    python benchmarks/bench_churn.py --server redis --seconds 10

``--writers`` processes add a key and delete it again, as fast as they can, on one store
(every step changes its layout version); ``--readers`` processes read the whole store
(``to_tensordict()``) or one row of it (``store[0]``) in a loop meanwhile. An optimistic read
plans against the layout it has, reads, and starts again when the layout version changed
in between, so without a bound a reader can be outrun for as long as the writers keep
going. Reported per read kind: the reads made, the p50 / p90 / max latency, and the reads
that gave up (``StaleLayoutError``, "kept changing").

Run it on another revision with ``PYTHONPATH=<that checkout>`` to compare (the numbers of
docs/guarantees.md were measured that way, before and after the one-step fallback).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

import torch
from _common import base_parser, bench_server, load_average, parse, print_table, server_banner

ENTRIES = 8  # entries of the store besides the churned ones


def _writer(kwargs: dict[str, Any], td_id: str, name: str, stop: Any, ready: Any) -> None:
    from tdstore import TensorDictStore

    torch.set_num_threads(1)
    store = TensorDictStore.from_store(td_id=td_id, **kwargs)
    ready.release()
    i = 0
    while not stop.is_set():
        key = f"{name}{i % 16}"
        store[key] = torch.ones(4)
        store.del_(key)
        i += 1


def _reader(kwargs: dict[str, Any], td_id: str, kind: str, seconds: float, out: Any) -> None:
    from tdstore import TensorDictStore
    from tdstore.errors import StaleLayoutError

    torch.set_num_threads(1)
    store = TensorDictStore.from_store(td_id=td_id, **kwargs)
    latencies: list[float] = []
    gave_up = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        try:
            if kind == "whole":
                store.to_tensordict()
            else:
                store[0]
        except StaleLayoutError:
            gave_up += 1
        latencies.append(time.perf_counter() - t0)
    out.put((latencies, gave_up))


def run(kwargs: dict[str, Any], kind: str, writers: int, readers: int, seconds: float) -> tuple[list[float], int]:
    from tdstore import TensorDictStore

    store = TensorDictStore(batch_size=[4], **kwargs)
    for i in range(ENTRIES):
        store[f"e{i}"] = torch.randn(4, 16)
    ctx = mp.get_context("spawn")
    stop, ready, out = ctx.Event(), ctx.Semaphore(0), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(kwargs, store.td_id, f"w{j}_", stop, ready)) for j in range(writers)]
    for p in procs:
        p.start()
    for _ in procs:
        if not ready.acquire(timeout=120):
            raise RuntimeError("a writer did not start")
    rprocs = [ctx.Process(target=_reader, args=(kwargs, store.td_id, kind, seconds, out)) for _ in range(readers)]
    for p in rprocs:
        p.start()
    latencies: list[float] = []
    gave_up = 0
    try:
        for _ in rprocs:
            got, n = out.get(timeout=seconds * 20 + 120)
            latencies.extend(got)
            gave_up += n
    finally:
        stop.set()
        for p in rprocs + procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    store.clear_redis()
    store.close()
    return latencies, gave_up


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.set_defaults(server="redis")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds the readers read (default: 10)")
    parser.add_argument("--writers", type=int, default=4, help="processes adding and deleting keys (default: 4)")
    parser.add_argument("--readers", type=int, default=2, help="processes reading (default: 2)")
    parser.add_argument("--read", choices=("whole", "row", "both"), default="both", help="what the readers read")
    args = parse(parser)
    import tdstore

    print(f"# tdstore {tdstore.__file__}; load {load_average()}")
    with bench_server(args.server) as handle:
        print(f"# {server_banner(handle)}; {args.writers} writers, {args.readers} readers, {args.seconds:g} s")
        rows = []
        for kind in (("whole", "row") if args.read == "both" else (args.read,)):
            lat, gave_up = run(handle.connection_kwargs(), kind, args.writers, args.readers, args.seconds)
            lat.sort()
            p90 = lat[min(len(lat) - 1, int(0.9 * len(lat)))] if lat else float("nan")
            rows.append([
                "to_tensordict()" if kind == "whole" else "store[0]",
                str(len(lat)),
                f"{statistics.median(lat) * 1e3:.2f}" if lat else "-",
                f"{p90 * 1e3:.2f}",
                f"{max(lat) * 1e3:.1f}" if lat else "-",
                str(gave_up),
            ])
        print_table(
            "reads under layout churn",
            ["read", "reads", "p50 ms", "p90 ms", "max ms", "gave up"],
            rows,
        )


if __name__ == "__main__":
    main()
