"""Readers under layout churn: how long a read waits while other processes add and delete keys.

    python benchmarks/bench_churn.py --server redis --seconds 8

``--writers`` processes add a key and delete it again, as fast as they can, on one store
(every step changes its layout version); ``--readers`` processes read it in a loop meanwhile,
in one of these forms (``--read``, default all):

* ``small``: ``to_tensordict()`` of a small store (8 entries of 4 x 16 float32);
* ``large``: ``to_tensordict()`` of a store above the one-step limit: 1 MiB of entries, with
  the readers' ``READ_ALL_MAX_BYTES`` lowered to 64 KiB (the same code path as a store of more
  than 64 MiB, without pushing GiBs through a shared machine);
* ``chunked``: ``to_tensordict()`` of a store whose entries are chunked (``chunk_bytes=256``);
* ``indexed``: ``store[1]``, ``store[[0, 2]]`` and ``store.get_at("e0", 1)`` in turn, on a store
  above the one-step limit (as ``large``);
* ``lazy``: a ``LazyStackedTensorDictStore``'s ``to_tensordict()``, ``store[1]`` and ``store["x"]``.

An optimistic read plans against the layout it has, reads, and starts again when the layout
version changed in between, so without a bound a reader can be outrun for as long as the
writers keep going. Reported per form: the reads made, the p50 / p90 / max latency, and the
reads that gave up (``StaleLayoutError``, "kept changing").

Run it on another revision with ``PYTHONPATH=<that checkout>`` to compare (the numbers of
docs/guarantees.md were measured that way, before and after the read leases).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

import torch
from _common import base_parser, bench_server, load_average, parse, print_table, server_banner

ENTRIES = 8  # entries of the store besides the churned ones
FORMS = ("small", "large", "chunked", "indexed", "lazy")
LOWERED_LIMIT = 64 * 1024  # the readers' one-step limit for "large" and "indexed"


def _open(kwargs: dict[str, Any], td_id: str, form: str) -> Any:
    from tdstore import LazyStackedTensorDictStore, TensorDictStore

    if form == "lazy":
        return LazyStackedTensorDictStore(td_id=td_id, **kwargs)
    return TensorDictStore.from_store(td_id=td_id, **kwargs)


def _writer(kwargs: dict[str, Any], td_id: str, form: str, name: str, stop: Any, ready: Any) -> None:
    torch.set_num_threads(1)
    store = _open(kwargs, td_id, form)
    ready.release()
    i = 0
    while not stop.is_set():
        key = f"{name}{i % 16}"
        store[key] = torch.ones(4)
        store.del_(key)
        i += 1


def _reader(kwargs: dict[str, Any], td_id: str, form: str, seconds: float, out: Any) -> None:
    from tdstore.errors import StaleLayoutError

    torch.set_num_threads(1)
    if form in ("large", "indexed"):
        from tdstore._backend import ops

        ops.READ_ALL_MAX_BYTES = LOWERED_LIMIT  # the store is above the one-step limit
    store = _open(kwargs, td_id, form)
    if form in ("small", "large", "chunked"):
        reads = [store.to_tensordict]
    elif form == "indexed":
        reads = [lambda: store[1], lambda: store[[0, 2]], lambda: store.get_at("e0", 1)]
    else:
        reads = [store.to_tensordict, lambda: store[1], lambda: store["x"]]
    latencies: list[float] = []
    gave_up = 0
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        try:
            reads[i % len(reads)]()
        except StaleLayoutError:
            gave_up += 1
        latencies.append(time.perf_counter() - t0)
        i += 1
    out.put((latencies, gave_up))


def _make_store(kwargs: dict[str, Any], form: str) -> Any:
    from tensordict import LazyStackedTensorDict, TensorDict

    from tdstore import LazyStackedTensorDictStore, TensorDictStore

    if form == "lazy":
        elems = [TensorDict({"x": torch.randn(16), "y": torch.randn(3)}, []) for _ in range(4)]
        return LazyStackedTensorDictStore.from_lazy_stack(LazyStackedTensorDict(*elems), **kwargs)
    store = TensorDictStore(batch_size=[4], chunk_bytes=256 if form == "chunked" else None, **kwargs)
    width = 8192 if form in ("large", "indexed") else 16  # 8 x 4 x 8192 float32 = 1 MiB
    for i in range(ENTRIES):
        store[f"e{i}"] = torch.randn(4, width)
    return store


def run(kwargs: dict[str, Any], form: str, writers: int, readers: int, seconds: float) -> tuple[list[float], int]:
    store = _make_store(kwargs, form)
    ctx = mp.get_context("spawn")
    stop, ready, out = ctx.Event(), ctx.Semaphore(0), ctx.Queue()
    procs = [
        ctx.Process(target=_writer, args=(kwargs, store.td_id, form, f"w{j}_", stop, ready)) for j in range(writers)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        if not ready.acquire(timeout=120):
            raise RuntimeError("a writer did not start")
    rprocs = [ctx.Process(target=_reader, args=(kwargs, store.td_id, form, seconds, out)) for _ in range(readers)]
    for p in rprocs:
        p.start()
    latencies: list[float] = []
    gave_up = 0
    try:
        for _ in rprocs:
            got, n = out.get(timeout=seconds * 20 + 300)
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
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds the readers read (default: 8)")
    parser.add_argument("--writers", type=int, default=4, help="processes adding and deleting keys (default: 4)")
    parser.add_argument("--readers", type=int, default=2, help="processes reading (default: 2)")
    parser.add_argument("--read", choices=(*FORMS, "all"), default="all", help="the form of read (default: all)")
    args = parse(parser)
    import tdstore

    print(f"# tdstore {tdstore.__file__}; load {load_average()}")
    with bench_server(args.server) as handle:
        print(f"# {server_banner(handle)}; {args.writers} writers, {args.readers} readers, {args.seconds:g} s")
        rows = []
        for form in FORMS if args.read == "all" else (args.read,):
            lat, gave_up = run(handle.connection_kwargs(), form, args.writers, args.readers, args.seconds)
            lat.sort()
            p90 = lat[min(len(lat) - 1, int(0.9 * len(lat)))] if lat else float("nan")
            rows.append([
                form,
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
