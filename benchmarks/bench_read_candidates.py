"""Server CPU of candidate small-read designs (issue 16, goals 1 and 3), raw redis-py.

    python benchmarks/bench_read_candidates.py --servers redis,valkey

The method of ``bench_append_candidates.py``: each candidate runs ``--ops`` times on a
private server (unix socket), ``--rounds`` times in turn with the others, and the server's
main-thread CPU per operation (``INFO cpu``) is reported as the median of the rounds. The
payloads are those of ``bench_server_cpu.py``:

* ``todict32``: 32 strings of 6,400 B (``to_tensordict()`` of 32 leaves of 100 x 16
  float32): the raw pipeline of 32 GETs; the snapshot as tdstore sent it (MULTI of HGETALL of
  the meta hash and the registry, GET of the write version, the 32 GETs); the same under a
  cached layout (HGET of the layout version and the 32 GETs); and one MGET in place of the
  32 GETs, with and without the layout version in the MULTI;
* ``lazy-el``: one element of a lazy stack, three runs of 64-256, 16 and 4 B of three
  strings: the raw MULTI of 3 GETRANGEs; the same with the HGET of the layout version
  (what tdstore sent); one script returning the version and the 3 runs; and the 3 GETRANGEs
  then the HGET pipelined without MULTI (not a consistent snapshot across the strings: for
  reference only);
* ``read1``: one 21,168 B row of a string of obs rows: the raw GETRANGE; GETRANGE, STRLEN
  and the HGET of the layout version in one packet (what ``store[i]`` sends); the same three
  in one script (what it sent before).

Besides each candidate's median µs, the table gives its *paired* ratio to the first
candidate of its workload (the raw form): the median over rounds of the two figures of the
same round. ``--pin`` puts the server on CPU 0 and this process on the others (see
``bench_server_cpu.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tdstore.server import start_server  # noqa: E402

_CPUS = sorted(os.sched_getaffinity(0))

LEAF = 100 * 16 * 4
N_LEAVES = 32
ELEMENT_RUNS = ((4 * 432, 4 * 40), (16 * 432, 16), (4 * 432, 4))  # (offset, length) in obs, action, reward

OBS_ROW = 84 * 84 * 3
OBS_ROWS = 256
READ_ONE_LUA = """
return {redis.call('HGET', KEYS[1], 'lv'), redis.call('GETRANGE', KEYS[2], ARGV[1], ARGV[2]),
        redis.call('STRLEN', KEYS[2])}
"""

READ_RUNS_LUA = """
local out = {redis.call('HGET', KEYS[1], 'lv')}
for i = 2, #KEYS do
  out[i] = redis.call('GETRANGE', KEYS[i], ARGV[2 * i - 3], ARGV[2 * i - 2])
