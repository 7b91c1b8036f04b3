"""The sharded ring across Redis Cluster masters: server CPU per operation per master, and the
spread of a mixed load (issue 27, item 2).

Two parts, in one run, on servers this script starts (loopback only):

1. **Cost per operation.** The same ``extend`` of ``--rows`` rows and the same ``sample(256)``,
   first on one server (a :class:`TensorDictStore` ring), then on a 3-master cluster (a
   :class:`ShardedStore` of 3 shards, one per master). Each master's main-thread CPU (``INFO
   cpu``) is divided by the appends that master took, and by the rows of the samples it served;
   the ratios to the single server are printed (goal: each within 1.15x).
2. **Spread.** ``--writers`` writer processes (round-robin over the shards) and ``--samplers``
   sampler processes run for ``--seconds``; each master's CPU share and appended rows are printed
   with ``(max - min) / mean`` (goal: within 15%).

Each server's idle main-thread CPU (its cron; in a cluster also the cluster bus) is measured
for a second first and subtracted from part 1's spans.

Then the projection: appends/s one master's main thread can take (1 s / its CPU per append)
and the total for 1, 2, 4, 8 and 16 masters. A projection from CPU cost, not a measured curve:
this machine has 2 cores, fewer than the masters and clients of such a curve.

    python benchmarks/bench_sharded.py [--kind valkey] [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
import uuid
from typing import Any

import torch
from _common import fmt_ratio, load_average, print_table, server_cpu

from tdstore import ShardedStore, TensorDictStore
from tdstore.server import start_cluster, start_server

MASTERS = 3
SAMPLE = 256


def _schema(row_bytes: int) -> dict[str, Any]:
    return {"obs": ([row_bytes // 4], torch.float32)}


def _rows(n: int, row_bytes: int, value: float) -> Any:
    from tensordict import TensorDict

    return TensorDict(obs=torch.full((n, row_bytes // 4), value), batch_size=[n])


def _writer(conn: dict[str, Any], td_id: str, rows: int, row_bytes: int, start: float, seconds: float) -> int:
    store = ShardedStore.from_store(td_id=td_id, **conn)
    batch = _rows(rows, row_bytes, 1.0)
    time.sleep(max(0.0, start - time.time()))
    done, end = 0, time.time() + seconds
    while time.time() < end:
        store.extend(batch)
        done += 1
    store.close()
    return done


def _sampler(conn: dict[str, Any], td_id: str, start: float, seconds: float) -> int:
    store = ShardedStore.from_store(td_id=td_id, **conn)
    time.sleep(max(0.0, start - time.time()))
    done, end = 0, time.time() + seconds
    while time.time() < end:
        store.sample(SAMPLE)
        done += 1
    store.close()
    return done


def _spread_td_id(cluster: Any) -> str:
    """A td_id whose shard stores land one per master. (ShardedStore names its blocks
    ``<td_id>.b<i>`` and does not choose their hash slots yet: with 3 blocks on 3 masters a
    random id spreads them in 2 of 9 cases. docs/deployment.md says so.)"""
    for _ in range(1000):
        td_id = str(uuid.uuid4())
        if sorted(cluster.node_of_store(f"{td_id}.b{i}") for i in range(MASTERS)) == list(range(MASTERS)):
            return td_id
    raise RuntimeError("found no td_id whose blocks land one per master")


def _cpu(clients: list[Any]) -> list[float]:
    return [server_cpu(c) for c in clients]


def _idle_rates(clients: list[Any], seconds: float = 1.0) -> list[float]:
    """Each server's main-thread CPU per second while no client works: its cron and, in a
    cluster, the cluster bus. Subtracted from the measurements below."""
    before, t0 = _cpu(clients), time.monotonic()
    time.sleep(seconds)
    after, elapsed = _cpu(clients), time.monotonic() - t0
    return [(a - b) / elapsed for a, b in zip(after, before, strict=True)]


class _Meter:
    """Main-thread CPU of ``clients`` over a span, less their idle rate over it."""

    def __init__(self, clients: list[Any]) -> None:
        self.clients = clients
        self.idle = _idle_rates(clients)

    def __enter__(self) -> _Meter:
        self.before, self.t0 = _cpu(self.clients), time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        elapsed = time.monotonic() - self.t0
        self.used = [
            max(0.0, a - b - r * elapsed) for a, b, r in zip(_cpu(self.clients), self.before, self.idle, strict=True)
        ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="valkey", choices=["redis", "valkey"])
    parser.add_argument("--rows", type=int, default=16, help="rows per extend")
    parser.add_argument("--row-bytes", type=int, default=4096)
    parser.add_argument("--capacity", type=int, default=4096, help="rows per shard (and of the single ring)")
    parser.add_argument("--appends", type=int, default=600, help="extends per master in part 1")
    parser.add_argument("--samples", type=int, default=100, help="sample(256) calls in part 1")
    parser.add_argument("--writers", type=int, default=6)
    parser.add_argument("--samplers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--quick", action="store_true", help="a small run (the test's)")
    args = parser.parse_args()
    if args.quick:
        args.appends, args.samples, args.writers, args.samplers, args.seconds = 60, 10, 2, 1, 1.5
        args.capacity = 512
    print(
        f"# bench_sharded: {args.kind}, extend of {args.rows} rows of {args.row_bytes} B, sample({SAMPLE}); "
        f"load average {load_average()}"
    )
    schema = _schema(args.row_bytes)
    batch = _rows(args.rows, args.row_bytes, 2.0)

    single = start_server(args.kind)
    cluster = start_cluster(masters=MASTERS, replicas=0, kind=args.kind)
    try:
        # ---- part 1: cost per operation -------------------------------------------------------
        client = single.sync_client()
        ring = TensorDictStore.from_schema(schema, batch_size=[args.capacity], **single.connection_kwargs())
        for _ in range(20):
            ring.extend(batch)
        meter = _Meter([client])
        with meter:
            for _ in range(args.appends):
                ring.extend(batch)
        single_append = meter.used[0] / args.appends
        with meter:
            for _ in range(args.samples):
                ring.sample(SAMPLE)
        single_row = meter.used[0] / (args.samples * SAMPLE)
        ring.clear_redis()
        ring.close()
        client.close()

        conn = cluster.connection_kwargs()
        # one plain store on a cluster master: the cluster's own cost, apart from the sharding
        plain = TensorDictStore.from_schema(schema, batch_size=[args.capacity], **conn)
        home = cluster.node_client(cluster.node_of_store(plain.td_id))
        for _ in range(20):
            plain.extend(batch)
        meter = _Meter([home])
        with meter:
            for _ in range(args.appends):
                plain.extend(batch)
        plain_append = meter.used[0] / args.appends
        with meter:
            for _ in range(args.samples):
                plain.sample(SAMPLE)
        plain_row = meter.used[0] / (args.samples * SAMPLE)
        plain.clear_redis()
        plain.close()
        home.close()
        sharded = ShardedStore.from_schema(
            schema, batch_size=[MASTERS * args.capacity], block_rows=args.capacity, td_id=_spread_td_id(cluster), **conn
        )
        nodes = [cluster.node_of_store(b.td_id) for b in sharded.blocks]
        assert sorted(nodes) == list(range(MASTERS)), f"the shards are not one per master: {nodes}"
        masters = [cluster.node_client(i) for i in nodes]  # (in shard order)
        for _ in range(20 * MASTERS):
            sharded.extend(batch)
        meter = _Meter(masters)
        with meter:
            for _ in range(args.appends * MASTERS):
                sharded.extend(batch)  # (the shards in turn: args.appends each)
        per_append = [u / args.appends for u in meter.used]
        served = torch.zeros(MASTERS, dtype=torch.int64)
        with meter:
            for _ in range(args.samples):
                _, info = sharded.sample(SAMPLE, return_info=True)
                served += torch.bincount(info["index"] // args.capacity, minlength=MASTERS)
        per_row = [u / max(1, int(s)) for u, s in zip(meter.used, served.tolist(), strict=True)]
        rows = [
            [
                f"master {i} (shard {i})",
                f"{per_append[i] * 1e6:.1f}",
                fmt_ratio(per_append[i], single_append),
                f"{per_row[i] * 1e6:.2f}",
                fmt_ratio(per_row[i], single_row),
            ]
            for i in range(MASTERS)
        ]
        rows.insert(0, ["one server", f"{single_append * 1e6:.1f}", "1.00x", f"{single_row * 1e6:.2f}", "1.00x"])
        rows.insert(
            1,
            [
                "one store on a cluster master",
                f"{plain_append * 1e6:.1f}",
                fmt_ratio(plain_append, single_append),
                f"{plain_row * 1e6:.2f}",
                fmt_ratio(plain_row, single_row),
            ],
        )
        print_table(
            "Server main-thread CPU per operation (part 1)",
            ["server", "µs / append", "vs one server", "µs / sampled row", "vs one server"],
            rows,
            notes=[
                f"goal: each master within 1.15x of one server; worst append {fmt_ratio(max(per_append), single_append)}, "
                f"worst sampled row {fmt_ratio(max(per_row), single_row)}"
            ],
        )
        sharded.clear_redis()
        sharded.close()

        # ---- part 2: the spread of a mixed load -----------------------------------------------
        sharded = ShardedStore.from_schema(
            schema, batch_size=[MASTERS * args.capacity], block_rows=args.capacity, td_id=_spread_td_id(cluster), **conn
        )
        nodes = [cluster.node_of_store(b.td_id) for b in sharded.blocks]
        masters = [cluster.node_client(i) for i in nodes]
        for _ in range(4 * MASTERS):
            sharded.extend(batch)  # (the samplers never find the ring empty)
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(args.writers + args.samplers) as pool:
            start = time.time() + 3.0  # (the workers import torch first)
            jobs = [
                pool.apply_async(_writer, (conn, sharded.td_id, args.rows, args.row_bytes, start, args.seconds))
                for _ in range(args.writers)
            ]
            jobs += [
                pool.apply_async(_sampler, (conn, sharded.td_id, start, args.seconds)) for _ in range(args.samplers)
            ]
            time.sleep(max(0.0, start - time.time()))
            before = _cpu(masters)
            counts = [j.get(timeout=args.seconds + 120) for j in jobs]
            after = _cpu(masters)
        used = [
            a - b for a, b in zip(after, before, strict=True)
        ]  # (idle cost included: it is the same on every master)
        appended = [b.ring_state().total for b in sharded.blocks]
        mean = sum(used) / MASTERS
        spread = (max(used) - min(used)) / mean if mean > 0 else float("inf")
        rows = [[f"master {i}", f"{used[i]:.3f}", f"{used[i] / sum(used):.1%}", appended[i]] for i in range(MASTERS)]
        print_table(
            f"{args.writers} writers and {args.samplers} samplers for {args.seconds:g} s (part 2)",
            ["server", "main-thread CPU s", "share", "rows appended"],
            rows,
            notes=[
                f"appends={sum(counts[: args.writers])} samples={sum(counts[args.writers :])}; "
                f"spread (max - min) / mean = {spread:.1%} (goal: within 15%)"
            ],
        )
        sharded.clear_redis()
        sharded.close()
        for m in masters:
            m.close()

        # ---- the projection ------------------------------------------------------------------
        per_master = 1.0 / max(per_append)
        print_table(
            "Projection: appends/s from server CPU per append (not a measured curve)",
            ["masters", "appends/s", f"rows/s ({args.rows} per append)"],
            [[m, f"{per_master * m:,.0f}", f"{per_master * m * args.rows:,.0f}"] for m in (1, 2, 4, 8, 16)],
            notes=[
                f"one master's main thread at 100%: 1 s / {max(per_append) * 1e6:.1f} µs per append; "
                "the clients and the network must keep up, which this 2-core machine cannot show"
            ],
        )
    finally:
        cluster.stop()
        single.stop()


if __name__ == "__main__":
    main()
