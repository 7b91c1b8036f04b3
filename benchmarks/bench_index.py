"""Indexed reads and writes (issue "indexing") vs the best hand-written redis-py.

    python benchmarks/bench_index.py --server valkey

Image store: ``from_schema({"obs": ([84, 84, 3], torch.uint8)}, batch_size=[10000])``
(211 MB; ``--rows`` makes it smaller), filled with random bytes; the raw baseline reads
and writes a plain string key holding the same bytes, on the same server and transport:

* ``store[idx]`` (256 random rows)       vs MULTI of 256 GETRANGE + join + frombuffer
* ``store[idx] = td`` (256 random rows)  vs MULTI of 256 SETRANGE
* ``store[i]`` (one row)                 vs one GETRANGE + frombuffer
* ``store[100:356]`` read / write        vs one GETRANGE (+ frombuffer) / one SETRANGE

Sampling store: 10000 rows of obs (64,) float32, action (4,) float32, reward () float32:

* ``store[idx]`` (256 random rows) vs a Lua gather script per entry (one MULTI; the
  script takes the row size and the row numbers and returns the rows' bytes
  concatenated), vs a MULTI of 3 x 256 GETRANGEs, and vs ``td[idx]`` on an in-memory
  TensorDict holding the same data.

Ratios are ``tdstore time / raw time`` (medians); goals: 1.3x, 1.3x, 2x, 1.2x, 1.0x. When
``tensordict.store`` is importable (and without ``--no-baseline``), the same operations of its
``TensorDictStore`` on the same data are timed in the same rounds, and the last columns give
its time and ``tdstore time / tensordict.store time``.
"""

from __future__ import annotations

import datetime
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
    tensor_from_bytes,
    timed,
    transports,
)
from tensordict import TensorDict

from tdstore import TensorDictStore

try:  # the competitor, used only as a baseline
    from tensordict.store import TensorDictStore as TDStoreBaseline
except ImportError:  # pragma: no cover - depends on the tensordict version
    TDStoreBaseline = None

OBS_SHAPE = (84, 84, 3)
N_SAMPLE = 256
SLICE = slice(100, 356)


SAMPLING_SPEC = {"obs": ((64,), torch.float32), "action": ((4,), torch.float32), "reward": ((), torch.float32)}


def _t(timing: Timing | None) -> str:
    if timing is None:
        return "-"
    return f"{fmt_ms(timing.median)} ({fmt_ms(timing.min)})"


def _row(
    label: str, tr: str, base_label: str, base: Timing, ours: Timing, goal: float | None, comp: Timing | None = None
) -> list[str]:
    return [
        label,
        tr,
        base_label,
        _t(base),
        _t(ours),
        fmt_ratio(ours.median, base.median),
        fmt_ratio(ours.min, base.min),
        fmt_goal(ours.median, base.median, goal),
        _t(comp),
        fmt_ratio(ours.median, comp.median) if comp is not None else "-",
    ]


def _competitors(make: Any, srv: Any, args: Any, notes: list[str]) -> dict[str, Any]:
    """The competitor's store per transport (``make(kwargs)`` builds it over the unix socket;
    TCP reconnects to it), or {} when it is not importable, not wanted, or fails."""
    if TDStoreBaseline is None or args.no_baseline:
        return {}
    out: dict[str, Any] = {}
    try:
        out["unix"] = make(srv.connection_kwargs(unix=True))
        if "tcp" in transports(args):
            out["tcp"] = TDStoreBaseline.from_store(td_id=out["unix"]._td_id, **srv.connection_kwargs(unix=False))
    except Exception as err:  # noqa: BLE001 - the baseline is optional; say why it is missing
        notes.append(f"tensordict.store failed ({type(err).__name__}: {err}); its columns are empty where it did")
        _drop_competitors(out)
        return {}
    return out


def _drop_competitors(stores: dict[str, Any]) -> None:
    for tr, store in list(stores.items()):
        if tr == "unix":
            store.clear_redis()
        store.close()
    stores.clear()


