"""Server CPU of candidate append and one-row-read designs (issue 16, goals 1 and 3), raw redis-py.

    python benchmarks/bench_append_candidates.py --servers redis,valkey

Each candidate runs ``--ops`` times on a private server (unix socket) and reports the
server's main-thread CPU per operation (``INFO cpu``, as in ``bench_server_cpu.py``). The
payload is what ``extend()`` of 16 rows moves: obs 16 x 21,168 B, action 16 x 16 B,
reward 16 x 4 B. It isolates what each building block costs the server, so that a design
can be chosen by the numbers before it is written:

* the raw baseline (INCRBY + MULTI of 3 SETRANGEs) and a pipeline of the 3 SETRANGEs;
* an empty script, with no argument and with the 338 KB payload as one ARGV (what
  passing the bytes through Lua costs by itself);
* one script doing the 3 SETRANGEs from ARGV (what extend.lua did before the two steps, less its checks);
* two steps: a tiny reserving script, then a MULTI of the 3 SETRANGEs + a tiny publishing
  script + the layout-version read (the design the issue hints at);
* two steps as ``extend()`` sends them (tdstore/_backend/append.py): WATCH + the
  ``reserve`` script (lua/reserve.lua), then a MULTI of the 3 SETRANGEs, the SETRANGE of
  the rows' written flags, the INCR of the write version and the HINCRBY of the append
  counter;
* one-row reads: a plain GETRANGE, today's read_one.lua-like script (HGET lv + GETRANGE),
  and a MULTI of HGET + GETRANGE.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tdstore._backend.scripts import get_script  # noqa: E402
from tdstore.server import start_server  # noqa: E402

CAP = 4096
SIZES = {"o": 21_168, "a": 16, "r": 4}
ROWS = 16


def server_cpu(client: Any) -> float:
    info = client.info("cpu")
    if "used_cpu_user_main_thread" in info:
        return float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"])
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def run(kind: str, ops: int) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    with start_server(kind) as srv:
        c = srv.sync_client(unix=True)
        payload = {k: bytes([i + 1]) * (ROWS * size) for i, (k, size) in enumerate(SIZES.items())}
        for k, size in SIZES.items():
            c.setrange(k, CAP * size - 1, b"\0")
        c.hset("meta", mapping={"lv": "1"})
        noop = c.script_load("return 1")
        argonly = c.script_load("return #ARGV[1]")
        three = c.script_load(
            "for i = 1, 3 do redis.call('SETRANGE', KEYS[i], ARGV[2 * i], ARGV[2 * i - 1]) end "
            "return redis.call('INCRBY', KEYS[4], 16)"
        )
        tiny = c.script_load("return redis.call('INCRBY', KEYS[1], ARGV[1])")
        read_one = c.script_load("return {redis.call('HGET', KEYS[1], 'lv'), redis.call('GETRANGE', KEYS[2], ARGV[1], ARGV[2])}")

        def measure(name: str, fn: Callable[[int], Any]) -> None:
            for i in range(5):
                fn(i)
            c0 = server_cpu(c)
            for i in range(ops):
                fn(i)
            out.append((name, (server_cpu(c) - c0) / ops * 1e6))

        def first(i: int) -> int:
            return (i * ROWS) % CAP

        def raw(i: int) -> None:
            end = c.incrby("cur", ROWS)
            f = (end - ROWS) % CAP
            p = c.pipeline(transaction=True)
            for k, size in SIZES.items():
                p.setrange(k, f * size, payload[k])
            p.execute()

        def pipelined(i: int) -> None:
            p = c.pipeline(transaction=False)
            for k, size in SIZES.items():
                p.setrange(k, first(i) * size, payload[k])
            p.execute()

        def one_script(i: int) -> None:
            argv: list[Any] = []
            for k, size in SIZES.items():
                argv += [payload[k], str(first(i) * size)]
            c.evalsha(three, 4, "o", "a", "r", "cur2", *argv)

        def two_steps(i: int) -> None:
            end = c.evalsha(tiny, 1, "cur3", ROWS)
            f = (end - ROWS) % CAP
            p = c.pipeline(transaction=True)
            for k, size in SIZES.items():
                p.setrange(k, f * size, payload[k])
            p.evalsha(tiny, 1, "pub", ROWS)
            p.hget("meta", "lv")
            p.execute()

        row = SIZES["o"]
        measure("extend: raw INCRBY + MULTI of 3 SETRANGE", raw)
        measure("extend: pipeline of 3 SETRANGE", pipelined)
        measure("empty script, no ARGV", lambda i: c.evalsha(noop, 0))
        measure("empty script, 338 KB ARGV", lambda i: c.evalsha(argonly, 0, payload["o"]))
        measure("extend: one script, 3 SETRANGE from ARGV", one_script)
        measure("extend: tiny script, MULTI(3 SETRANGE + tiny script + HGET)", two_steps)
        reserve = c.script_load(get_script("reserve").text(False))
        c.hset("t:{s}:meta", mapping={"lv": "1", "fmt": "1"})
        ring_keys = ["t:{s}:meta", "t:{s}:ring", "t:{s}:rf", "t:{s}:fence"]

        conn = c.connection_pool.get_connection()

        def exchange(commands: list[tuple[Any, ...]]) -> list[Any]:
            """One packet, as the direct driver sends it (two in all, as the raw append)."""
            conn.send_packed_command(conn.pack_commands(commands))
            return [conn.read_response() for _ in commands]

        def shipped(i: int) -> None:
            evalsha = ("EVALSHA", reserve, len(ring_keys), *ring_keys, "1", ROWS, CAP, "new", "0", "0")
            f = int(exchange([("WATCH", "t:{s}:meta", "t:{s}:fence"), evalsha])[1][0]) % CAP
            body: list[tuple[Any, ...]] = [("SETRANGE", k, f * size, payload[k]) for k, size in SIZES.items()]
            body += [("SETRANGE", "t:{s}:rf", f, b"\x01" * ROWS), ("INCR", "t:{s}:wv"), ("HINCRBY", "t:{s}:ac", "a:", 1)]
            exchange([("MULTI",), *body, ("EXEC",)])

        measure("extend: WATCH + reserve.lua, MULTI(3 SETRANGE + flags + INCR + HINCRBY)", shipped)
        measure("read1: GETRANGE", lambda i: c.getrange("o", (i % CAP) * row, (i % CAP + 1) * row - 1))
        measure("read1: script HGET lv + GETRANGE", lambda i: c.evalsha(read_one, 2, "meta", "o", (i % CAP) * row, (i % CAP + 1) * row - 1))

        def read_multi(i: int) -> None:
            p = c.pipeline(transaction=True)
            p.hget("meta", "lv")
            p.getrange("o", (i % CAP) * row, (i % CAP + 1) * row - 1)
            p.execute()

        measure("read1: MULTI of HGET lv + GETRANGE", read_multi)
        c.flushall()
        c.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="redis,valkey")
    parser.add_argument("--ops", type=int, default=300)
    args = parser.parse_args()
    for kind in args.servers.split(","):
        print(f"\n### {kind}: server main-thread CPU per op, {args.ops} ops\n")
        print("| candidate | server us/op |\n|---|--:|")
        for name, us in run(kind, args.ops):
            print(f"| {name} | {us:.0f} |")


if __name__ == "__main__":
    main()