end
return out
"""


def server_cpu(client: Any) -> float:
    info = client.info("cpu")
    if "used_cpu_user_main_thread" in info:
        return float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"])
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def run(kind: str, ops: int, rounds: int, pin: bool) -> list[tuple[str, float, float]]:
    with start_server(kind) as srv:
        if pin and srv.pid is not None and len(_CPUS) > 1:
            for tid in os.listdir(f"/proc/{srv.pid}/task"):
                os.sched_setaffinity(int(tid), {_CPUS[0]})
            os.sched_setaffinity(0, set(_CPUS[1:]))
        c = srv.sync_client(unix=True)
        meta, reg, wv = "s:{t}:meta", "s:{t}:reg", "s:{t}:wv"
        leaves = [f"s:{{t}}:d:k{i}" for i in range(N_LEAVES)]
        c.hset(meta, mapping={"lv": "123456", "fmt": "1", "lock": "0", "ne": str(N_LEAVES), "batch_size": "[100]",
                              "created": "1764600000000"})
        for i, key in enumerate(leaves):
            c.set(key, bytes([i]) * LEAF)
            c.hset(reg, f"k{i}", f'{{"k":"t","dtype":"float32","shape":[100,16],"o":[1,{i}]}}')
        c.set(wv, "7")
        lazy = ["s:{t}:d:obs", "s:{t}:d:action", "s:{t}:d:reward"]
        for key, (off, size) in zip(lazy, ELEMENT_RUNS, strict=True):
            c.set(key, b"\1" * (off * 2 + size))
        obs = "s:{t}:d:o"
        c.set(obs, b"\1" * (OBS_ROW * OBS_ROWS))
        row = 123 * OBS_ROW
        read_one = c.script_load(READ_ONE_LUA)
        conn = c.connection_pool.get_connection()

        def exchange(commands: list[tuple[Any, ...]]) -> list[Any]:
            conn.send_packed_command(conn.pack_commands(commands))  # one packet
            return [conn.read_response() for _ in commands]

        script = c.script_load(READ_RUNS_LUA)
        runs_argv = [str(x) for off, size in ELEMENT_RUNS for x in (off, off + size - 1)]

        def pipe_of(transaction: bool, queue: Callable[[Any], None]) -> Callable[[], Any]:
            def go() -> Any:
                with c.pipeline(transaction=transaction) as p:
                    queue(p)
                    return p.execute()

            return go

        def gets(p: Any) -> None:
            for key in leaves:
                p.get(key)

        def full(p: Any) -> None:
            p.hgetall(meta)
            p.hgetall(reg)
            p.get(wv)
            gets(p)

        def lv_gets(p: Any) -> None:
            p.hget(meta, "lv")
            gets(p)

        def lv_mget(p: Any) -> None:
            p.hget(meta, "lv")
            p.mget(leaves)

        def getranges(p: Any) -> None:
            for key, (off, size) in zip(lazy, ELEMENT_RUNS, strict=True):
                p.getrange(key, off, off + size - 1)

        def lv_getranges(p: Any) -> None:
            p.hget(meta, "lv")
            getranges(p)

        def getranges_lv(p: Any) -> None:
            getranges(p)
            p.hget(meta, "lv")

        candidates: list[tuple[str, Callable[[], Any]]] = [
            ("todict32: raw pipeline of 32 GET", pipe_of(False, gets)),
            ("todict32: MULTI(HGETALL meta, HGETALL reg, GET wv, 32 GET) (tdstore before)", pipe_of(True, full)),
            ("todict32: MULTI(HGET lv, 32 GET)", pipe_of(True, lv_gets)),
            ("todict32: MULTI(HGET lv, MGET of 32)", pipe_of(True, lv_mget)),
            ("todict32: MGET of 32 (no version)", lambda: c.mget(leaves)),
            ("lazy-el: raw MULTI(3 GETRANGE)", pipe_of(True, getranges)),
            ("lazy-el: MULTI(HGET lv, 3 GETRANGE) (tdstore before)", pipe_of(True, lv_getranges)),
            ("lazy-el: script(HGET lv, 3 GETRANGE)", lambda: c.evalsha(script, 4, meta, *lazy, *runs_argv)),
            ("lazy-el: pipeline 3 GETRANGE + HGET lv (not one step)", pipe_of(False, getranges_lv)),
            ("read1: raw GETRANGE", lambda: c.getrange(obs, row, row + OBS_ROW - 1)),
            ("read1: one packet of GETRANGE, STRLEN, HGET lv (tdstore)",
             lambda: exchange([("GETRANGE", obs, row, row + OBS_ROW - 1), ("STRLEN", obs), ("HGET", meta, "lv")])),
            ("read1: script(HGET lv, GETRANGE, STRLEN) (tdstore before)",
             lambda: c.evalsha(read_one, 2, meta, obs, row, row + OBS_ROW - 1)),
        ]
        per: dict[str, list[float]] = {name: [] for name, _ in candidates}
        for _name, fn in candidates:  # warm up
            for _ in range(20):
                fn()
        for r in range(rounds):
            order = candidates if r % 2 == 0 else candidates[::-1]
            for name, fn in order:
                c0 = server_cpu(c)
                for _ in range(ops):
                    fn()
                per[name].append((server_cpu(c) - c0) / ops * 1e6)
        c.connection_pool.release(conn)
        c.flushall()
        c.close()
    out = []
    for name, v in per.items():
        base = per[next(n for n in per if n.split(":")[0] == name.split(":")[0])]
        out.append((name, statistics.median(v), statistics.median(a / b for a, b in zip(v, base, strict=True))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="redis,valkey")
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pin", action="store_true", help="server on CPU 0, this process on the others")
    args = parser.parse_args()
    for kind in args.servers.split(","):
        print(f"\n### {kind}: server main-thread CPU per op, median of {args.rounds} rounds of {args.ops} ops"
              f"{', pinned' if args.pin else ''}\n")
        print("| candidate | server us/op | paired ratio to the raw form |\n|---|--:|--:|")
        for name, us, ratio in run(kind, args.ops, args.rounds, args.pin):
            print(f"| {name} | {us:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