def image_benchmarks(srv: Any, raw: RawRedis, args: Any, rows_out: list[list[str]], notes: list[str]) -> None:
    rep, warm, n = args.repeat, args.warmup, args.rows
    gen = torch.Generator().manual_seed(1)
    obs = torch.randint(0, 256, (n, *OBS_SHAPE), dtype=torch.uint8, generator=gen)
    row_bytes = obs[0].numel()
    idx = torch.randperm(n, generator=gen)[:N_SAMPLE]
    new_rows = torch.randint(0, 256, (N_SAMPLE, *OBS_SHAPE), dtype=torch.uint8, generator=gen)
    new_slice = torch.randint(0, 256, (SLICE.stop - SLICE.start, *OBS_SHAPE), dtype=torch.uint8, generator=gen)
    one = 4321 % n
    key = raw.key("obs")
    expected = obs.clone()

    first = TensorDictStore.from_schema(
        {"obs": (list(OBS_SHAPE), torch.uint8)}, batch_size=[n], **srv.connection_kwargs(unix=True)
    )
    stores = {"unix": first}
    comps: dict[str, Any] = {}
    try:
        first["obs"] = obs  # same shape and dtype: fills the from_schema entry
        comps = _competitors(
            lambda kw: TDStoreBaseline.from_tensordict(TensorDict({"obs": obs}, batch_size=[n]), **kw), srv, args, notes
        )
        raw.call("unix", lambda c: c.set(key, byte_view(obs)))
        sha = raw.call("unix", lambda c: c.script_load(GATHER_LUA))
        if "tcp" in transports(args):
            stores["tcp"] = TensorDictStore.from_store(td_id=first.td_id, **srv.connection_kwargs(unix=False))

        for tr in transports(args):
            store = stores[tr]
            comp = comps.get(tr)

            async def raw_rows_read(c: Any) -> torch.Tensor:
                async with c.pipeline(transaction=True) as pipe:
                    for r in idx.tolist():
                        pipe.getrange(key, r * row_bytes, r * row_bytes + row_bytes - 1)
                    parts = await pipe.execute()
                return tensor_from_bytes(b"".join(parts), torch.uint8, (len(parts), *OBS_SHAPE))

            async def raw_rows_lua(c: Any) -> torch.Tensor:
                data = await c.evalsha(sha, 1, key, row_bytes, *idx.tolist())
                return tensor_from_bytes(data, torch.uint8, (N_SAMPLE, *OBS_SHAPE))

            async def raw_rows_write(c: Any) -> Any:
                view = byte_view(new_rows)
                async with c.pipeline(transaction=True) as pipe:
                    for i, r in enumerate(idx.tolist()):
                        pipe.setrange(key, r * row_bytes, view[i * row_bytes : (i + 1) * row_bytes])
                    return await pipe.execute()

            async def raw_one(c: Any) -> torch.Tensor:
                data = await c.getrange(key, one * row_bytes, one * row_bytes + row_bytes - 1)
                return tensor_from_bytes(data, torch.uint8, OBS_SHAPE)

            lo, hi = SLICE.start * row_bytes, SLICE.stop * row_bytes

            async def raw_slice_read(c: Any, lo: int = lo, hi: int = hi) -> torch.Tensor:
                data = await c.getrange(key, lo, hi - 1)
                return tensor_from_bytes(data, torch.uint8, (SLICE.stop - SLICE.start, *OBS_SHAPE))

            async def raw_slice_write(c: Any, lo: int = lo) -> Any:
                return await c.setrange(key, lo, byte_view(new_slice))

            # correctness first (untimed): tdstore and raw agree with the local tensor
            # (`expected` is what both the store and the raw key hold: the writes below change both alike)
            assert torch.equal(store[idx]["obs"], expected[idx]), "store[idx] differs"
            assert torch.equal(raw.call(tr, raw_rows_read), expected[idx]), "raw gather differs"
            assert torch.equal(raw.call(tr, raw_rows_lua), expected[idx]), "raw Lua gather differs"
            assert torch.equal(store[one]["obs"], expected[one]), "store[i] differs"
            assert torch.equal(raw.call(tr, raw_one), expected[one]), "raw GETRANGE differs"
            assert torch.equal(store[SLICE]["obs"], expected[SLICE]), "store[slice] differs"
            assert torch.equal(raw.call(tr, raw_slice_read), expected[SLICE]), "raw slice differs"
            if comp is not None:
                assert torch.equal(comp[idx]["obs"], expected[idx]), "tensordict.store[idx] differs"
                assert torch.equal(comp[one]["obs"], expected[one]), "tensordict.store[i] differs"
                assert torch.equal(comp[SLICE]["obs"], expected[SLICE]), "tensordict.store[slice] differs"

            td_rows = TensorDict({"obs": new_rows}, batch_size=[N_SAMPLE])
            td_slice = TensorDict({"obs": new_slice}, batch_size=[SLICE.stop - SLICE.start])

            def write_rows(store: TensorDictStore = store, td_rows: TensorDict = td_rows) -> None:
                store[idx] = td_rows

            def write_slice(store: TensorDictStore = store, td_slice: TensorDict = td_slice) -> None:
                store[SLICE] = td_slice

            def c_write_rows(comp: Any = comp, td_rows: TensorDict = td_rows) -> None:
                comp[idx] = td_rows

            def c_write_slice(comp: Any = comp, td_slice: TensorDict = td_slice) -> None:
                comp[SLICE] = td_slice

            def with_comp(cases: dict[str, Any], comp: Any = comp, **theirs: Any) -> dict[str, Any]:
                if comp is not None:
                    cases.update({f"comp:{k}": timed(fn) for k, fn in theirs.items()})
                return cases

            t = compare(
                with_comp(
                    {
                        "raw:rows": raw.timed(tr, raw_rows_read),
                        "raw:rows-lua": raw.timed(tr, raw_rows_lua),
                        "ours:rows": timed(lambda store=store: store[idx]),
                    },
                    rows=lambda comp=comp: comp[idx],
                ),
                repeat=max(rep, 15), warmup=max(warm, 3),
            )
            t.update(compare(
                with_comp({"raw:wrows": raw.timed(tr, raw_rows_write), "ours:wrows": timed(write_rows)}, wrows=c_write_rows),
                repeat=max(rep, 15), warmup=max(warm, 3),
            ))
            t.update(compare(
                with_comp(
                    {
                        "raw:one": raw.timed(tr, raw_one),
                        "raw:one-hop": timed(lambda tr=tr: raw.call(tr, raw_one)),
                        "ours:one": timed(lambda store=store: store[one]),
                    },
                    one=lambda comp=comp: comp[one],
                ),
                repeat=max(rep, 31), warmup=max(warm, 5),
            ))
            t.update(compare(
                with_comp(
                    {"raw:slice": raw.timed(tr, raw_slice_read), "ours:slice": timed(lambda store=store: store[SLICE])},
                    slice=lambda comp=comp: comp[SLICE],
                ),
                repeat=max(rep, 15), warmup=max(warm, 3),
            ))
            t.update(compare(
                with_comp({"raw:wslice": raw.timed(tr, raw_slice_write), "ours:wslice": timed(write_slice)},
                          wslice=c_write_slice),
                repeat=max(rep, 15), warmup=max(warm, 3),
            ))
            # the writes landed where they should
            expected[idx] = new_rows
            expected[SLICE] = new_slice  # written last, so it wins where idx falls inside the slice
            assert torch.equal(store[idx]["obs"], expected[idx]), "store[idx] = td did not land"
            assert torch.equal(raw.call(tr, raw_rows_read), expected[idx]), "raw SETRANGEs did not land"
            assert torch.equal(store[SLICE]["obs"], new_slice), "store[slice] = td did not land"
            if comp is not None:
                assert torch.equal(comp[idx]["obs"], expected[idx]), "tensordict.store[idx] = td did not land"
                assert torch.equal(comp[SLICE]["obs"], new_slice), "tensordict.store[slice] = td did not land"

            rows_out.append(_row(f"read  store[idx], {N_SAMPLE} random rows", tr,
                                 f"MULTI {N_SAMPLE}x GETRANGE + join + frombuffer", t["raw:rows"], t["ours:rows"], 1.3,
                                 t.get("comp:rows")))
            rows_out.append(_row(f"read  store[idx], {N_SAMPLE} random rows", tr,
                                 "Lua gather script, 1 EVALSHA (info)", t["raw:rows-lua"], t["ours:rows"], None))
            rows_out.append(_row(f"write store[idx] = td, {N_SAMPLE} random rows", tr,
                                 f"MULTI {N_SAMPLE}x SETRANGE", t["raw:wrows"], t["ours:wrows"], 1.3, t.get("comp:wrows")))
            rows_out.append(_row("read  store[i], one row", tr, "GETRANGE + frombuffer",
                                 t["raw:one"], t["ours:one"], 2.0, t.get("comp:one")))
            rows_out.append(_row("read  store[i], one row", tr, "same, called through a thread hop",
                                 t["raw:one-hop"], t["ours:one"], None))
            rows_out.append(_row(f"read  store[{SLICE.start}:{SLICE.stop}]", tr, "GETRANGE + frombuffer",
                                 t["raw:slice"], t["ours:slice"], 1.2, t.get("comp:slice")))
            rows_out.append(_row(f"write store[{SLICE.start}:{SLICE.stop}] = td", tr, "SETRANGE",
                                 t["raw:wslice"], t["ours:wslice"], 1.2, t.get("comp:wslice")))
    finally:
        for tr, store in stores.items():
            if tr == "unix":
                continue
            store.close()
        first.clear_redis()
        first.close()
        _drop_competitors(comps)


