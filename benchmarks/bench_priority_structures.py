"""Server time of the candidate priority structures (issue 26, item 1): before choosing one.

The candidates are the tree of ``lua/prio_*.lua`` at several arities (children per inner
node): the binary sum tree of the literature (2), and wider trees (8, 16, 32, 64), in each
of its two encodings (``--encodings``): "f64", little-endian doubles packed with the
server's struct library (what enable_priorities chooses on Redis and Valkey), and "text",
fixed-width '%.17g' nodes read with GETRANGE + tonumber (what fakeredis, whose Lua has no
struct, gets). Each is timed through the store's own steps on a ring of 100,000
and of 1,000,000 rows (1-byte rows: the tree's cost does not depend on the rows' size):

* ``sample``: the draw of 256 rows (``tdstore.replay.priorities.draw``: one EVALSHA of
  lua/prio_draw.lua; the rows' read that follows is the uniform sample's own);
* ``update``: the update of 256 random rows (one EVALSHA of lua/prio_update.lua);
* ``append``: the prio_new EVAL an append of 16 rows carries in its MULTI (the append with
  priorities on minus the same append with them off);
* ``build``: enable_priorities() (the tree built once, over every written row).

The time is the server's main-thread CPU (``INFO cpu``: ``used_cpu_user_main_thread +
used_cpu_sys_main_thread``) over many calls, divided by the calls: what the step costs the
server, whatever the client and the transport cost. Before timing, 64 updates of 4,096
random rows give the tree varied priorities.

``--round``: also the wall time of a prioritized ``store.sample(256)`` (draw, read, check)
against a uniform ``store.sample(256)``, on a ring of ``--round-rows`` rows of 21 KB
(obs uint8[84, 84, 3], action, reward), with the default arity.

Usage: ``PYTHONPATH=. python benchmarks/bench_priority_structures.py [--server redis]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from tdstore import TensorDictStore  # noqa: E402
from tdstore.replay import priorities as P  # noqa: E402
from tdstore.server import start_server  # noqa: E402


def server_cpu(client: object) -> float:
    info = client.info("cpu")  # type: ignore[attr-defined]
    if "used_cpu_user_main_thread" in info:
        return float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"])
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def per_call_us(client: object, fn, calls: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    c0 = server_cpu(client)
    for _ in range(calls):
        fn()
    return (server_cpu(client) - c0) / calls * 1e6


def structures(
    kind: str, sizes: list[int], arities: list[int], calls: int, encodings: list[str]
) -> list[tuple[int, int, str, str, float]]:
    out = []
    g = torch.Generator().manual_seed(0)
    with start_server(kind) as srv:
        client = srv.sync_client(unix=True)
        kw = srv.connection_kwargs(unix=True)
        for rows in sizes:
            store = TensorDictStore.from_schema({"x": ([], torch.uint8)}, batch_size=[rows], **kw)
            store.set_ring_total(rows)  # every row written
            one = TensorDict(x=torch.zeros(16, dtype=torch.uint8), batch_size=[16])
            off = per_call_us(client, lambda store=store, one=one: store.extend(one), calls)
            for k, enc in ((k, enc) for k in arities for enc in encodings):
                c0 = server_cpu(client)
                P.enable(store, 0.6, 0.4, arity=k, encoding=enc)
                build = (server_cpu(client) - c0) * 1e6
                for _ in range(64):
                    store.update_priority(torch.randint(0, rows, (4096,), generator=g), torch.rand(4096, generator=g) * 10)
                draw = per_call_us(client, lambda store=store: P.draw(store, 256, generator=g), calls)
                idx = [torch.randint(0, rows, (256,), generator=g) for _ in range(calls + 3)]
                pri = [torch.rand(256, generator=g) * 10 for _ in range(calls + 3)]
                it = iter(range(calls + 3))

                def update(store=store, it=it, idx=idx, pri=pri) -> None:  # type: ignore[no-untyped-def]
                    i = next(it)
                    store.update_priority(idx[i], pri[i])

                upd = per_call_us(client, update, calls)
                on = per_call_us(client, lambda store=store, one=one: store.extend(one), calls)
                report = P.tree_report(store, rel=1e-9)
                assert report["problems"] == [], report["problems"][:3]
                store.disable_priorities()
                for what, us in (("sample 256", draw), ("update 256", upd), ("append 16 (extra)", on - off), ("build", build)):
                    out.append((rows, k, enc, what, us))
                    print(f"{rows:>9} rows  arity {k:>2}  {enc:<4}  {what:<18} {us:>10.1f} us", flush=True)
            store.clear_redis()
            store.close()
        client.close()
    return out


def round_trip(kind: str, rows: int, repeat: int) -> None:
    schema = {"obs": ([84, 84, 3], torch.uint8), "action": ([], torch.int64), "reward": ([], torch.float32)}
    with start_server(kind) as srv:
        client = srv.sync_client(unix=True)
        store = TensorDictStore.from_schema(
            schema, batch_size=[rows], chunk_bytes=64 * 2**20, **srv.connection_kwargs(unix=True)
        )
        chunk = 256
        batch = TensorDict(
            obs=torch.randint(0, 255, (chunk, 84, 84, 3), dtype=torch.uint8), action=torch.zeros(chunk, dtype=torch.int64),
            reward=torch.zeros(chunk), batch_size=[chunk],
        )
        for _ in range(rows // chunk):
            store.extend(batch)
        if rows % chunk:
            store.extend(batch[: rows % chunk])
        store.enable_priorities(alpha=0.6, beta=0.4)
        g = torch.Generator().manual_seed(0)
        for _ in range(16):
            store.update_priority(torch.randint(0, rows, (4096,), generator=g), torch.rand(4096, generator=g))

        def timed(fn) -> tuple[float, float]:  # type: ignore[no-untyped-def]
            for _ in range(3):
                fn()
            walls = []
            c0 = server_cpu(client)
            for _ in range(repeat):
                t0 = time.perf_counter()
                fn()
                walls.append(time.perf_counter() - t0)
            return statistics.median(walls) * 1e3, (server_cpu(client) - c0) / repeat * 1e3

        uni = timed(lambda: store.sample(256, generator=g))
        pri = timed(lambda: store.sample(256, prioritized=True, return_info=True, generator=g))

        def prio_round() -> None:
            _b, info = store.sample(256, prioritized=True, return_info=True, generator=g)
            store.update_priority(info["index"], torch.rand(256, generator=g), generation=info["generation"])

        rnd = timed(prio_round)
        for name, (wall, cpu) in (("uniform sample 256", uni), ("prioritized sample 256", pri), ("prioritized round", rnd)):
            print(f"{rows} rows of 21 KB  {name:<24} wall {wall:7.2f} ms  server CPU {cpu:6.2f} ms", flush=True)
        store.clear_redis()
        store.close()
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="redis", choices=("redis", "valkey", "redis6"))
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--arities", default="2,16,32")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--encodings", default="f64,text", help="tree encodings to time (lua/lib/prio.lua)")
    parser.add_argument("--round", action="store_true")
    parser.add_argument("--round-rows", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes, arities = [int(x) for x in args.sizes.split(",")], [int(x) for x in args.arities.split(",")]
    structures(args.server, sizes, arities, args.calls, args.encodings.split(","))
    if args.round:
        round_trip(args.server, args.round_rows, args.repeat)


if __name__ == "__main__":
    main()
