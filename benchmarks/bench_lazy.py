"""LazyStackedTensorDictStore element reads (issue 5) vs raw redis-py fetching the same bytes.

    python benchmarks/bench_lazy.py --server valkey

A lazy stack of ``--elements`` (default 10,000) tensordicts, stack_dim 0, each holding a
ragged ``obs`` (float32, 16..64 values, a different length per element), a homogeneous
``action`` (4 float32) and a ``reward`` (one float32). The raw baseline reads the same
strings the store keeps (the elements' bytes back to back, one key per leaf), on the same
server and transport, and wraps each element's bytes as tensors with ``torch.frombuffer``:

* ``store[j]`` (one element -> a TensorDict)          vs MULTI of 3 GETRANGE + frombuffer
* ``store[idx]`` (256 random elements -> a lazy stack) vs MULTI of 3 x 256 GETRANGE + frombuffer,
  and vs the best raw form: 256 GETRANGE for the ragged leaf + a Lua gather per fixed-size leaf

and, for scale, the same index on the in-memory ``LazyStackedTensorDict``. The upload
(``from_lazy_stack``, one atomic commit) is timed once. Ratios are ``tdstore / raw`` (medians).
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
from _common import (
    GATHER_LUA,
    RawRedis,
    Timing,
    base_parser,
    bench_server,
    byte_view,
    compare,
    fmt_goal,
    fmt_ms,
    fmt_ratio,
    load_average,
    parse,
    print_table,
    server_banner,
    sync_hop_cost,
    timed,
    transports,
)
from tensordict import LazyStackedTensorDict, TensorDict

from tdstore import LazyStackedTensorDictStore

N_SAMPLE = 256



def _t(timing: Timing) -> str:
    return f"{fmt_ms(timing.median)} ({fmt_ms(timing.min)})"


def _row(label: str, tr: str, base_label: str, base: Timing, ours: Timing, goal: float | None) -> list[str]:
    return [
        label, tr, base_label, _t(base), _t(ours),
        fmt_ratio(ours.median, base.median), fmt_ratio(ours.min, base.min), fmt_goal(ours.median, base.median, goal),
    ]


def make_stack(n: int) -> LazyStackedTensorDict:
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(16, 65, (n,), generator=gen).tolist()
    members = [
        TensorDict(
            obs=torch.randn(k, generator=gen), action=torch.randn(4, generator=gen), reward=torch.randn((), generator=gen),
            batch_size=[],
        )
        for k in lengths
    ]
    return LazyStackedTensorDict(*members, stack_dim=0)


def benchmarks(srv: Any, raw: RawRedis, args: Any, rows_out: list[list[str]], notes: list[str]) -> None:
    rep, warm, n = args.repeat, args.warmup, args.elements
    local = make_stack(n)
    members = local.tensordicts
    leaves = ("obs", "action", "reward")
    spans: dict[str, list[tuple[int, int]]] = {}
    keys = {k: raw.key(f"lazy:{k}") for k in leaves}
    for k in leaves:
        pos, out = 0, []
        for m in members:
            size = m[k].numel() * 4
            out.append((pos, size))
            pos += size
        spans[k] = out
    gen = torch.Generator().manual_seed(6)
    idx = torch.randperm(n, generator=gen)[:N_SAMPLE]
    one = 4321 % n
    rows = idx.tolist()

    start = time.perf_counter()
    first = LazyStackedTensorDictStore.from_lazy_stack(local, **srv.connection_kwargs(unix=True))
    notes.append(f"upload of the {n}-element stack (from_lazy_stack, one atomic commit): {time.perf_counter() - start:.3f} s")
    stores = {"unix": first}
    try:
        for k in leaves:
            blob = b"".join(byte_view(m[k]) for m in members)
            raw.call("unix", lambda c, k=k, blob=blob: c.set(keys[k], blob))
        sha = raw.call("unix", lambda c: c.script_load(GATHER_LUA))
        if "tcp" in transports(args):
            stores["tcp"] = LazyStackedTensorDictStore.from_store(td_id=first.td_id, **srv.connection_kwargs(unix=False))
        for tr in transports(args):
            store = stores[tr]

            async def raw_one(c: Any) -> dict[str, torch.Tensor]:
                async with c.pipeline(transaction=True) as pipe:
                    for k in leaves:
                        off, size = spans[k][one]
                        pipe.getrange(keys[k], off, off + size - 1)
                    replies = await pipe.execute()
                return {k: torch.frombuffer(b, dtype=torch.float32) for k, b in zip(leaves, replies, strict=True)}

            async def raw_many(c: Any) -> dict[str, list[torch.Tensor]]:
                async with c.pipeline(transaction=True) as pipe:
                    for k in leaves:
                        for r in rows:
                            off, size = spans[k][r]
                            pipe.getrange(keys[k], off, off + size - 1)
                    replies = await pipe.execute()
                return {
                    k: [torch.frombuffer(b, dtype=torch.float32) for b in replies[i * len(rows) : (i + 1) * len(rows)]]
                    for i, k in enumerate(leaves)
                }

            async def raw_best(c: Any) -> dict[str, list[torch.Tensor]]:
                # ragged obs: one GETRANGE per element; fixed-size leaves: one Lua gather each
                async with c.pipeline(transaction=True) as pipe:
                    for r in rows:
                        off, size = spans["obs"][r]
                        pipe.getrange(keys["obs"], off, off + size - 1)
                    for k in ("action", "reward"):
                        pipe.evalsha(sha, 1, keys[k], spans[k][0][1], *rows)
                    replies = await pipe.execute()
                out = {"obs": [torch.frombuffer(b, dtype=torch.float32) for b in replies[: len(rows)]]}
                for i, k in enumerate(("action", "reward")):
                    out[k] = list(torch.frombuffer(replies[len(rows) + i], dtype=torch.float32).reshape(len(rows), -1).unbind(0))
                return out

            # correctness first (untimed)
            got_one, want_one = store[one], local[one]
            assert all(torch.equal(got_one[k], want_one[k]) for k in leaves), "store[j] differs"
            raw_res = raw.call(tr, raw_one)
            assert all(torch.equal(raw_res[k].reshape(want_one[k].shape), want_one[k]) for k in leaves)
            got = store[idx]
            assert isinstance(got, LazyStackedTensorDict) and len(got.tensordicts) == N_SAMPLE
            for g, r in zip(got.tensordicts, rows, strict=True):
                assert all(torch.equal(g[k], members[r][k]) for k in leaves), "store[idx] differs"
            many = raw.call(tr, raw_many)
            assert all(torch.equal(many["obs"][i], members[r]["obs"]) for i, r in enumerate(rows))
            best = raw.call(tr, raw_best)
            assert all(torch.equal(best["action"][i], members[r]["action"]) for i, r in enumerate(rows))

            t = compare(
                {"raw:one": raw.timed(tr, raw_one), "raw:one-hop": timed(lambda tr=tr, fn=raw_one: raw.call(tr, fn)),
                 "ours:one": timed(lambda store=store: store[one])},
                repeat=max(rep, 31), warmup=max(warm, 5),
            )
            t.update(compare(
                {"raw:many": raw.timed(tr, raw_many), "raw:best": raw.timed(tr, raw_best),
                 "ours:many": timed(lambda store=store: store[idx]),
                 "mem:many": timed(lambda: local[idx])},
                repeat=max(rep, 15), warmup=max(warm, 3),
            ))
            rows_out.append(_row("read store[j], one element (3 leaves)", tr, "MULTI 3x GETRANGE + frombuffer",
                                 t["raw:one"], t["ours:one"], 2.0))
            rows_out.append(_row("read store[j], one element (3 leaves)", tr, "same, called through a thread hop",
                                 t["raw:one-hop"], t["ours:one"], None))
            rows_out.append(_row(f"read store[idx], {N_SAMPLE} random elements", tr,
                                 f"MULTI 3x{N_SAMPLE} GETRANGE + frombuffer", t["raw:many"], t["ours:many"], 1.3))
            rows_out.append(_row(f"read store[idx], {N_SAMPLE} random elements", tr,
                                 f"MULTI {N_SAMPLE}x GETRANGE (obs) + 2 Lua gathers", t["raw:best"], t["ours:many"], None))
            rows_out.append(_row(f"read store[idx], {N_SAMPLE} random elements", tr,
                                 "in-memory LazyStackedTensorDict[idx]", t["mem:many"], t["ours:many"], None))
    finally:
        for tr, store in stores.items():
            if tr != "unix":
                store.close()
        first.clear_redis()
        first.close()


def main() -> None:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=10000, help="elements of the lazy stack (default 10000)")
    args = parse(parser)
    rows: list[list[str]] = []
    notes: list[str] = []
    with bench_server(args.server) as srv:
        print(f"# bench_lazy: lazy stack of {args.elements} elements (obs ragged 16..64 f32, action 4 f32, reward f32)")
        print(f"# {datetime.datetime.now().isoformat(timespec='minutes')}; {server_banner(srv)}")
        print(f"# load average at start: {load_average()}")
        raw = RawRedis(srv)
        try:
            benchmarks(srv, raw, args, rows, notes)
        finally:
            raw.cleanup()
        hop = sync_hop_cost()
    headers = ["operation", "transport", "raw baseline", "raw ms", "tdstore ms", "tdstore/raw", "(of mins)", "goal"]
    notes += [
        "ratio = median time / median baseline time (lower is better); '(of mins)' = min / min.",
        "raw = redis.asyncio + hiredis awaited inside its own event loop (no thread hop), wrapping each element's "
        "bytes with torch.frombuffer; tdstore also builds the TensorDicts (and the LazyStackedTensorDict) around them.",
        f"one blocking tdstore call's thread hop to its IO loop, without I/O: {hop * 1e6:.0f} us (median).",
        f"load average at end: {load_average()}",
    ]
    print_table("lazy stack element reads", headers, rows, notes)


if __name__ == "__main__":
    main()