def sampling_benchmarks(
    srv: Any, raw: RawRedis, args: Any, rows_out: list[list[str]], mem_alone: list[float], notes: list[str]
) -> None:
    rep, warm, n = args.repeat, args.warmup, args.sampling_rows
    gen = torch.Generator().manual_seed(2)
    data = {k: torch.randn(n, *shape, generator=gen).to(dtype) for k, (shape, dtype) in SAMPLING_SPEC.items()}
    local = TensorDict(data, batch_size=[n])
    idx = torch.randint(0, n, (N_SAMPLE,), generator=gen)  # sampling with replacement, as a replay buffer does
    sizes = {k: v[0].numel() * v.element_size() for k, v in data.items()}
    keys = {k: raw.key(f"s:{k}") for k in data}

    first = TensorDictStore.from_tensordict(local, **srv.connection_kwargs(unix=True))
    stores = {"unix": first}
    comps: dict[str, Any] = {}
    try:
        comps = _competitors(lambda kw: TDStoreBaseline.from_tensordict(local, **kw), srv, args, notes)
        for k, v in data.items():
            raw.call("unix", lambda c, k=k, v=v: c.set(keys[k], byte_view(v)))
        sha = raw.call("unix", lambda c: c.script_load(GATHER_LUA))
        if "tcp" in transports(args):
            stores["tcp"] = TensorDictStore.from_store(td_id=first.td_id, **srv.connection_kwargs(unix=False))

        for tr in transports(args):
            store = stores[tr]
            comp = comps.get(tr)

            async def raw_gather(c: Any) -> dict[str, torch.Tensor]:
                rows = idx.tolist()
                async with c.pipeline(transaction=True) as pipe:
                    for k in data:
                        pipe.evalsha(sha, 1, keys[k], sizes[k], *rows)
                    replies = await pipe.execute()
                return {
                    k: tensor_from_bytes(b, SAMPLING_SPEC[k][1], (len(rows), *SAMPLING_SPEC[k][0]))
                    for k, b in zip(data, replies, strict=True)
                }

            async def raw_getranges(c: Any) -> dict[str, torch.Tensor]:
                rows = idx.tolist()
                async with c.pipeline(transaction=True) as pipe:
                    for k in data:
                        size = sizes[k]
                        for r in rows:
                            pipe.getrange(keys[k], r * size, r * size + size - 1)
                    replies = await pipe.execute()
                out = {}
                for j, k in enumerate(data):
                    part = replies[j * len(rows) : (j + 1) * len(rows)]
                    out[k] = tensor_from_bytes(b"".join(part), SAMPLING_SPEC[k][1], (len(rows), *SAMPLING_SPEC[k][0]))
                return out

            want = local[idx]
            got = store[idx]
            for k in data:
                assert torch.equal(got[k], want[k]), f"store[idx][{k!r}] differs"
            if comp is not None:
                theirs = comp[idx]
                for k in data:
                    assert torch.equal(theirs[k], want[k]), f"tensordict.store[idx][{k!r}] differs"
            for fn in (raw_gather, raw_getranges):
                res = raw.call(tr, fn)
                for k in data:
                    assert torch.equal(res[k], want[k]), f"{fn.__name__}[{k!r}] differs"

            cases = {
                "raw:lua": raw.timed(tr, raw_gather),
                "raw:getrange": raw.timed(tr, raw_getranges),
                "mem": timed(lambda: local[idx]),
                "ours": timed(lambda store=store: store[idx]),
            }
            if comp is not None:
                cases["comp"] = timed(lambda comp=comp: comp[idx])
            t = compare(cases, repeat=max(rep, 15), warmup=max(warm, 3))
            alone = compare({"mem": timed(lambda: local[idx])}, repeat=31, warmup=3)["mem"]
            mem_alone.append(alone.median)
            label = f"sample store[idx], {N_SAMPLE} rows x 3 entries"
            rows_out.append(_row(label, tr, "Lua gather per entry, one MULTI", t["raw:lua"], t["ours"], 1.0, t.get("comp")))
            rows_out.append(_row(label, tr, f"MULTI 3x{N_SAMPLE} GETRANGE + join", t["raw:getrange"], t["ours"], None))
            rows_out.append(_row(label, tr, "in-memory TensorDict td[idx]", t["mem"], t["ours"], None))
    finally:
        for tr, store in stores.items():
            if tr != "unix":
                store.close()
        first.clear_redis()
        first.close()
        _drop_competitors(comps)


