"""Aggregate append throughput of N appending processes, with and without samplers (issue 16 goal 2).

    python benchmarks/bench_append_curve.py                      # Redis 7 and Valkey 8, unix socket (~3 min)
    python benchmarks/bench_append_curve.py --quick              # one round of 1 s points (~1 min)
    python benchmarks/bench_append_curve.py --transport both --json curve.json

For each server, transport, number of appenders N (``--appenders``, default 1,2,4,8,16)
and number of samplers (``--samplers``, default 0,2), two points run, tdstore's and raw's,
``--rounds`` times (default 2, the order alternating; the table gives the medians):

* tdstore: N processes call ``store.extend(td)`` of 16 rows (obs 84x84x3 uint8 = 21,168 B,
  action 4 float32, reward float32) on one ``from_schema`` ring of 4096 rows, while the
  samplers call ``store.sample(256)``;
* raw: N processes do what a careful redis-py user writes for the same bytes (blocking
  ``redis.Redis``, which costs less client CPU per call here than ``redis.asyncio``), without
  tdstore's guarantees: ``INCRBY`` of a cursor key, then a MULTI of one SETRANGE per
  entry (two where the batch wraps); the samplers ``GET`` the cursor, then read 256
  random rows of each entry in one MULTI (768 GETRANGEs) and build the tensors.

``--sample-rate R`` paces each sampler at R calls a second on both sides, so that both do
the same sampling work: unpaced, the side whose ``sample()`` is cheaper loops faster and, on a
machine with fewer cores than processes, takes more CPU from its own appenders.

Every process of a point connects and makes one untimed call first; then they all start
at the same instant, run for ``--seconds`` (each loop also stops after ``MAX_CALLS``)
and report their calls and the p50 / p99 time of a call. Throughput = rows appended /
(last call's end - start); the samplers' calls/s likewise. The
server's main-thread CPU (``INFO cpu``: ``used_cpu_user_main_thread +
used_cpu_sys_main_thread``) is read before and after each point: divided by the appends,
it is the server's cost per append (samplers included when they run), which caps the
aggregate rate at ``16 * 1e6 / (µs per append)`` rows/s on any machine. Each appender
also reports its own CPU time (``time.process_time()``: every thread of the process), the
client's cost per append. On a small VM the clients compete with the server for the same
cores, so the measured curve mostly shows the client's cost; the server's figure, not the
curve, predicts a machine with a core for every client.

The worker processes are forked once, before any server or connection exists, and serve
every point (starting 18 Python processes that import torch per point would take longer
than the points).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch
from _common import bench_server, load_average, server_banner, server_cpu
from tensordict import TensorDict

from tdstore import TensorDictStore

CAPACITY = 4096
BATCH = 16
N_SAMPLE = 256
SIZES = {"obs": 84 * 84 * 3, "action": 16, "reward": 4}
ROW_BYTES = sum(SIZES.values())
SCHEMA = {"obs": ([84, 84, 3], torch.uint8), "action": ([4], torch.float32), "reward": ([], torch.float32)}
DTYPES = {"obs": torch.uint8, "action": torch.float32, "reward": torch.float32}
MAX_CALLS = 1_000_000  # per process and point: the time limit ends a loop first
GOAL = 0.8  # tdstore rows/s >= 0.8x raw at every N


def _batch(n: int, value: int) -> TensorDict:
    return TensorDict(
        obs=torch.full((n, 84, 84, 3), value % 251, dtype=torch.uint8),
        action=torch.full((n, 4), float(value)),
        reward=torch.full((n,), float(value)),
        batch_size=[n],
    )


# --------------------------------------------------------------------------- #
# worker side: one call of each job kind, prepared once per point
# --------------------------------------------------------------------------- #


def _raw_client(conn: dict[str, Any]) -> Any:
    import redis

    return redis.Redis(**conn)


def _prepare(job: dict[str, Any], seed: int) -> tuple[Any, Any]:
    """Connects for one point; returns (one call, close)."""
    side, role, conn = job["side"], job["role"], job["conn"]
    if side == "tdstore":
        store = TensorDictStore.from_store(td_id=job["td_id"], **conn)
        if role == "append":
            data = _batch(BATCH, seed)
            return (lambda: store.extend(data)), store.close
        gen = torch.Generator().manual_seed(seed)
        return (lambda: store.sample(N_SAMPLE, generator=gen)), store.close
    client = _raw_client(conn)
    prefix = job["prefix"]
    keys = {k: f"{prefix}:{k}" for k in SIZES}
    cursor = f"{prefix}:cursor"
    if role == "append":
        data = _batch(BATCH, seed)
        views = {k: memoryview(data[k].numpy()).cast("B") for k in SIZES}

        def append() -> None:
            end = client.incrby(cursor, BATCH)
            first = (end - BATCH) % CAPACITY
            head = min(BATCH, CAPACITY - first)
            pipe = client.pipeline(transaction=True)
            for k, size in SIZES.items():
                pipe.setrange(keys[k], first * size, views[k][: head * size])
                if head < BATCH:
                    pipe.setrange(keys[k], 0, views[k][head * size :])
            pipe.execute()

        return append, client.close
    gen = torch.Generator().manual_seed(seed)

    def sample() -> dict[str, torch.Tensor]:
        valid = min(int(client.get(cursor) or 0), CAPACITY)
        rows = torch.randint(0, valid, (N_SAMPLE,), generator=gen).tolist()
        pipe = client.pipeline(transaction=True)
        for k, size in SIZES.items():
            for r in rows:
                pipe.getrange(keys[k], r * size, (r + 1) * size - 1)
        replies = pipe.execute()
        out = {}
        for i, k in enumerate(SIZES):
            blob = b"".join(replies[i * N_SAMPLE : (i + 1) * N_SAMPLE])
            out[k] = torch.frombuffer(blob, dtype=DTYPES[k])
        return out

    return sample, client.close


def _worker(pipe: Connection, seed: int) -> None:
    torch.set_num_threads(1)
    while True:
        msg = pipe.recv()
        if msg is None:
            return
        try:
            once, close = _prepare(msg, seed)
            try:
                once()  # untimed: connects, loads scripts, caches the layout
                pipe.send(("ready",))
                go = pipe.recv()
                if go is None:
                    continue
                t_start, seconds = go
                while time.monotonic() < t_start:
                    time.sleep(max(0.0, min(0.001, t_start - time.monotonic())))
                t_end = t_start + seconds
                calls = 0
                times = []
                cpu0 = time.process_time()  # this process, all threads (tdstore's IO thread too)
                now = time.monotonic()
                rate = float(msg.get("rate") or 0.0) if msg.get("role") == "sample" else 0.0
                while now < t_end and calls < MAX_CALLS:
                    if rate:  # a paced sampler: call number k starts at t_start + k / rate
                        due = t_start + calls / rate
                        if due > now:
                            time.sleep(min(due - now, t_end - now))
                            now = time.monotonic()
                            if now >= t_end:
                                break
                    once()
                    calls += 1
                    times.append(time.monotonic() - now)
                    now = time.monotonic()
                cpu = time.process_time() - cpu0
                times.sort()
                p50, p99 = (times[int(q * (len(times) - 1))] if times else float("nan") for q in (0.5, 0.99))
                pipe.send(("done", calls, now, p50, p99, cpu))
            finally:
                close()
        except Exception:  # reported to the parent, which stops the run
            pipe.send(("error", traceback.format_exc()))


class Workers:
    """Forked worker processes (appenders, then samplers), each driven through its own pipe."""

    def __init__(self, count: int) -> None:
        ctx = multiprocessing.get_context("fork")
        self.pipes: list[Connection] = []
        self.procs = []
        for i in range(count):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, 1000 + i), daemon=True)
            proc.start()
            child.close()
            self.pipes.append(parent)
            self.procs.append(proc)

    def _recv(self, pipe: Connection, timeout: float) -> Any:
        if not pipe.poll(timeout):
            raise TimeoutError(f"a benchmark worker did not answer within {timeout:.0f} s")
        msg = pipe.recv()
        if msg[0] == "error":
            raise RuntimeError(f"benchmark worker failed:\n{msg[1]}")
        return msg

    def point(
        self, jobs: dict[int, dict[str, Any]], seconds: float, info: Any
    ) -> tuple[float, dict[int, tuple[Any, ...]], float]:
        """Runs ``jobs[slot]`` on those workers together.

        Returns the start, ``{slot: (calls, end, p50 s, p99 s of a call, CPU s of the process)}`` and
        the server's CPU seconds.
        """
        pipes = {slot: self.pipes[slot] for slot in jobs}
        for slot, pipe in pipes.items():
            pipe.send(jobs[slot])
        for pipe in pipes.values():
            self._recv(pipe, 120)
        cpu0 = server_cpu(info)
        t_start = time.monotonic() + 0.05
        for pipe in pipes.values():
            pipe.send((t_start, seconds))
        outs = {slot: self._recv(pipe, seconds + 120) for slot, pipe in pipes.items()}
        cpu1 = server_cpu(info)
        return t_start, {slot: msg[1:] for slot, msg in outs.items()}, cpu1 - cpu0

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()


# --------------------------------------------------------------------------- #
# parent side
# --------------------------------------------------------------------------- #


def run_point(
    workers: Workers, side: str, n: int, samplers: int, job: dict[str, Any], seconds: float, info: Any
) -> dict[str, Any]:
    """One point: ``n`` appenders (workers 0..n-1) and ``samplers`` samplers (the last workers)."""
    appenders = list(range(n))
    sampling = list(range(len(workers.pipes) - samplers, len(workers.pipes)))
    jobs = {slot: {"side": side, "role": "append", **job} for slot in appenders}
    jobs.update({slot: {"side": side, "role": "sample", **job} for slot in sampling})
    t_start, outs, cpu = workers.point(jobs, seconds, info)
    appends = sum(outs[s][0] for s in appenders)
    wall = max(outs[s][1] for s in appenders) - t_start
    samples = sum(outs[s][0] for s in sampling)
    s_wall = max((outs[s][1] for s in sampling), default=t_start) - t_start

    def ms(role: list[int], q: int) -> float | None:  # each process's p50 / p99 of a call, median over the processes
        return statistics.median(outs[s][q] for s in role) * 1e3 if role else None

    return {
        "side": side, "appenders": n, "samplers": samplers, "appends": appends, "seconds": wall,
        "rows_per_s": appends * BATCH / wall, "server_cpu_s": cpu,
        "server_us_per_append": cpu / appends * 1e6 if appends else float("nan"),
        "client_us_per_append": sum(outs[s][4] for s in appenders) / appends * 1e6 if appends else float("nan"),
        "server_busy": cpu / wall, "samples_per_s": samples / s_wall if samplers and s_wall > 0 else None,
        "append_p50_ms": ms(appenders, 2), "append_p99_ms": ms(appenders, 3),
        "sample_p50_ms": ms(sampling, 2), "sample_p99_ms": ms(sampling, 3),
    }


def _setup(srv: Any, tr: str) -> tuple[dict[str, Any], TensorDictStore, dict[str, str], dict[str, str], Any]:
    """The tdstore ring and the raw keys (both full size, 16 rows appended so samplers have rows)."""
    conn = srv.connection_kwargs(unix=tr == "unix")
    store = TensorDictStore.from_schema(SCHEMA, batch_size=[CAPACITY], **conn)
    store.extend(_batch(BATCH, 0))
    prefix = f"bench:curve:{os.getpid()}:{tr}"
    raw = _raw_client(conn)
    for k, size in SIZES.items():
        raw.setrange(f"{prefix}:{k}", CAPACITY * size - 1, b"\0")
    raw.set(f"{prefix}:cursor", BATCH)
    return conn, store, {"td_id": store.td_id}, {"prefix": prefix}, raw


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over the rounds of one point."""
    out = dict(runs[0])
    for key in ("rows_per_s", "server_us_per_append", "client_us_per_append", "server_busy", "samples_per_s",
                "sample_p99_ms"):
        if runs[0][key] is not None:
            out[key] = statistics.median(r[key] for r in runs)
    return out


