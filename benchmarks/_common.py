"""Shared helpers for the tdstore benchmarks (not part of the package).

* one private server per run (:func:`bench_server`, default kind ``valkey``);
* timing with :func:`time.perf_counter`: ``--warmup`` untimed runs, then ``--repeat``
  timed runs, reported as their median and minimum (:class:`Timing`);
* :class:`RawRedis`: the raw redis-py baseline, written the way a competent user would
  write it: ``redis.asyncio`` with the hiredis parser, one event loop in a background
  thread, and every timed operation awaited *inside* that loop (no thread hop is
  charged to the baseline, whereas every blocking tdstore call pays one);
* :func:`print_table` and the ratio/goal formatting used by every benchmark.

Every ratio is ``tdstore_time / raw_time`` on the same server and transport: lower is
better, 1.0 means parity with hand-written redis-py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import statistics
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

# run from a checkout without installing: `python benchmarks/bench_x.py`
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import redis.asyncio  # noqa: E402
import torch  # noqa: E402

from tdstore.server import ServerHandle, start_server  # noqa: E402

# torch.frombuffer warns that a bytes reply is read-only; the benchmarks never write to it
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

SERVER_KINDS = ("valkey", "redis", "redis6")
TRANSPORTS = ("unix", "tcp")


# --------------------------------------------------------------------------- #
# command line
# --------------------------------------------------------------------------- #


# The best raw form for many small rows of one string: KEYS[1] a string of fixed-size rows,
# ARGV[1] the row size in bytes, ARGV[2..] row numbers; returns the rows' bytes concatenated in
# the order given (the baseline of the sampling benchmarks).
GATHER_LUA = """
local key = KEYS[1]
local size = tonumber(ARGV[1])
local out = {}
for i = 2, #ARGV do
  local off = tonumber(ARGV[i]) * size
  out[i - 1] = redis.call('GETRANGE', key, off, off + size - 1)
