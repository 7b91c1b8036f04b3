"""``tdstore bench``: a quick benchmark of tdstore against raw redis-py on a given server.

Each case times a tdstore operation and the fastest plain ``redis.asyncio`` code for the
same work (the same bytes, the same server, the same IO loop thread), and reports the
medians, the rate and the ratio tdstore / raw (lower is better; 1.00x is parity), and
beside them the server's main-thread CPU µs per operation of each (``INFO cpu``): the
server runs commands on one thread, so that figure caps the operations per second of all
its clients together (1e6 / µs per op), whatever their number. The
thorough benchmarks, with their goals, are in ``benchmarks/``; this one takes seconds and
says what a given deployment (host, socket, TLS, server kind) delivers.

Everything it creates lives under the key prefix ``tdstore-bench`` and is deleted at the
end, also after an error.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

if TYPE_CHECKING:
    from typing import TypeAlias

    import redis.asyncio
    import redis.asyncio.cluster

    from tdstore.cli.commands import ConnOptions
    from tdstore.store import TensorDictStore

    #: the plain redis-py client that the raw cases use
    _Client: TypeAlias = "redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster"

_T = TypeVar("_T")

__all__ = ["run_bench", "BENCH_PREFIX"]

BENCH_PREFIX = "tdstore-bench"


def _median_s(fn: Callable[[], object], repeat: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _server_cpu_s(info: dict[str, Any]) -> float:
    """Seconds of CPU the server's main thread used so far, from INFO cpu (summed over the
    nodes of a cluster); all threads where a server lacks the main-thread fields."""
    nodes = list(info.values()) if info and all(isinstance(v, dict) for v in info.values()) else [info]
    total = 0.0
    for node in nodes:
        if "used_cpu_user_main_thread" in node:
            total += float(node["used_cpu_user_main_thread"]) + float(node["used_cpu_sys_main_thread"])
        else:
            total += float(node.get("used_cpu_user", 0.0)) + float(node.get("used_cpu_sys", 0.0))
    return total


class _Raw:
    """Plain redis.asyncio calls on tdstore's IO loop (one client, created on that loop)."""

    def __init__(self, opts: ConnOptions) -> None:
        from tdstore._backend import loop as _io

        self._io = _io
        self._opts = opts
        self._client: _Client | None = None
        self._timeout = opts.timeout * 4

    def run(self, fn: Callable[[_Client], Awaitable[_T]]) -> _T:
        async def call() -> _T:
            if self._client is None:
                self._client = self._opts.async_client()
            return await fn(self._client)

        return self._io.sync(call(), self._timeout)

    def close(self) -> None:
        if self._client is not None:

            async def close(c: _Client) -> None:
                await c.aclose()

            self.run(close)


