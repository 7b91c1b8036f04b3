"""Server CPU per operation (issue 16): tdstore against raw redis-py moving the same bytes.

    python benchmarks/bench_server_cpu.py --server redis            # one server kind
    python benchmarks/bench_server_cpu.py --server both --quick     # Redis 7 and Valkey 8, short

The server runs commands on one thread, so the CPU time its main thread spends per
operation caps every client at once. For each workload this runs ``--ops`` operations of
tdstore, then the same number of the raw redis-py form (the same bytes, the same server
and transport, same run), and reads ``INFO cpu`` before and after each batch:
``used_cpu_user_main_thread + used_cpu_sys_main_thread`` (``used_cpu_user + used_cpu_sys``
where a server lacks the main-thread fields). That covers reading the request, running it
and writing the reply, unlike ``INFO commandstats`` (which counts a command inside
MULTI/EXEC or a script twice and leaves out parsing and socket work). ``--rounds`` batches
of each alternate; the table gives the median per-op figure of the rounds, their ratio, and
the *paired* ratio: the median over rounds of the round's tdstore figure over the raw figure
of the batch run next to it. On a shared VM whose speed drifts by 2-3x between seconds, the
paired ratio compares batches that ran under the same conditions; many short rounds (e.g.
``--ops 300 --rounds 20``) make it steady.

``--pin`` puts the server's threads on CPU 0 and this process on the others, as on a machine
where the server has a core of its own. Unpinned on a small VM, the scheduler sometimes runs
client and server on one vCPU (a wake-up is cheap) and sometimes on two (a wake-up costs the
hypervisor an interrupt): one batch's server µs per op then differs from the next by 2-3x for
the same commands, depending on where the threads landed rather than on what was sent.

Wall time is the median of the per-op times of all batches (tdstore from this thread, so
it pays the hop to its IO loop; raw awaited inside its own loop, see ``_common.RawRedis``).

Workloads (obs rows: 84x84x3 uint8 = 21,168 B; small rows: 64 float32 + 4 float32 + 1 float32):

* extend16:   ``store.extend(td)`` of 16 rows (obs + action + reward)  vs INCRBY + MULTI of SETRANGEs
* read1:      ``store[i]`` of a 1-entry obs store                      vs one GETRANGE
* sample-sm:  ``store[idx]``, 256 random small rows, 3 entries        vs one Lua gather per entry (one pipeline)
* sample-lg:  ``store[idx]``, 256 random obs rows                     vs MULTI of 256 GETRANGEs
* write-lg:   ``store[idx] = td``, 256 random obs rows                 vs MULTI of 256 SETRANGEs
* slice-rd:   ``store[64:128]`` of the obs store                       vs one GETRANGE
* slice-wr:   ``store[64:128] = td``                                   vs one SETRANGE
* todict32:   ``to_tensordict()`` of 32 leaves of 100 x 16 float32     vs a pipeline of 32 GETs
* lazy-el:    ``lazy[j]`` of a lazy stack (ragged obs, action, reward) vs MULTI of 3 GETRANGEs
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import (
    GATHER_LUA,
    RawRedis,
    base_parser,
    bench_server,
    byte_view,
    load_average,
    parse,
    print_table,
    server_banner,
    server_cpu,
    transports,
)
from tensordict import LazyStackedTensorDict, TensorDict

from tdstore import LazyStackedTensorDictStore, TensorDictStore

OBS = (84, 84, 3)
OBS_ROW = 84 * 84 * 3
CAPACITY = 4096
SMALL_ROWS = 10_000
N_SAMPLE = 256



class Case:
    """One workload: a tdstore callable and a raw coroutine function, with a label each."""

    def __init__(self, name: str, ours: Callable[[], Any], raw: Callable[[Any], Any], raw_label: str) -> None:
        self.name, self.ours, self.raw, self.raw_label = name, ours, raw, raw_label


_CPUS = sorted(os.sched_getaffinity(0))  # before pin() narrows this process's


def pin(server_pid: int | None) -> str:
    """The server's threads on CPU 0, this process (the threads it starts after this call) on the
    other CPUs it may use; returns a note for the banner."""
    cpus = _CPUS
    if server_pid is None or len(cpus) < 2:
        return "not pinned (needs a server process and two CPUs)"
    for tid in os.listdir(f"/proc/{server_pid}/task"):
        os.sched_setaffinity(int(tid), {cpus[0]})
    os.sched_setaffinity(0, set(cpus[1:]))
    return f"server on CPU {cpus[0]}, clients on CPU {','.join(map(str, cpus[1:]))}"


def run_case(case: Case, raw: RawRedis, tr: str, info_client: Any, ops: int, rounds: int) -> dict[str, Any]:
    """Alternates batches of ``ops`` tdstore and raw operations; per-op server CPU and wall time."""
    client = raw.clients[tr]

    def ours_batch() -> list[float]:
        times = []
        for _ in range(ops):
            t0 = time.perf_counter()
            case.ours()
            times.append(time.perf_counter() - t0)
        return times

    async def raw_batch() -> list[float]:
        times = []
        for _ in range(ops):
            t0 = time.perf_counter()
            await case.raw(client)
            times.append(time.perf_counter() - t0)
        return times

    # warm up both (scripts loaded, layouts cached, connections open)
    for _ in range(3):
        case.ours()
        raw.run(case.raw(client))
    cpu: dict[str, list[float]] = {"ours": [], "raw": []}
    wall: dict[str, list[float]] = {"ours": [], "raw": []}
    for r in range(rounds):
        order = ("ours", "raw") if r % 2 == 0 else ("raw", "ours")
        for who in order:
            c0 = server_cpu(info_client)
            times = ours_batch() if who == "ours" else raw.run(raw_batch())
            c1 = server_cpu(info_client)
            cpu[who].append((c1 - c0) / ops)
            wall[who].extend(times)
    paired = [o / r for o, r in zip(cpu["ours"], cpu["raw"], strict=True) if r > 0]
    return {
        "cpu_paired": statistics.median(paired) if paired else float("nan"),
        "cpu_ours": statistics.median(cpu["ours"]), "cpu_raw": statistics.median(cpu["raw"]),
        "wall_ours": statistics.median(wall["ours"]), "wall_raw": statistics.median(wall["raw"]),
    }


def _obs_batch(n: int, value: int) -> TensorDict:
    return TensorDict(
        obs=torch.full((n, *OBS), value % 251, dtype=torch.uint8),
        action=torch.full((n, 4), float(value)),
        reward=torch.full((n,), float(value)),
        batch_size=[n],
    )


def build_cases(srv: Any, raw: RawRedis, tr: str, stores: list[Any], which: set[str] | None) -> list[Case]:
    conn = srv.connection_kwargs(unix=tr == "unix")
    gen = torch.Generator().manual_seed(0)
    cases: list[Case] = []

    def want(name: str) -> bool:
        return which is None or name in which

    def keep(store: Any) -> Any:
        stores.append(store)
        return store

    # ---- extend of 16 rows
    if want("extend16"):
        ring = keep(TensorDictStore.from_schema(
            {"obs": (list(OBS), torch.uint8), "action": ([4], torch.float32), "reward": ([], torch.float32)},
            batch_size=[CAPACITY], **conn,
        ))
        batch = _obs_batch(16, 7)
        sizes = {"obs": OBS_ROW, "action": 16, "reward": 4}
        views = {k: byte_view(batch[k]) for k in sizes}
        rkeys = {k: raw.key(f"{tr}:ring:{k}") for k in sizes}
        cur = raw.key(f"{tr}:ring:cursor")
        for k, size in sizes.items():
            raw.call(tr, lambda c, k=k, size=size: c.setrange(rkeys[k], CAPACITY * size - 1, b"\0"))

        async def raw_extend(c: Any) -> None:
            end = await c.incrby(cur, 16)
            first = (end - 16) % CAPACITY
            head = min(16, CAPACITY - first)
            async with c.pipeline(transaction=True) as pipe:
                for k, size in sizes.items():
                    pipe.setrange(rkeys[k], first * size, views[k][: head * size])
                    if head < 16:
                        pipe.setrange(rkeys[k], 0, views[k][head * size :])
                await pipe.execute()

        cases.append(Case("extend16", lambda: ring.extend(batch), raw_extend, "INCRBY + MULTI of SETRANGEs"))

    # ---- a 1-entry obs store: one-row read, large-row sample and write, slices
    if want("read1") or want("sample-lg") or want("write-lg") or want("slice-rd") or want("slice-wr"):
        obs = torch.randint(0, 255, (CAPACITY, *OBS), dtype=torch.uint8, generator=gen)
        ostore = keep(TensorDictStore.from_tensordict(TensorDict(obs=obs, batch_size=[CAPACITY]), **conn))
        okey = raw.key(f"{tr}:obs")
        raw.call(tr, lambda c: c.set(okey, byte_view(obs)))
        idx = torch.randint(0, CAPACITY, (N_SAMPLE,), generator=gen)
        rows = idx.tolist()
        one = 1234
        new_rows = TensorDict(obs=torch.randint(0, 255, (N_SAMPLE, *OBS), dtype=torch.uint8, generator=gen),
                              batch_size=[N_SAMPLE])
        new_views = [byte_view(new_rows["obs"][i]) for i in range(N_SAMPLE)]
        slice_td = TensorDict(obs=obs[64:128].clone(), batch_size=[64])
        slice_view = byte_view(slice_td["obs"])

        async def raw_read1(c: Any) -> Any:
            return torch.frombuffer(await c.getrange(okey, one * OBS_ROW, (one + 1) * OBS_ROW - 1), dtype=torch.uint8)

        async def raw_sample_lg(c: Any) -> Any:
            async with c.pipeline(transaction=True) as pipe:
                for r in rows:
                    pipe.getrange(okey, r * OBS_ROW, (r + 1) * OBS_ROW - 1)
                return await pipe.execute()

        async def raw_write_lg(c: Any) -> Any:
            async with c.pipeline(transaction=True) as pipe:
                for r, v in zip(rows, new_views, strict=True):
                    pipe.setrange(okey, r * OBS_ROW, v)
                return await pipe.execute()

        async def raw_slice_rd(c: Any) -> Any:
            return torch.frombuffer(await c.getrange(okey, 64 * OBS_ROW, 128 * OBS_ROW - 1), dtype=torch.uint8)

        async def raw_slice_wr(c: Any) -> Any:
            return await c.setrange(okey, 64 * OBS_ROW, slice_view)

        def ours_write_lg() -> None:
            ostore[idx] = new_rows

        def ours_slice_wr() -> None:
            ostore[64:128] = slice_td

        for name, ours, rawf, label in (
            ("read1", lambda: ostore[one], raw_read1, "one GETRANGE"),
            ("sample-lg", lambda: ostore[idx], raw_sample_lg, "MULTI of 256 GETRANGEs"),
            ("write-lg", ours_write_lg, raw_write_lg, "MULTI of 256 SETRANGEs"),
            ("slice-rd", lambda: ostore[64:128], raw_slice_rd, "one GETRANGE (64 rows)"),
            ("slice-wr", ours_slice_wr, raw_slice_wr, "one SETRANGE (64 rows)"),
        ):
            if want(name):
                cases.append(Case(name, ours, rawf, label))

    # ---- sample of 256 small rows of 3 entries
    if want("sample-sm"):
        small = TensorDict(
            obs=torch.randn(SMALL_ROWS, 64, generator=gen), action=torch.randn(SMALL_ROWS, 4, generator=gen),
            reward=torch.randn(SMALL_ROWS, generator=gen), batch_size=[SMALL_ROWS],
        )
        sstore = keep(TensorDictStore.from_tensordict(small, **conn))
        skeys = {k: raw.key(f"{tr}:small:{k}") for k in ("obs", "action", "reward")}
        ssize = {"obs": 256, "action": 16, "reward": 4}
        for k in skeys:
            raw.call(tr, lambda c, k=k: c.set(skeys[k], byte_view(small[k])))
        sha = raw.call(tr, lambda c: c.script_load(GATHER_LUA))
        sidx = torch.randint(0, SMALL_ROWS, (N_SAMPLE,), generator=gen)
        srows = [str(r) for r in sidx.tolist()]

        async def raw_gather(c: Any) -> Any:
            async with c.pipeline(transaction=False) as pipe:
                for k in skeys:
                    pipe.evalsha(sha, 1, skeys[k], str(ssize[k]), *srows)
                return await pipe.execute()

        cases.append(Case("sample-sm", lambda: sstore[sidx], raw_gather, "Lua gather per entry, one pipeline"))

    # ---- to_tensordict of 32 small leaves
    if want("todict32"):
        leaves = {f"k{i}": torch.randn(100, 16, generator=gen) for i in range(32)}
        tstore = keep(TensorDictStore.from_tensordict(TensorDict(leaves, batch_size=[100]), **conn))
        tkeys = [raw.key(f"{tr}:leaf:{k}") for k in leaves]
        for key, v in zip(tkeys, leaves.values(), strict=True):
            raw.call(tr, lambda c, key=key, v=v: c.set(key, byte_view(v)))

        async def raw_todict(c: Any) -> Any:
            async with c.pipeline(transaction=False) as pipe:
                for key in tkeys:
                    pipe.get(key)
                replies = await pipe.execute()
            return {k: torch.frombuffer(b, dtype=torch.float32) for k, b in zip(leaves, replies, strict=True)}

        cases.append(Case("todict32", tstore.to_tensordict, raw_todict, "pipeline of 32 GETs"))

    # ---- lazy store element read
    if want("lazy-el"):
        n = 1000
        lengths = torch.randint(16, 65, (n,), generator=gen).tolist()
        members = [
            TensorDict(obs=torch.randn(k, generator=gen), action=torch.randn(4, generator=gen),
                       reward=torch.randn((), generator=gen), batch_size=[])
            for k in lengths
        ]
        lazy = keep(LazyStackedTensorDictStore.from_lazy_stack(LazyStackedTensorDict(*members, stack_dim=0), **conn))
        spans: dict[str, tuple[int, int]] = {}
        lkeys = {k: raw.key(f"{tr}:lazy:{k}") for k in ("obs", "action", "reward")}
        j = 432
        for k in lkeys:
            pos = sum(m[k].numel() * 4 for m in members[:j])
            spans[k] = (pos, members[j][k].numel() * 4)
            blob = b"".join(bytes(byte_view(m[k])) for m in members)
            raw.call(tr, lambda c, k=k, blob=blob: c.set(lkeys[k], blob))

        async def raw_lazy(c: Any) -> Any:
            async with c.pipeline(transaction=True) as pipe:
                for k, key in lkeys.items():
                    off, size = spans[k]
                    pipe.getrange(key, off, off + size - 1)
                replies = await pipe.execute()
            return [torch.frombuffer(b, dtype=torch.float32) for b in replies]

        cases.append(Case("lazy-el", lambda: lazy[j], raw_lazy, "MULTI of 3 GETRANGEs"))
    return cases


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.set_defaults(server="redis")
    parser.add_argument("--servers", default=None, help="comma-separated server kinds (default: --server); e.g. redis,valkey")
    parser.add_argument("--ops", type=int, default=200, help="operations per batch (default 200)")
    parser.add_argument("--rounds", type=int, default=4, help="batches of each side (default 4)")
    parser.add_argument("--quick", action="store_true", help="a short run: --ops 60 --rounds 2")
    parser.add_argument("--cases", default=None, help="comma-separated subset of the workloads")
    parser.add_argument("--pin", action="store_true", help="server on CPU 0, this process on the others (see above)")
    args = parse(parser)
    if args.quick:
        args.ops, args.rounds = 60, 2
    kinds = (args.servers or args.server).split(",")
    which = set(args.cases.split(",")) if args.cases else None
    for kind in kinds:
        with bench_server(kind) as srv:
            placement = pin(srv.pid) if args.pin else "not pinned"
            print(f"# {server_banner(srv)}; load {load_average()}; {args.ops} ops x {args.rounds} rounds; {placement}")
            raw = RawRedis(srv)
            info_client = srv.sync_client()
            table: list[list[str]] = []
            try:
                for tr in transports(args):
                    stores: list[Any] = []
                    try:
                        for case in build_cases(srv, raw, tr, stores, which):
                            r = run_case(case, raw, tr, info_client, args.ops, args.rounds)
                            table.append([
                                case.name, tr, case.raw_label,
                                f"{r['cpu_ours'] * 1e6:.0f}", f"{r['cpu_raw'] * 1e6:.0f}",
                                f"{r['cpu_ours'] / r['cpu_raw']:.2f}x" if r["cpu_raw"] > 0 else "-",
                                f"{r['cpu_paired']:.2f}x",
                                f"{r['wall_ours'] * 1e6:.0f}", f"{r['wall_raw'] * 1e6:.0f}",
                                f"{r['wall_ours'] / r['wall_raw']:.2f}x",
                            ])
                    finally:
                        for s in stores:
                            s.clear_redis()
                            s.close()
            finally:
                info_client.close()
                raw.cleanup()
            print_table(
                f"server CPU and wall time per op, {kind}",
                ["workload", "transport", "raw form", "server us tdstore", "raw", "ratio", "paired",
                 "wall us tdstore", "raw", "ratio"],
                table,
                ["server us: main-thread CPU (INFO cpu) per op, median of rounds; paired: median over rounds of "
                 "tdstore / raw of neighbouring batches; wall: median per op"],
            )


if __name__ == "__main__":
    main()