end
return table.concat(out)
"""

def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--server", choices=SERVER_KINDS, default="valkey", help="server kind (default: valkey)")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs per measurement (default: 7)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs before them (default: 2)")
    parser.add_argument(
        "--transport", choices=(*TRANSPORTS, "both"), default="both", help="unix socket, TCP, or both (default)"
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a busy 2-core machine a 2-thread OpenMP region waits "
        "milliseconds for a descheduled worker, e.g. td[idx] takes 12 ms instead of 40 us)",
    )
    return parser


def parse(parser: argparse.ArgumentParser) -> argparse.Namespace:
    args = parser.parse_args()
    if args.repeat < 1 or args.warmup < 0:
        parser.error("--repeat must be >= 1 and --warmup >= 0")
    torch.set_num_threads(args.torch_threads)
    return args


def transports(args: argparse.Namespace) -> tuple[str, ...]:
    return TRANSPORTS if args.transport == "both" else (args.transport,)


# --------------------------------------------------------------------------- #
# timing
# --------------------------------------------------------------------------- #


@dataclass
class Timing:
    """Seconds of each timed run."""

    runs: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def min(self) -> float:
        return min(self.runs)


def measure(
    fn: Callable[[], Any],
    *,
    repeat: int,
    warmup: int,
    before: Callable[[], Any] | None = None,
    after: Callable[[], Any] | None = None,
) -> Timing:
    """Times ``fn()`` from this thread; ``before``/``after`` run untimed around each call."""
    quiet_gc()
    once = timed(fn, before=before, after=after)
    return Timing([once() for _ in range(warmup + repeat)][warmup:])


def timed(
    fn: Callable[[], Any],
    *,
    before: Callable[[], Any] | None = None,
    after: Callable[[], Any] | None = None,
) -> Callable[[], float]:
    """A case for :func:`compare`: one call of ``fn()`` from this thread, in seconds."""

    def once() -> float:
        if before is not None:
            before()
        with _gc_paused():
            t0 = time.perf_counter()
            result = fn()
            elapsed = time.perf_counter() - t0
            del result
        if after is not None:
            after()
        return elapsed

    return once


def compare(cases: dict[str, Callable[[], float]], *, repeat: int, warmup: int) -> dict[str, Timing]:
    """Runs the cases interleaved, round after round, and times each.

    Each case is a callable that performs one run and returns its seconds (see
    :func:`timed` and :meth:`RawRedis.timed`). Interleaving (with the order rotated each
    round) spreads the noise of a busy machine evenly over the cases being compared,
    instead of charging a burst of load to whichever case happened to run then.
    """
    quiet_gc()
    names = list(cases)
    runs: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + repeat):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            elapsed = cases[name]()
            if r >= warmup:
                runs[name].append(elapsed)
    return {n: Timing(v) for n, v in runs.items()}


def quiet_gc() -> None:
    """Moves every live object out of the collector's reach (``gc.freeze``).

    With torch and tensordict imported a full ``gc.collect()`` takes ~0.1 s on this
    machine; frozen objects are not scanned again, so a collection that a timed run
    happens to trigger costs what the run's own garbage costs, not the whole heap.
    """
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic collection inside a timed run: garbage left by the previous case (say,
    thousands of pipeline objects) must not be charged to the next one. The young
    objects are collected untimed first (cheap: everything older is frozen)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover
        return "?"


# --------------------------------------------------------------------------- #
# raw redis-py baseline
# --------------------------------------------------------------------------- #


class RawRedis:
    """redis.asyncio clients (unix socket and TCP) on one private event loop thread.

    ``time(transport, op)`` awaits ``op(client)`` inside the loop and times it there, so
    the baseline pays no cross-thread hop: this is the fastest way to drive redis-py.
    """

    def __init__(self, server: ServerHandle) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="raw-redis", daemon=True)
        self._thread.start()
        self.prefix = f"bench:raw:{uuid.uuid4().hex[:8]}:"
        self.clients: dict[str, redis.asyncio.Redis] = self.run(self._make_clients())

    async def _make_clients(self) -> dict[str, redis.asyncio.Redis]:
        clients = {
            "unix": redis.asyncio.Redis(unix_socket_path=self.server.unix_socket_path),
            "tcp": redis.asyncio.Redis(host=self.server.host, port=self.server.port),
        }
        for client in clients.values():
            await client.ping()
        return clients

    def key(self, name: str) -> str:
        return self.prefix + name

    def run(self, coro: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(300)  # type: ignore[arg-type]

    def call(self, transport: str, op: Callable[[redis.asyncio.Redis], Awaitable[Any]]) -> Any:
        """Runs ``op(client)`` once and returns its result (untimed)."""
        return self.run(op(self.clients[transport]))

    def timed(self, transport: str, op: Callable[[redis.asyncio.Redis], Awaitable[Any]]) -> Callable[[], float]:
        """A case for :func:`compare`: one ``await op(client)``, timed inside the loop."""
        client = self.clients[transport]

        async def once() -> float:
            with _gc_paused():
                t0 = time.perf_counter()
                result = await op(client)
                elapsed = time.perf_counter() - t0
                del result
            return elapsed

        return lambda: self.run(once())

    def time(
        self,
        transport: str,
        op: Callable[[redis.asyncio.Redis], Awaitable[Any]],
        *,
        repeat: int,
        warmup: int,
    ) -> Timing:
        client = self.clients[transport]

        async def batch() -> list[float]:
            runs = []
            for i in range(warmup + repeat):
                with _gc_paused():
                    t0 = time.perf_counter()
                    result = await op(client)
                    elapsed = time.perf_counter() - t0
                    del result
                if i >= warmup:
                    runs.append(elapsed)
            return runs

        return Timing(self.run(batch()))

    def cleanup(self) -> None:
        async def _clean() -> None:
            client = self.clients["unix"]
            keys = [k async for k in client.scan_iter(match=self.prefix + "*", count=1000)]
            if keys:
                await client.delete(*keys)
            for c in self.clients.values():
                await c.aclose()

        try:
            self.run(_clean())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
            self.loop.close()


def server_cpu(client: Any) -> float:
    """Seconds of CPU the server's main thread used so far (all threads where not reported)."""
    info = client.info("cpu")
    if "used_cpu_user_main_thread" in info:
        return float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"])
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat byte memoryview of a contiguous CPU tensor, without a copy.

    ``memoryview(t.numpy())`` alone is NOT enough for redis-py: for a float or a
    multi-dimensional array ``len()`` of that view counts items of the first dimension,
    and redis-py sends ``len(arg)`` as the bulk length. ``.cast("B")`` makes it bytes.
    """
    return memoryview(tensor.contiguous().numpy()).cast("B")


def tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """What a raw user does with a GET reply: wrap it, zero-copy, as a tensor."""
    return torch.frombuffer(data, dtype=dtype).reshape(tuple(shape))


def sync_hop_cost(repeat: int = 2000) -> float:
    """Median seconds of one blocking tdstore round trip to its IO loop with no server I/O."""
    from tdstore._backend import loop as _io

    async def noop() -> None:
        return None

    for _ in range(100):
        _io.sync(noop())
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        _io.sync(noop())
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


# --------------------------------------------------------------------------- #
# server
# --------------------------------------------------------------------------- #


@contextlib.contextmanager
def bench_server(kind: str, config: dict[str, str] | None = None) -> Iterator[ServerHandle]:
    """One private server for the whole run (``config``: server settings); stopped on exit (also on error)."""
    handle = start_server(kind, config=dict(config) if config else None)
    try:
        yield handle
        client = handle.sync_client()
        try:
            left = client.dbsize()
        finally:
            client.close()
        if left:
            print(f"# WARNING: {left} keys were left on the server after the benchmark")
    finally:
        handle.stop()


def server_banner(handle: ServerHandle) -> str:
    client = handle.sync_client()
    try:
        info = client.info("server")
    finally:
        client.close()
    name = "valkey" if "valkey_version" in info else "redis"
    version = info.get("valkey_version") or info.get("redis_version")
    import redis as _redis

    try:
        import hiredis

        parser = f"hiredis {hiredis.__version__}"
    except ImportError:  # pragma: no cover
        parser = "pure-Python parser (hiredis missing!)"
    return (
        f"tdstore {tdstore_revision()}; server: {handle.kind} ({name} {version}), loopback; "
        f"redis-py {_redis.__version__} + {parser}; torch {torch.__version__}; "
        f"python {sys.version.split()[0]}; {os.cpu_count()} CPUs"
    )


def tdstore_revision() -> str:
    """The checkout's commit (``+dirty`` with uncommitted changes to tdstore/ or lua/)."""
    import subprocess

    def git(*argv: str) -> str:
        return subprocess.run(
            ["git", "-C", _ROOT, *argv], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        rev = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "tdstore", "lua")
    except (OSError, subprocess.SubprocessError):
        return "(no git)"
    return rev + ("+dirty" if dirty else "")