def _cases(opts: ConnOptions, args: argparse.Namespace, raw: _Raw, stores: list[TensorDictStore], keys: list[str]) -> list[dict[str, Any]]:
    import torch
    from tensordict import TensorDict

    from tdstore import TensorDictStore

    conn = opts.store_kwargs()
    gen = torch.Generator().manual_seed(0)
    results: list[dict[str, Any]] = []

    def cpu() -> float:
        return _server_cpu_s(raw.run(lambda c: c.info("cpu")))

    def timed(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
        """Median seconds of ``fn`` and the server's CPU µs per call (the warm-up call included)."""
        before = cpu()
        t = _median_s(fn, repeat)
        return t, (cpu() - before) / (repeat + 1) * 1e6

    def record(case: str, t_store: Any, t_raw: Any, nbytes: int, rows: int | None, raw_desc: str) -> None:
        (t_store, us_store), (t_raw, us_raw) = t_store, t_raw
        results.append(
            {
                "case": case,
                "raw": raw_desc,
                "tdstore_ms": t_store * 1e3,
                "raw_ms": t_raw * 1e3,
                "ratio": t_store / t_raw if t_raw > 0 else float("inf"),
                "mb_per_s": nbytes / t_store / 1e6,
                "rows_per_s": rows / t_store if rows else None,
                "tdstore_server_us": us_store,
                "raw_server_us": us_raw,
            }
        )

    # ---- whole entry
    numel = max(1, int(args.mb * 1e6) // 4)
    tensor = torch.randn(numel, generator=gen)
    nbytes = numel * 4
    view = tensor.numpy().data.cast("B")
    store = TensorDictStore(batch_size=[], prefix=BENCH_PREFIX, **conn)
    stores.append(store)
    raw_key = f"{BENCH_PREFIX}:raw:{uuid.uuid4().hex}"
    keys.append(raw_key)

    def store_set() -> None:
        store["x"] = tensor

    async def raw_set(c: _Client) -> None:
        await c.set(raw_key, view)

    async def raw_get(c: Any) -> torch.Tensor:
        return torch.frombuffer(bytearray(await c.get(raw_key)), dtype=torch.float32)

    t_store = timed(store_set, args.repeat)
    t_raw = timed(lambda: raw.run(raw_set), args.repeat)
    record(f"store['x'] = t ({nbytes / 1e6:.0f} MB)", t_store, t_raw, nbytes, None, "SET")
    got = store["x"]
    if not torch.equal(got, tensor):
        raise AssertionError("tdstore bench: the whole entry read back differs from what was written")
    t_store = timed(lambda: store["x"], args.repeat)
    t_raw = timed(lambda: raw.run(raw_get), args.repeat)
    record(f"store['x'] ({nbytes / 1e6:.0f} MB)", t_store, t_raw, nbytes, None, "GET + frombuffer")

    # ---- random rows
    rows, row_bytes, batch = args.rows, args.row_bytes, min(args.batch, args.rows)
    rows_store = TensorDictStore.from_schema(
        {"obs": ([row_bytes], torch.uint8)}, batch_size=[rows], prefix=BENCH_PREFIX, **conn
    )
    stores.append(rows_store)
    rows_key = f"{BENCH_PREFIX}:raw:{uuid.uuid4().hex}"
    keys.append(rows_key)
    data = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=gen)
    rows_store["obs"] = data
    data_view = data.numpy().data.cast("B")
    raw.run(lambda c: c.set(rows_key, data_view))
    idx = torch.randperm(rows, generator=gen)[:batch]
    idx_list = idx.tolist()
    new_rows = TensorDict(obs=torch.randint(0, 256, (batch, row_bytes), dtype=torch.uint8, generator=gen),
                          batch_size=[batch])
    new_view = new_rows["obs"].numpy().data.cast("B")

    async def raw_rows_read(c: _Client) -> torch.Tensor:
        async with c.pipeline(transaction=True) as pipe:
            for i in idx_list:
                pipe.getrange(rows_key, i * row_bytes, (i + 1) * row_bytes - 1)
            parts = await pipe.execute()
        return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8).view(batch, row_bytes)

    async def raw_rows_write(c: _Client) -> None:
        async with c.pipeline(transaction=True) as pipe:
            for n, i in enumerate(idx_list):
                pipe.setrange(rows_key, i * row_bytes, new_view[n * row_bytes : (n + 1) * row_bytes])
            await pipe.execute()

    if not torch.equal(rows_store[idx]["obs"], data[idx]):
        raise AssertionError("tdstore bench: the rows read back differ from what was written")
    repeat = max(args.repeat, 15)  # millisecond cases: more runs for a stable median
    t_store = timed(lambda: rows_store[idx], repeat)
    t_raw = timed(lambda: raw.run(raw_rows_read), repeat)
    record(f"store[idx], {batch} random rows of {row_bytes} B", t_store, t_raw, batch * row_bytes, batch,
           f"MULTI of {batch} GETRANGE")

    def rows_write() -> None:
        rows_store[idx] = new_rows

    t_store = timed(rows_write, repeat)
    t_raw = timed(lambda: raw.run(raw_rows_write), repeat)
    record(f"store[idx] = td, {batch} random rows", t_store, t_raw, batch * row_bytes, batch,
           f"MULTI of {batch} SETRANGE")

    one = int(idx_list[0])

    async def raw_one(c: Any) -> torch.Tensor:
        return torch.frombuffer(bytearray(await c.getrange(rows_key, one * row_bytes, (one + 1) * row_bytes - 1)),
                                dtype=torch.uint8)

    repeat_one = max(args.repeat, 31)
    t_store = timed(lambda: rows_store[one], repeat_one)
    t_raw = timed(lambda: raw.run(raw_one), repeat_one)
    record("store[i], one row", t_store, t_raw, row_bytes, 1, "GETRANGE")
    return results


def _format(results: list[dict[str, Any]], where: str, server: str) -> str:
    from tdstore.cli.stores import table

    rows = [
        [
            r["case"],
            f"{r['tdstore_ms']:.2f}",
            f"{r['raw_ms']:.2f}",
            f"{r['ratio']:.2f}x",
            f"{r['mb_per_s']:,.0f}",
            "-" if r["rows_per_s"] is None else f"{r['rows_per_s']:,.0f}",
            f"{r['tdstore_server_us']:,.0f}",
            f"{r['raw_server_us']:,.0f}",
            r["raw"],
        ]
        for r in results
    ]
    text = table(
        ["CASE", "TDSTORE ms", "RAW ms", "RATIO", "MB/s", "ROWS/s", "SERVER us/op", "RAW SERVER us/op", "RAW FORM"],
        rows, right={1, 2, 3, 4, 5, 6, 7},
    )
    return (
        f"tdstore bench on {where} ({server}); medians, ratio = tdstore / raw redis-py; server us/op: the "
        "server's main-thread CPU per operation (INFO cpu), which caps the operations per second of all its "
        "clients together\n" + text
    )


def _server_version(info: dict[str, Any]) -> str:
    """``valkey 8.1.8`` or ``redis 7.0.15`` from INFO server (a cluster client answers per node)."""
    if info and all(isinstance(v, dict) for v in info.values()):
        info = next(iter(info.values()))
    if "valkey_version" in info:
        return f"valkey {info['valkey_version']}"
    return f"redis {info.get('redis_version', '?')}"


def run_bench(opts: ConnOptions, args: argparse.Namespace, out: TextIO) -> int:
    """Runs ``tdstore bench``; returns 0."""
    from tdstore.errors import CliError

    if not 0 < args.mb <= 1024:
        raise CliError("tdstore bench: --mb must be in (0, 1024]", 2)
    if args.rows < 1 or args.row_bytes < 1 or args.batch < 1 or args.repeat < 1:
        raise CliError("tdstore bench: --rows, --row-bytes, --batch and --repeat must be positive", 2)
    raw = _Raw(opts)
    stores: list[TensorDictStore] = []
    keys: list[str] = []
    try:
        server = _server_version(raw.run(lambda c: c.info("server")))
        results = _cases(opts, args, raw, stores, keys)
    finally:
        for store in stores:
            try:
                store.clear_redis()
            finally:
                store.close()
        if keys:
            raw.run(lambda c: c.delete(*keys))
        raw.close()
    if args.json:
        json.dump({"server": opts.describe(), "server_version": server, "results": results}, out, indent=2)
        out.write("\n")
    else:
        out.write(_format(results, opts.describe(), server))
    return 0
