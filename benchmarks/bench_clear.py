"""``clear_redis()`` of a small store on a server that holds many other keys: wall time and
the server's CPU (``INFO cpu``, main thread), against raw redis-py deleting the same keys.

    python benchmarks/bench_clear.py --server redis --others 200000

``clear_redis()`` deletes whatever keys the store has on the server, including keys its
damaged bookkeeping does not know, so it must list them from the server. On one server
that is a SCAN of the whole database, whose cost follows every key of the server. On a
Redis Cluster (3 masters here) it lists the keys of the store's one slot (``CLUSTER
GETKEYSINSLOT``), whose cost follows that slot; the SCAN it replaced is shown too
(``SLOT_LIST_MAX = -1``). The raw baseline is one ``DEL`` of the store's keys, named by a
user who knows them (it finds no debris). Each case creates the store (3 entries, an
append), clears it, and times only the clear; the cases run interleaved, ``--repeat``
rounds; medians.

``--churn`` adds a case where another process keeps changing the store's layout (adds and
deletes an entry, appends rows) while it is cleared: before the two-step clear
(lua/clear.lua's seal), every change made the clear's check stale, and beside 200,000 keys
it gave up after 200 tries (48-55 s). The churner's rate is printed with the table.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from collections.abc import Callable
from typing import Any

import redis
import torch
from _common import server_cpu
from redis.crc import key_slot
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore._backend import lifecycle as _lifecycle
from tdstore.server import start_cluster, start_server
from tdstore.server.cluster import slot_ranges


def _fill(client: redis.Redis, count: int, slots: tuple[int, int] | None) -> None:
    """``count`` other keys (in ``slots``, the node's range, on a cluster node)."""
    pipe = client.pipeline(transaction=False)
    made = i = 0
    while made < count:
        key = f"other:{{{i}}}"
        i += 1
        if slots is not None and not slots[0] <= key_slot(key.encode()) <= slots[1]:
            continue
        pipe.set(key, b"1")
        made += 1
        if made % 5000 == 0:
            pipe.execute()
    pipe.execute()


def _store(conn: dict[str, Any]) -> TensorDictStore:
    store = TensorDictStore.from_schema(
        {"obs": ([8], torch.float32), "action": ([2], torch.float32), "reward": ([], torch.float32)},
        batch_size=[64], td_id="bench-clear", **conn,
    )
    store.extend(TensorDict(obs=torch.ones(4, 8), action=torch.ones(4, 2), reward=torch.ones(4), batch_size=[4]))
    return store


def _measure(node: redis.Redis, conn: dict[str, Any], prepare: Callable[[TensorDictStore], Callable[[], Any]]) -> tuple[float, float]:
    """Creates the store, then times ``prepare(store)()`` (``prepare`` itself is not timed)."""
    store = _store(conn)
    clear = prepare(store)
    cpu0 = server_cpu(node)
    t0 = time.perf_counter()
    clear()
    wall = (time.perf_counter() - t0) * 1e3
    cpu = (server_cpu(node) - cpu0) * 1e3
    if hasattr(clear, "finish"):
        clear.finish()
    store.close()
    assert not list(node.scan_iter(match="*bench-clear*")), "a key of the store was left"
    return wall, cpu


def _tdstore(store: TensorDictStore) -> Callable[[], Any]:
    return store.clear_redis


def _raw_del(node: redis.Redis) -> Callable[[TensorDictStore], Callable[[], Any]]:
    """One DEL of the store's keys, named ahead (listed before the clock starts)."""

    def prepare(store: TensorDictStore) -> Callable[[], Any]:
        keys = list(node.scan_iter(match=store._conn.keys.pattern()))
        return lambda: node.delete(*keys)

    return prepare


def _churn(conn: dict[str, Any], td_id: str, started: Any, rates: Any) -> None:
    """(A process of its own.) Adds and deletes an entry and appends rows until the store is gone."""
    from tdstore import StoreNotFoundError

    store = TensorDictStore.from_store(td_id=td_id, **conn)
    changes, t0 = 0, time.perf_counter()
    try:
        for k in range(1_000_000):
            store["churn"] = torch.zeros(64)
            del store["churn"]
            store.extend(TensorDict(obs=torch.ones(2, 8), action=torch.ones(2, 2), reward=torch.ones(2), batch_size=[2]))
            changes += 2
            if k == 20:
                started.set()
    except StoreNotFoundError:
        pass
    finally:
        started.set()
        rates.put(changes / (time.perf_counter() - t0))
        store.close()


def _under_churn(conn: dict[str, Any], rates: list[float]) -> Callable[[TensorDictStore], Callable[[], Any]]:
    """``clear_redis()`` while another process churns the store's layout (started untimed)."""
    ctx = multiprocessing.get_context("spawn")

    def prepare(store: TensorDictStore) -> Callable[[], Any]:
        started, out = ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=_churn, args=(conn, store.td_id, started, out))
        proc.start()
        if not started.wait(120):
            proc.kill()
            raise RuntimeError("the churner did not start")

        def clear() -> None:
            store.clear_redis()

        def finish() -> None:
            rates.append(out.get(timeout=60))
            proc.join(30)

        clear.finish = finish  # type: ignore[attr-defined]
        return clear

    return prepare


