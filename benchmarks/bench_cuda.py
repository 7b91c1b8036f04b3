"""Reads into GPU memory: a store with ``device="cuda"`` vs raw redis-py plus ``.cuda()``.

    python benchmarks/bench_cuda.py --server valkey --sizes 64,256

Needs a CUDA GPU (CI has none: run it on a GPU machine). On one private server, unix
socket and TCP, times (medians of ``--repeat`` interleaved runs, each ending with
``torch.cuda.synchronize()``):

* ``store["x"]`` (a [16, n] float32 entry of each size) vs raw ``GET`` + ``torch.frombuffer``
  + ``.cuda()``; large entries are read by tdstore in pieces into pinned memory;
* ``store[idx]``, 256 random rows of a [10000, 84, 84, 3] uint8 entry, vs a raw MULTI of
  256 GETRANGEs + join + ``frombuffer`` + ``.cuda()``;
* ``store[100:356]`` vs one raw GETRANGE + ``frombuffer`` + ``.cuda()``.

Ratio = tdstore / raw, lower is better.
"""

from __future__ import annotations

from typing import Any

import torch
from _common import (
    base_parser,
    bench_server,
    byte_view,
    compare,
    fmt_ms,
    fmt_ratio,
    load_average,
    parse,
    print_table,
    server_banner,
    tensor_from_bytes,
    timed,
    transports,
)
from bench_large import CONFIG, _RawNoTimeout

from tdstore import TensorDictStore

ROWS = 16
OBS = (84, 84, 3)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256", help="entry sizes in MiB, comma-separated (default 64,256)")
    args = parse(parser)
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda needs a CUDA GPU")
    sizes = [int(s) for s in args.sizes.split(",")]
    gen = torch.Generator().manual_seed(0)
    rows: list[list[Any]] = []
    with bench_server(args.server, CONFIG) as handle:
        print(f"# bench_cuda; {server_banner(handle)}; GPU: {torch.cuda.get_device_name()}")
        print(f"# load average at start: {load_average()}")
        raw = _RawNoTimeout(handle)
        try:
            for tr in transports(args):
                kwargs = (
                    {"unix_socket_path": handle.unix_socket_path} if tr == "unix" else {"host": handle.host, "port": handle.port}
                )
                for mib in sizes:
                    shape = (ROWS, mib * 2**20 // 4 // ROWS)
                    value = torch.randn(shape, generator=gen)
                    key = raw.key(f"x{mib}")
                    raw.call(tr, lambda c, key=key, value=value: c.set(key, byte_view(value)))
                    store = TensorDictStore(batch_size=[ROWS], device="cuda", **kwargs)
                    store["x"] = value

                    async def raw_get(c: Any, key: str = key, shape: tuple[int, int] = shape) -> torch.Tensor:
                        out = tensor_from_bytes(await c.get(key), torch.float32, shape).cuda()
                        torch.cuda.synchronize()
                        return out

                    def ours(store: TensorDictStore = store) -> torch.Tensor:
                        out = store["x"]
                        torch.cuda.synchronize()
                        return out

                    assert torch.equal(ours().cpu(), value) and torch.equal(raw.call(tr, raw_get).cpu(), value)
                    t = compare({"raw": raw.timed(tr, raw_get), "ours": timed(ours)}, repeat=args.repeat, warmup=args.warmup)
                    rows.append([f'read store["x"], {mib} MiB', tr, "GET + frombuffer + .cuda()",
                                 fmt_ms(t["raw"].median), fmt_ms(t["ours"].median), fmt_ratio(t["ours"].median, t["raw"].median)])
                    store.clear_redis()
                    store.close()
                    raw.call(tr, lambda c, key=key: c.delete(key))

                n = 10000
                obs = torch.randint(0, 256, (n, *OBS), dtype=torch.uint8, generator=gen)
                row_bytes = obs[0].numel()
                key = raw.key("obs")
                raw.call(tr, lambda c, key=key, obs=obs: c.set(key, byte_view(obs)))
                store = TensorDictStore(batch_size=[n], device="cuda", **kwargs)
                store["obs"] = obs
                idx = torch.randint(0, n, (256,), generator=gen)

                async def raw_rows(c: Any, key: str = key, idx: torch.Tensor = idx, row_bytes: int = row_bytes) -> torch.Tensor:
                    async with c.pipeline(transaction=True) as pipe:
                        for i in idx.tolist():
                            pipe.getrange(key, i * row_bytes, (i + 1) * row_bytes - 1)
                        parts = await pipe.execute()
                    out = tensor_from_bytes(b"".join(parts), torch.uint8, (256, *OBS)).cuda()
                    torch.cuda.synchronize()
                    return out

                async def raw_slice(c: Any, key: str = key, row_bytes: int = row_bytes) -> torch.Tensor:
                    data = await c.getrange(key, 100 * row_bytes, 356 * row_bytes - 1)
                    out = tensor_from_bytes(data, torch.uint8, (256, *OBS)).cuda()
                    torch.cuda.synchronize()
                    return out

                def ours_rows(store: TensorDictStore = store, idx: torch.Tensor = idx) -> torch.Tensor:
                    out = store[idx]["obs"]
                    torch.cuda.synchronize()
                    return out

                def ours_slice(store: TensorDictStore = store) -> torch.Tensor:
                    out = store[100:356]["obs"]
                    torch.cuda.synchronize()
                    return out

                assert torch.equal(ours_rows().cpu(), obs[idx]) and torch.equal(raw.call(tr, raw_rows).cpu(), obs[idx])
                assert torch.equal(ours_slice().cpu(), obs[100:356]) and torch.equal(raw.call(tr, raw_slice).cpu(), obs[100:356])
                t = compare(
                    {"raw:rows": raw.timed(tr, raw_rows), "ours:rows": timed(ours_rows),
                     "raw:slice": raw.timed(tr, raw_slice), "ours:slice": timed(ours_slice)},
                    repeat=args.repeat, warmup=args.warmup,
                )
                rows.append(["read store[idx], 256 random rows", tr, "MULTI 256x GETRANGE + join + .cuda()",
                             fmt_ms(t["raw:rows"].median), fmt_ms(t["ours:rows"].median),
                             fmt_ratio(t["ours:rows"].median, t["raw:rows"].median)])
                rows.append(["read store[100:356]", tr, "GETRANGE + frombuffer + .cuda()",
                             fmt_ms(t["raw:slice"].median), fmt_ms(t["ours:slice"].median),
                             fmt_ratio(t["ours:slice"].median, t["raw:slice"].median)])
                store.clear_redis()
                store.close()
                raw.call(tr, lambda c, key=key: c.delete(key))
        finally:
            raw.cleanup()
    print_table(
        "reads into GPU memory (device='cuda')",
        ["operation", "transport", "raw baseline", "raw ms", "tdstore ms", "tdstore/raw"],
        rows,
        [f"medians of {args.repeat} interleaved runs after {args.warmup} warm-ups; lower ratio is better",
         f"load average at end: {load_average()}"],
    )


if __name__ == "__main__":
    main()