def main() -> None:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10000, help="rows of the 84x84x3 uint8 store (default 10000)")
    parser.add_argument("--sampling-rows", type=int, default=10000, help="rows of the sampling store (default 10000)")
    parser.add_argument("--no-baseline", action="store_true", help="skip tensordict.store.TensorDictStore")
    args = parse(parser)
    rows: list[list[str]] = []
    comp_notes: list[str] = []
    mem_alone: list[float] = []
    with bench_server(args.server) as srv:
        mb = args.rows * 84 * 84 * 3 / 1e6
        print(f"# bench_index: obs [{args.rows}, 84, 84, 3] uint8 ({mb:.0f} MB); sampling store of "
              f"{args.sampling_rows} rows (obs 64 f32, action 4 f32, reward f32)")
        print(f"# {datetime.datetime.now().isoformat(timespec='minutes')}; {server_banner(srv)}")
        print(f"# load average at start: {load_average()}")
        print(f"# each cell: median (min) ms; {args.repeat} runs after {args.warmup} warm-up runs "
              "(at least 15 after 3; one-row reads: 31 after 5); cases interleaved")
        raw = RawRedis(srv)
        try:
            image_benchmarks(srv, raw, args, rows, comp_notes)
            sampling_benchmarks(srv, raw, args, rows, mem_alone, comp_notes)
        finally:
            raw.cleanup()
        hop = sync_hop_cost()
    headers = ["operation", "transport", "raw baseline", "raw ms", "tdstore ms", "tdstore/raw", "(of mins)", "goal",
               "tensordict.store ms", "tdstore/tensordict.store"]
    notes = [
        "ratio = median time / median baseline time (lower is better); '(of mins)' = min / min.",
        "raw = redis.asyncio + hiredis on the same server and transport, awaited inside its own event loop "
        "(no thread hop), producing the same tensors (reads include join + torch.frombuffer).",
        f"one blocking tdstore call's thread hop to its IO loop, without I/O: {hop * 1e6:.0f} us (median); the "
        "'through a thread hop' row times the raw GETRANGE submitted from the main thread the same way.",
        "in-memory td[idx] is timed interleaved with the other cases, i.e. with caches cooled by them; "
        f"timed back to back it takes {fmt_ms(min(mem_alone)) if mem_alone else '-'} ms (median).",
        "tensordict.store: " + (
            "tensordict.store.TensorDictStore on the same data, timed in the same interleaved rounds."
            if TDStoreBaseline is not None and not args.no_baseline
            else "not importable (or --no-baseline): columns empty."
        ),
        *comp_notes,
        f"load average at end: {load_average()}",
    ]
    print_table("indexed reads and writes", headers, rows, notes)


if __name__ == "__main__":
    main()
