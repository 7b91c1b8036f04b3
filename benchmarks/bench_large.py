"""Large entries (issue 6, item 3): speed and client memory of one big entry vs raw redis-py.

    python benchmarks/bench_large.py --server valkey --sizes 64,256,1024

For each size (MiB of float32) and transport (unix socket, TCP) of one private server
(started with ``proto-max-bulk-len 2gb``, so a 1 GiB string is accepted), measures:

* ``store["x"] = t``        vs raw ``SET key memoryview``
* ``store["x"]``            vs raw ``GET`` + ``torch.frombuffer``
* ``store.to_tensordict()`` vs raw ``GET`` + ``torch.frombuffer``

Times are medians of ``--repeat`` interleaved runs (see _common.py). Memory: each
operation runs once more in a fresh subprocess (``--child``), which reports its peak
resident set (``VmHWM`` of /proc/self/status) before and after the operation; the
difference, divided by the entry's size, is the client's peak extra memory. The
baseline is taken when everything the operation needs already exists (the tensor to
write, the connected client or store), so a read's multiple includes the tensor it
returns (1.0x at least) and a write's does not include the tensor written.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio
import torch
from _common import (
    RawRedis,
    Timing,
    base_parser,
    bench_server,
    byte_view,
    compare,
    fmt_goal,
    fmt_ms,
    fmt_ratio,
    load_average,
    parse,
    print_table,
    server_banner,
    tensor_from_bytes,
    timed,
    transports,
)

from tdstore import TensorDictStore

GOAL_TIME = 1.0
GOAL_MEMORY = 1.5
ROWS = 16  # batch size of the store; the entry is [ROWS, n] float32
# a 1 GiB string needs both: one bulk argument over 512 MB, one command over the 1 GB query buffer
CONFIG = {"proto-max-bulk-len": "2gb", "client-query-buffer-limit": "2gb"}


class _RawNoTimeout(RawRedis):
    """:class:`_common.RawRedis` without redis-py 8's default 5 s socket timeout, which a
    1 GiB SET or GET exceeds on this machine (tdstore's own default is 120 s)."""

    async def _make_clients(self) -> dict[str, redis.asyncio.Redis]:
        clients = {
            "unix": redis.asyncio.Redis(unix_socket_path=self.server.unix_socket_path, socket_timeout=None),
            "tcp": redis.asyncio.Redis(host=self.server.host, port=self.server.port, socket_timeout=None),
        }
        for client in clients.values():
            await client.ping()
        return clients


def _t(timing: Timing) -> str:
    return f"{fmt_ms(timing.median)} ({fmt_ms(timing.min)})"


def _shape(mib: int) -> tuple[int, int]:
    return ROWS, mib * 2**20 // 4 // ROWS


# --------------------------------------------------------------------------- #
# memory: one operation in a fresh process
# --------------------------------------------------------------------------- #


def _hwm() -> int:
    """Peak resident set of this process so far, in bytes (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(spec: dict[str, Any]) -> None:
    """Runs one operation once and prints {"base": bytes, "peak": bytes, "s": seconds}."""
    torch.set_num_threads(1)
    shape = tuple(spec["shape"])
    kwargs = spec["kwargs"]
    op = spec["op"]
    result: Any = None
    if op.startswith("raw"):
        import redis.asyncio

        loop = asyncio.new_event_loop()
        conn = {"unix_socket_path": kwargs["unix_socket_path"]} if "unix_socket_path" in kwargs else {
            "host": kwargs["host"], "port": kwargs["port"]
        }
        client = redis.asyncio.Redis(**conn, socket_timeout=None)
        loop.run_until_complete(client.ping())
        if op == "raw:set":
            tensor = torch.full(shape, 1.5)
            view = byte_view(tensor)
            run: Callable[[], Any] = lambda: loop.run_until_complete(client.set(spec["key"], view))  # noqa: E731
        else:
            run = lambda: tensor_from_bytes(loop.run_until_complete(client.get(spec["key"])), torch.float32, shape)  # noqa: E731
    else:
        store = TensorDictStore.from_store(td_id=spec["td_id"], **kwargs)
        if op == "write":
            tensor = torch.full(shape, 1.5)

            def run() -> None:
                store["x"] = tensor

        elif op == "read":
            run = lambda: store["x"]  # noqa: E731
        else:
            run = store.to_tensordict
        store.keys()  # connected, layout cached
    base = _hwm()
    t0 = time.perf_counter()
    result = run()
    elapsed = time.perf_counter() - t0
    peak = _hwm()
    if isinstance(result, torch.Tensor):
        assert result.shape == shape
    del result
    print(json.dumps({"base": base, "peak": peak, "s": elapsed}))


def measure_memory(spec: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"memory child {spec['op']} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- #
# main
# --------------------------------------------------------------------------- #


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
        return
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64,256,1024", help="entry sizes in MiB, comma-separated (default 64,256,1024)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.set_defaults(repeat=5, warmup=1)
    args = parse(parser)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    time_rows: list[list[str]] = []
    mem_rows: list[list[str]] = []

    with bench_server(args.server, CONFIG) as srv:  # a 1 GiB string needs proto-max-bulk-len > 512mb
        print(f"# bench_large: one float32 entry of {', '.join(f'{s} MiB' for s in sizes)}")
        print(f"# {datetime.datetime.now().isoformat(timespec='minutes')}; {server_banner(srv)}")
        print(f"# server config: {CONFIG}; load average at start: {load_average()}")
        print(f"# each time cell: median (min) ms of {args.repeat} runs after {args.warmup} warm-up runs; cases interleaved")
        raw = _RawNoTimeout(srv)
        try:
            for mib in sizes:
                shape = _shape(mib)
                nbytes = shape[0] * shape[1] * 4
                tensor = torch.randn(*shape)
                key = raw.key(f"x{mib}")
                for tr in transports(args):
                    kwargs = srv.connection_kwargs(unix=(tr == "unix"))

                    async def raw_set(c: Any, key: str = key, tensor: torch.Tensor = tensor) -> Any:
                        return await c.set(key, byte_view(tensor))

                    async def raw_get(c: Any, key: str = key, shape: tuple[int, int] = shape) -> Any:
                        return tensor_from_bytes(await c.get(key), torch.float32, shape)

                    raw.call(tr, raw_set)
                    assert torch.equal(raw.call(tr, raw_get), tensor), "raw round trip differs"
                    store = TensorDictStore(batch_size=[ROWS], **kwargs)
                    try:
                        store["x"] = tensor
                        assert torch.equal(store["x"], tensor), "tdstore read back differs"
                        assert torch.equal(store.to_tensordict()["x"], tensor), "to_tensordict differs"

                        def write(store: TensorDictStore = store, tensor: torch.Tensor = tensor) -> None:
                            store["x"] = tensor

                        times = compare(
                            {"raw:set": raw.timed(tr, raw_set), "write": timed(write)},
                            repeat=args.repeat, warmup=args.warmup,
                        )
                        times.update(
                            compare(
                                {
                                    "raw:get": raw.timed(tr, raw_get),
                                    "read": timed(lambda store=store: store["x"]),
                                    "to_tensordict": timed(store.to_tensordict),
                                },
                                repeat=args.repeat, warmup=args.warmup,
                            )
                        )
                        mem: dict[str, dict[str, Any]] = {}
                        if not args.no_memory:
                            child_kwargs = {k: v for k, v in kwargs.items() if isinstance(v, (str, int, float))}
                            if tr == "tcp":
                                child_kwargs.pop("unix_socket_path", None)
                            for op in ("raw:set", "write", "raw:get", "read", "to_tensordict"):
                                spec = {
                                    "op": op, "shape": shape, "kwargs": child_kwargs,
                                    "key": key, "td_id": store.td_id,
                                }
                                mem[op] = measure_memory(spec)
                    finally:
                        store.clear_redis()
                        store.close()
                    time_rows.extend(_time_rows(mib, tr, times))
                    if mem:
                        mem_rows.extend(_mem_rows(mib, tr, nbytes, mem))
                del tensor
                _print_tables(time_rows, mem_rows, final=False)  # so far (a later size may not fit)
        finally:
            raw.cleanup()

    _print_tables(time_rows, mem_rows, final=True)


def _print_tables(time_rows: list[list[str]], mem_rows: list[list[str]], *, final: bool) -> None:
    suffix = "" if final else " (so far)"
    notes = [
        "ratio = median tdstore time / median raw time (lower is better; 1.00x = parity with hand-written "
        "redis.asyncio + hiredis, awaited inside its own event loop); '(of mins)' = the same for the fastest runs.",
        f"load average now: {load_average()}",
    ]
    headers = ["MiB", "operation", "transport", "raw baseline", "raw ms", "tdstore ms", "tdstore/raw", "(of mins)", "goal"]
    print_table("large entries: time" + suffix, headers, time_rows, notes)
    if mem_rows:
        mem_notes = [
            "peak extra = (VmHWM after the operation - VmHWM before it) / entry size, measured in a fresh "
            "process per operation (the operation runs once there; its tensor, client or store already exist "
            "when the baseline is taken). A read's figure includes the tensor it returns (>= 1.0x); a write's "
            "does not include the tensor written.",
        ]
        headers = ["MiB", "operation", "transport", "raw peak extra", "tdstore peak extra", "goal"]
        print_table("large entries: client peak extra memory (multiple of the entry size)" + suffix, headers, mem_rows, mem_notes)


def _time_rows(mib: int, tr: str, times: dict[str, Timing]) -> list[list[str]]:
    plan = [
        ('store["x"] = t', "write", "SET memoryview", "raw:set"),
        ('store["x"]', "read", "GET + frombuffer", "raw:get"),
        ("to_tensordict()", "to_tensordict", "GET + frombuffer", "raw:get"),
    ]
    rows = []
    for label, op, base_label, base in plan:
        b, o = times[base], times[op]
        rows.append([
            str(mib), label, tr, base_label, _t(b), _t(o), fmt_ratio(o.median, b.median), fmt_ratio(o.min, b.min),
            fmt_goal(o.median, b.median, GOAL_TIME),
        ])
    return rows


def _mem_rows(mib: int, tr: str, nbytes: int, mem: dict[str, dict[str, Any]]) -> list[list[str]]:
    def mult(op: str) -> float:
        return (mem[op]["peak"] - mem[op]["base"]) / nbytes

    rows = []
    for label, op, base in (
        ('store["x"] = t', "write", "raw:set"),
        ('store["x"]', "read", "raw:get"),
        ("to_tensordict()", "to_tensordict", "raw:get"),
    ):
        ours = mult(op)
        rows.append([
            str(mib), label, tr, f"{mult(base):.2f}x", f"{ours:.2f}x",
            f"< {GOAL_MEMORY:.1f}x {'ok' if ours < GOAL_MEMORY else 'MISS'}",
        ])
    return rows


if __name__ == "__main__":
    main()