# --------------------------------------------------------------------------- #
# output
# --------------------------------------------------------------------------- #


def fmt_ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    if ms >= 1:
        return f"{ms:.2f}"
    return f"{ms:.3f}"


def fmt_ratio(num: float | None, den: float | None) -> str:
    if num is None or den is None or den <= 0:
        return "-"
    return f"{num / den:.2f}x"


def fmt_goal(num: float | None, den: float | None, goal: float | None) -> str:
    if goal is None:
        return ""
    if num is None or den is None or den <= 0:
        return f"<= {goal:.1f}x"
    status = "ok" if num / den <= goal else "MISS"
    return f"<= {goal:.1f}x {status}"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], notes: Sequence[str] = ()) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [
        all(_looks_numeric(r[i]) for r in cells[1:] if r[i] not in ("", "-")) and i > 0 for i in range(len(headers))
    ]

    def line(row: Sequence[str]) -> str:
        parts = [c.rjust(w) if numeric[i] else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        return "| " + " | ".join(parts) + " |"

    print()
    print(f"### {title}")
    print()
    print(line(cells[0]))
    print("|" + "|".join(("-" * (w + 1) + ":") if numeric[i] else ("-" * (w + 2)) for i, w in enumerate(widths)) + "|")
    for row in cells[1:]:
        print(line(row))
    for note in notes:
        print(f"\n{note}")
    sys.stdout.flush()


def _looks_numeric(text: str) -> bool:
    text = text.rstrip("x")
    try:
        float(text)
    except ValueError:
        return False
    return True
