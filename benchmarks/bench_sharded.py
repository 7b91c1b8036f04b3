"""The sharded ring across Redis Cluster masters: server CPU per operation per master, and the
spread of a mixed load (issue 27, item 2).

Two parts, in one run, on servers this script starts (loopback only):

1. **Cost per operation.** The same ``extend`` of ``--rows`` rows and the same ``sample(256)``
   in ``--rounds`` interleaved rounds (medians reported), on: one standalone server alone;
   three standalone servers taken in turn (appends) or sampled in parallel (samples), the
   load a ShardedStore puts on its masters without the cluster or the ShardedStore; a plain
   :class:`TensorDictStore` on a cluster master; and a 3-master cluster holding a
   :class:`ShardedStore` of 3 shards, one per master, each shard pinned in turn and then the
   shards in turn. Each server's main-thread CPU (``INFO cpu``) is divided by the appends it
   took and by the rows it served (goal: each master within 1.15x of one server). On a
   2-core VM three servers and the client share two cores, and servers taken in turn pay
   for it whoever the client is: the standalone rows show that price apart from tdstore's.
   (A server's idle cost, its cron and the cluster bus, is about 2 ms a second here, under
   1% of these spans: not subtracted.)
2. **Spread.** ``--writers`` writer processes (round-robin over the shards) and ``--samplers``
   sampler processes run for ``--seconds``; each master's CPU share and appended rows are printed
   with ``(max - min) / mean`` (goal: within 15%).

Then the projection: appends/s one master's main thread can take (1 s / its CPU per append)
and the total for 1, 2, 4, 8 and 16 masters. A projection from CPU cost, not a measured curve:
this machine has 2 cores, fewer than the masters and clients of such a curve.

    python benchmarks/bench_sharded.py [--kind valkey] [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
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


class _Cost:
    """Part 1's figures: per case and per server, the main-thread CPU per append and per
    sampled row of every round (medians are reported: this VM's speed drifts)."""

    def __init__(self) -> None:
        self.append: dict[str, list[list[float]]] = {}
        self.row: dict[str, list[list[float]]] = {}

    def add(self, kind: str, case: str, server: int, value: float) -> None:
        table = self.append if kind == "append" else self.row
        rounds = table.setdefault(case, [])
        while len(rounds) <= server:
            rounds.append([])
        rounds[server].append(value)

    def median(self, kind: str, case: str, server: int) -> float:
        table = self.append if kind == "append" else self.row
        return statistics.median(table[case][server])

    def servers(self, kind: str, case: str) -> int:
        return len((self.append if kind == "append" else self.row)[case])

    def worst(self, case: str, kind: str) -> float:
        return max(self.median(kind, case, i) for i in range(self.servers(kind, case)))


def _split(n: int, parts: int) -> list[int]:
    """How many of ``n`` sampled rows each of ``parts`` equal shards gives (a multinomial draw,
    as ShardedStore.sample makes it)."""
    picks = torch.multinomial(torch.ones(parts), n, replacement=True)
    return torch.bincount(picks, minlength=parts).tolist()


def _part1(args: argparse.Namespace, schema: dict[str, Any], batch: Any, alone: list[Any], cluster: Any) -> _Cost:
    """The same appends and samples, in interleaved rounds, on:

    * one standalone server alone (the reference), and three standalone servers taken in
      turn (appends) or sampled in parallel (samples): the load a ShardedStore puts on its
      masters, without the cluster or the ShardedStore. On this 2-core VM three servers and
      the client share two cores, and a server that waits while the others work pays for it
      (colder caches, more wake-ups): this row shows that price apart from tdstore's;
    * one plain store on a cluster master (the cluster's own cost);
    * a ShardedStore of one shard per master, each shard pinned in turn (a master taking a
      steady stream, as under many writers), then the shards in turn, and its ``sample``.
    """
    cost = _Cost()
    clients = [a.sync_client() for a in alone]
    rings = [TensorDictStore.from_schema(schema, batch_size=[args.capacity], **a.connection_kwargs()) for a in alone]
    conn = cluster.connection_kwargs()
    plain = TensorDictStore.from_schema(schema, batch_size=[args.capacity], **conn)
    home = cluster.node_client(cluster.node_of_store(plain.td_id))
    sharded = ShardedStore.from_schema(
        schema, batch_size=[MASTERS * args.capacity], block_rows=args.capacity, td_id=_spread_td_id(cluster), **conn
    )
    nodes = [cluster.node_of_store(b.td_id) for b in sharded.blocks]
    assert sorted(nodes) == list(range(MASTERS)), f"the shards are not one per master: {nodes}"
    masters = [cluster.node_client(i) for i in nodes]  # (in shard order)
    fill = -(-args.capacity // int(batch.batch_size[0]))  # every ring full: samples read whole rings
    for _ in range(fill):
        for store in [*rings, plain, *sharded.blocks]:
            store.extend(batch)
    pool = ThreadPoolExecutor(MASTERS)

    def note(kind: str, case: str, servers: list[Any], before: list[float], ops: Sequence[int]) -> None:
        for i, (a, b) in enumerate(zip(_cpu(servers), before, strict=True)):
            cost.add(kind, case, i, (a - b) / max(1, ops[i]))

    n, calls = args.appends, args.samples
    try:
        for _ in range(args.rounds):
            # appends
            before = _cpu(clients[:1])
            for _ in range(n):
                rings[0].extend(batch)
            note("append", "one server", clients[:1], before, [n])
            before = _cpu(clients)
            for k in range(n * MASTERS):
                rings[k % MASTERS].extend(batch)
            note("append", "servers in turn", clients, before, [n] * MASTERS)
            before = _cpu([home])
            for _ in range(n):
                plain.extend(batch)
            note("append", "cluster plain", [home], before, [n])
            for shard in range(MASTERS):
                before = _cpu(masters)
                for _ in range(n):
                    sharded.extend(batch, shard=shard)
                used = [a - b for a, b in zip(_cpu(masters), before, strict=True)]
                cost.add("append", "sharded pinned", shard, used[shard] / n)
            before = _cpu(masters)
            for _ in range(n * MASTERS):
                sharded.extend(batch)
            note("append", "sharded in turn", masters, before, [n] * MASTERS)
            # samples
            before = _cpu(clients[:1])
            for _ in range(calls):
                rings[0].sample(SAMPLE)
            note("row", "one server", clients[:1], before, [calls * SAMPLE])
            before, served = _cpu(clients), [0] * MASTERS
            for _ in range(calls):
                counts = _split(SAMPLE, MASTERS)
                list(pool.map(lambda i, c=counts: rings[i].sample(c[i]) if c[i] else None, range(MASTERS)))
                served = [s + c for s, c in zip(served, counts, strict=True)]
            note("row", "servers in parallel", clients, before, served)
            before = _cpu([home])
            for _ in range(calls):
                plain.sample(SAMPLE)
            note("row", "cluster plain", [home], before, [calls * SAMPLE])
            before, got = _cpu(masters), torch.zeros(MASTERS, dtype=torch.int64)
            for _ in range(calls):
                _, info = sharded.sample(SAMPLE, return_info=True)
                got += torch.bincount(info["index"] // args.capacity, minlength=MASTERS)
            note("row", "sharded", masters, before, got.tolist())
    finally:
        pool.shutdown()
        sharded.clear_redis()
        sharded.close()
        plain.clear_redis()
        plain.close()
        for ring in rings:
            ring.clear_redis()
            ring.close()
        for client in [*clients, home, *masters]:
            client.close()
    return cost


def _print_part1(cost: _Cost) -> None:
    one_append = cost.median("append", "one server", 0)
    one_row = cost.median("row", "one server", 0)

    def row(label: str, kind: str, case: str, server: int, control: str | None) -> list[str]:
        value = cost.median(kind, case, server)
        ref = one_append if kind == "append" else one_row
        against = cost.median(kind, control, server) if control else None
        digits = 1 if kind == "append" else 2
        return [
            label,
            f"{value * 1e6:.{digits}f}",
            fmt_ratio(value, ref),
            fmt_ratio(value, against) if against else "-",
        ]

    appends = [row("one server, alone", "append", "one server", 0, None)]
    appends += [row(f"server {i} of 3 taken in turn", "append", "servers in turn", i, None) for i in range(MASTERS)]
    appends.append(row("one store on a cluster master", "append", "cluster plain", 0, None))
    appends += [row(f"master {i} (shard {i}) pinned", "append", "sharded pinned", i, None) for i in range(MASTERS)]
    appends += [
        row(f"master {i} (shard {i}) in turn", "append", "sharded in turn", i, "servers in turn")
        for i in range(MASTERS)
    ]
    pinned = cost.worst("sharded pinned", "append")
    in_turn = max(
        cost.median("append", "sharded in turn", i) / cost.median("append", "servers in turn", i)
        for i in range(MASTERS)
    )
    print_table(
        "Server main-thread CPU per append (part 1)",
        ["where", "µs / append", "vs one server", "vs 3 servers in turn"],
        appends,
        notes=[
            f"goal: each master within 1.15x of one server. ShardedStore, worst master: pinned "
            f"{fmt_ratio(pinned, one_append)} of one server alone; shards in turn {in_turn:.2f}x of 3 standalone "
            f"servers taken in turn ({fmt_ratio(cost.worst('sharded in turn', 'append'), one_append)} of one server "
            f"alone, where the standalone servers in turn cost {fmt_ratio(cost.worst('servers in turn', 'append'), one_append)}: "
            "the price of 3 servers and the client sharing this VM's 2 cores, not of the cluster or the ShardedStore)"
        ],
    )
    rows = [row("one server, alone: sample(256)", "row", "one server", 0, None)]
    rows += [row(f"server {i} of 3 sampled in parallel", "row", "servers in parallel", i, None) for i in range(MASTERS)]
    rows.append(row("one store on a cluster master", "row", "cluster plain", 0, None))
    rows += [row(f"master {i} (shard {i})", "row", "sharded", i, "servers in parallel") for i in range(MASTERS)]
    worst = max(cost.median("row", "sharded", i) / cost.median("row", "servers in parallel", i) for i in range(MASTERS))
    print_table(
        "Server main-thread CPU per sampled row of sample(256) (part 1)",
        ["where", "µs / sampled row", "vs one server", "vs 3 servers in parallel"],
        rows,
        notes=[
            f"goal: each master within 1.15x of one server. ShardedStore's sample, worst master: "
            f"{fmt_ratio(cost.worst('sharded', 'row'), one_row)} of one server alone, {worst:.2f}x of 3 standalone "
            "servers sampled in parallel for the same split"
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="valkey", choices=["redis", "valkey"])
    parser.add_argument("--rows", type=int, default=16, help="rows per extend")
    parser.add_argument("--row-bytes", type=int, default=4096)
    parser.add_argument("--capacity", type=int, default=4096, help="rows per shard (and of the single ring)")
    parser.add_argument("--appends", type=int, default=200, help="extends per master per round in part 1")
    parser.add_argument("--samples", type=int, default=40, help="sample(256) calls per round in part 1")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of part 1 (medians reported)")
    parser.add_argument("--writers", type=int, default=6)
    parser.add_argument("--samplers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--quick", action="store_true", help="a small run (the test's)")
    args = parser.parse_args()
    if args.quick:
        args.appends, args.samples, args.rounds, args.writers, args.samplers, args.seconds = 40, 6, 1, 2, 1, 1.5
        args.capacity = 512
    print(
        f"# bench_sharded: {args.kind}, extend of {args.rows} rows of {args.row_bytes} B, sample({SAMPLE}); "
        f"load average {load_average()}"
    )
    schema = _schema(args.row_bytes)
    batch = _rows(args.rows, args.row_bytes, 2.0)

    alone = [start_server(args.kind) for _ in range(MASTERS)]  # standalone servers: the baselines
    cluster = start_cluster(masters=MASTERS, replicas=0, kind=args.kind)
    try:
        # ---- part 1: cost per operation -------------------------------------------------------
        cost = _part1(args, schema, batch, alone, cluster)
        _print_part1(cost)
        conn = cluster.connection_kwargs()

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
        per_append = cost.worst("sharded pinned", "append")
        per_master = 1.0 / per_append
        print_table(
            "Projection: appends/s from server CPU per append (not a measured curve)",
            ["masters", "appends/s", f"rows/s ({args.rows} per append)"],
            [[m, f"{per_master * m:,.0f}", f"{per_master * m * args.rows:,.0f}"] for m in (1, 2, 4, 8, 16)],
            notes=[
                f"one master's main thread at 100%: 1 s / {per_append * 1e6:.1f} µs per append (the worst "
                "shard pinned: a master that takes a steady stream, as under many writers); "
                "the clients and the network must keep up, which this 2-core machine cannot show"
            ],
        )
    finally:
        cluster.stop()
        for server in alone:
            server.stop()


if __name__ == "__main__":
    main()