def _fmt(x: float | None, spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def _curve(
    workers: Workers, srv: Any, kind: str, tr: str, args: argparse.Namespace, info: Any, results: list[dict[str, Any]]
) -> list[list[str]]:
    """Every point of one server and transport; appends each run to ``results``, returns table rows."""
    conn, store, ours, theirs, raw = _setup(srv, tr)
    table = []
    try:
        flip = False
        for s in args.samplers:
            for n in args.appenders:
                runs: dict[str, list[dict[str, Any]]] = {"tdstore": [], "raw": []}
                sides = [("tdstore", ours), ("raw", theirs)]
                for _ in range(args.rounds):
                    for side, target in sides[::-1] if flip else sides:
                        job = {"conn": conn, "rate": args.sample_rate, **target}
                        runs[side].append(run_point(workers, side, n, s, job, args.seconds, info))
                    flip = not flip
                for side_runs in runs.values():
                    results.extend({"server": kind, "transport": tr, **x} for x in side_runs)
                t, r = _median(runs["tdstore"]), _median(runs["raw"])
                ratio = t["rows_per_s"] / r["rows_per_s"]
                us_t, us_r = t["server_us_per_append"], r["server_us_per_append"]
                table.append([
                    tr, str(s), str(n), _fmt(t["rows_per_s"]), _fmt(r["rows_per_s"]),
                    f"{ratio:.2f}x {'ok' if ratio >= GOAL else 'MISS'}",
                    _fmt(us_t), _fmt(us_r), f"{us_t / us_r:.2f}x",
                    f"{_fmt(BATCH * 1e6 / us_t)} / {_fmt(BATCH * 1e6 / us_r)}",
                    f"{_fmt(t['client_us_per_append'])} / {_fmt(r['client_us_per_append'])}",
                    f"{t['server_busy'] * 100:.0f}% / {r['server_busy'] * 100:.0f}%",
                    f"{_fmt(t['samples_per_s'], '.1f')} / {_fmt(r['samples_per_s'], '.1f')}",
                    f"{_fmt(t['sample_p99_ms'], '.0f')} / {_fmt(r['sample_p99_ms'], '.0f')}",
                ])
                print(f"  {kind} {tr} samplers={s} N={n}: " + " | ".join(table[-1][3:]), flush=True)
    finally:
        store.clear_redis()
        store.close()
        raw.delete(*[f"{theirs['prefix']}:{k}" for k in (*SIZES, "cursor")])
        raw.close()
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="redis,valkey", help="comma-separated kinds (default: redis,valkey)")
    parser.add_argument("--transport", choices=("unix", "tcp", "both"), default="unix")
    parser.add_argument("--appenders", default="1,2,4,8,16", help="numbers of appending processes")
    parser.add_argument("--samplers", default="0,2", help="numbers of sampling processes")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each point (default 2)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each point, tdstore and raw alternating; "
                        "the table gives the medians (default 2)")
    parser.add_argument("--quick", action="store_true", help="one round of 1 s points")
    parser.add_argument("--json", metavar="FILE", help="also write every run's figures to FILE")
    parser.add_argument(
        "--sample-rate", type=float, default=0.0, metavar="R",
        help="pace each sampler at R sample() calls a second, on both sides (default 0: as fast as it can; "
        "on a small machine faster samplers then take CPU from the appenders)",
    )
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.rounds = 1.0, 1
    args.appenders = [int(x) for x in args.appenders.split(",")]
    args.samplers = [int(x) for x in args.samplers.split(",")]
    if min(args.appenders) < 1 or min(args.samplers) < 0 or args.seconds <= 0 or args.rounds < 1 or args.sample_rate < 0:
        parser.error("--appenders must be >= 1, --samplers >= 0, --seconds > 0, --rounds >= 1, --sample-rate >= 0")
    torch.set_num_threads(1)
    # forked before any server, connection or IO thread exists in this process
    workers = Workers(max(args.appenders) + max(args.samplers))
    results: list[dict[str, Any]] = []
    t_run = time.monotonic()
    try:
        for kind in args.servers.split(","):
            with bench_server(kind) as srv:
                banner = server_banner(srv)
                paced = f"; samplers paced at {args.sample_rate:g} calls/s" if args.sample_rate else ""
                print(f"# {banner}; load {load_average()}; {args.rounds} x {args.seconds:g} s a point{paced}", flush=True)
                info = srv.sync_client()
                table: list[list[str]] = []
                try:
                    for tr in ("unix", "tcp") if args.transport == "both" else (args.transport,):
                        table += _curve(workers, srv, kind, tr, args, info, results)
                finally:
                    info.close()
                _print_table(kind, f"{banner}; load at the end {load_average()}", table)
    finally:
        workers.close()
    print(f"\n# whole run: {time.monotonic() - t_run:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            meta = {"seconds": args.seconds, "rounds": args.rounds, "batch": BATCH, "row_bytes": ROW_BYTES}
            json.dump({**meta, "runs": results}, f, indent=1)


def _print_table(kind: str, banner: str, table: list[list[str]]) -> None:
    headers = ["transport", "samplers", "appenders", "tdstore rows/s", "raw rows/s", f"ratio (goal >= {GOAL}x)",
               "server µs/append tdstore", "raw", "ratio",
               "server-bound rows/s tdstore / raw", "client CPU µs/append tdstore / raw", "server busy tdstore / raw", "sample() calls/s tdstore / raw",
               "sample() p99 ms tdstore / raw"]
    print(f"\n### aggregate appends, {kind}\n")
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join("---" if i < 1 else "--:" for i in range(len(headers))) + "|")
    for row in table:
        print("| " + " | ".join(row) + " |")
    print(f"\n{banner}. Rows of {ROW_BYTES:,} B, {BATCH} a call; server µs/append: main-thread CPU (INFO cpu) "
          "over the point / appends (samplers' reads included when they run); server-bound rows/s: "
          f"{BATCH} x 1e6 / µs per append, the rate at which that CPU fills one core; client CPU: the appending "
          "processes' CPU (all threads) / appends; busy: the server's CPU / wall time.")


if __name__ == "__main__":
    main()