def run(label: str, node: redis.Redis, conn: dict[str, Any], repeat: int, cases: dict[str, Any]) -> list[list[str]]:
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for r in range(repeat + 1):
        for name, (setup, prepare) in cases.items():
            setup()
            got = _measure(node, conn, prepare)
            if r:  # the first round warms up
                results[name].append(got)
    raw_wall = statistics.median(w for w, _ in results["raw DEL"])
    raw_cpu = statistics.median(c for _, c in results["raw DEL"])
    rows = []
    for name, values in results.items():
        wall, cpu = statistics.median(w for w, _ in values), statistics.median(c for _, c in values)
        rows.append([label, name, f"{wall:.2f}", f"{cpu:.2f}", f"{wall / raw_wall:.1f}x", f"{cpu / max(raw_cpu, 1e-3):.1f}x"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=("redis", "valkey"), default="redis")
    parser.add_argument("--others", type=int, default=200_000, help="other keys on the server / the store's node")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--churn", action="store_true", help="add a clear under layout churn from another process")
    args = parser.parse_args()
    rates: list[float] = []
    rows: list[list[str]] = []
    real_max = _lifecycle.SLOT_LIST_MAX

    def slot_listing() -> None:
        _lifecycle.SLOT_LIST_MAX = real_max

    def scan_listing() -> None:
        _lifecycle.SLOT_LIST_MAX = -1

    # one server
    handle = start_server(args.server)
    try:
        node = handle.sync_client()
        _fill(node, args.others, None)
        conn = handle.connection_kwargs()
        raw = _raw_del(node)
        cases: dict[str, Any] = {"clear_redis() (SCAN)": (scan_listing, _tdstore), "raw DEL": (slot_listing, raw)}
        if args.churn:
            cases["clear_redis() under churn"] = (scan_listing, _under_churn(conn, rates))
        rows += run("one server", node, conn, args.repeat, cases)
        node.close()
    finally:
        handle.stop()

    # a 3-master cluster: the store's node holds the other keys
    cluster = start_cluster(3, kind=args.server)
    try:
        conn = cluster.connection_kwargs()
        probe = _store(conn)
        index = cluster.node_of_key(probe._conn.keys.meta)
        probe.clear_redis()
        probe.close()
        node = cluster.node_client(index)
        _fill(node, args.others, slot_ranges(cluster.masters)[index])
        raw = _raw_del(node)
        rows += run("cluster node", node, conn, args.repeat, {
            "clear_redis() (slot listing)": (slot_listing, _tdstore),
            "clear_redis() (SCAN, before)": (scan_listing, _tdstore),
            "raw DEL": (slot_listing, raw),
        })
        node.close()
    finally:
        _lifecycle.SLOT_LIST_MAX = real_max
        cluster.stop()

    print(f"\n{args.server}, {args.others:,} other keys on the server (cluster: on the store's node), "
          f"medians of {args.repeat} rounds\n")
    print("| where | clear | wall ms | server CPU ms | wall / raw | CPU / raw |")
    print("|---|---|--:|--:|--:|--:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if rates:
        print(f"\nchurner: {statistics.median(rates):.0f} layout changes/s (median of {len(rates)} rounds), "
              "each with an append of 2 rows")


if __name__ == "__main__":
    main()
