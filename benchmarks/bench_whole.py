"""Whole-entry throughput (issue "core"): one 64 MB float32 entry vs raw redis-py SET/GET.

    python benchmarks/bench_whole.py --server valkey

Measures, over the unix socket and TCP of one private server:

* ``store["x"] = t``         vs raw ``SET`` of the same bytes
* ``store["x"]``             vs raw ``GET`` + ``torch.frombuffer`` (and vs ``GET`` bytes alone)
* ``from_tensordict(td)``    vs raw ``SET`` (a new store each run, removed untimed)
* ``store.to_tensordict()``  vs raw ``GET`` + ``torch.frombuffer``

and the same operations of ``tensordict.store.TensorDictStore`` (when importable) on the
same server. Ratios are ``time / raw time`` (median of ``--repeat`` runs); goal <= 1.0x.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

from _common import (
    RawRedis,
    Timing,
    base_parser,
    bench_server,
    byte_view,
    fmt_goal,
    fmt_ms,
    fmt_ratio,
    measure,
    print_table,
    server_banner,
    sync_hop_cost,
    tensor_from_bytes,
    transports,
)

import torch
from tensordict import TensorDict

from tdstore import TensorDictStore

try:  # the competitor, used only as a baseline
    from tensordict.store import TensorDictStore as TDStoreBaseline
except ImportError:  # pragma: no cover - depends on the tensordict version
    TDStoreBaseline = None

SHAPE = (16, 1024, 1024)  # 64 MiB of float32
GOAL = 1.0


def _t(timing: Timing | None) -> str:
    if timing is None:
        return "-"
    return f"{fmt_ms(timing.median)} ({fmt_ms(timing.min)})"


def _timed_store_ops(
    cls: Any, kwargs: dict[str, Any], tensor: torch.Tensor, td: TensorDict, args: Any
) -> dict[str, Timing]:
    """write / read / from_tensordict / to_tensordict of one store class."""
    rep, warm = args.repeat, args.warmup
    out: dict[str, Timing] = {}
    store = cls(batch_size=[SHAPE[0]], **kwargs)
    try:

        def write() -> None:
            store["x"] = tensor

        out["write"] = measure(write, repeat=rep, warmup=warm)
        back = store["x"]
        assert torch.equal(back, tensor), f"{cls.__module__}: read back differs"
        del back
        out["read"] = measure(lambda: store["x"], repeat=rep, warmup=warm)
        out["to_tensordict"] = measure(store.to_tensordict, repeat=rep, warmup=warm)
        local = store.to_tensordict()
        assert torch.equal(local["x"], tensor), f"{cls.__module__}: to_tensordict differs"
        del local
    finally:
        store.clear_redis()
        store.close()

    made: list[Any] = []

    def upload() -> Any:
        made.append(cls.from_tensordict(td, **kwargs))

    def drop() -> None:
        while made:
            s = made.pop()
            s.clear_redis()
            s.close()

    out["from_tensordict"] = measure(upload, repeat=rep, warmup=warm, after=drop)
    return out


def main() -> None:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--no-baseline", action="store_true", help="skip tensordict.store.TensorDictStore")
    args = parser.parse_args()
    rep, warm = args.repeat, args.warmup

    torch.manual_seed(0)
    tensor = torch.randn(*SHAPE)
    td = TensorDict({"x": tensor}, batch_size=[SHAPE[0]])
    nbytes = tensor.numel() * tensor.element_size()
    competitor = None if args.no_baseline else TDStoreBaseline

    with bench_server(args.server) as srv:
        print(f"# bench_whole: one {list(SHAPE)} float32 entry ({nbytes / 2**20:.0f} MiB)")
        print(f"# {datetime.date.today().isoformat()}; {server_banner(srv)}")
        print(f"# each cell: median (min) ms of {rep} runs after {warm} warm-up runs")
        raw = RawRedis(srv)
        rows: list[list[str]] = []
        try:
            key = raw.key("x")
            for tr in transports(args):
                kwargs = srv.connection_kwargs(unix=(tr == "unix"))

                async def raw_set(c: Any) -> Any:
                    return await c.set(key, byte_view(tensor))

                async def raw_get(c: Any) -> Any:
                    return await c.get(key)

                async def raw_get_tensor(c: Any) -> Any:
                    return tensor_from_bytes(await c.get(key), torch.float32, SHAPE)

                raw_times = {
                    "set": raw.time(tr, raw_set, repeat=rep, warmup=warm),
                    "get": raw.time(tr, raw_get, repeat=rep, warmup=warm),
                    "get+fb": raw.time(tr, raw_get_tensor, repeat=rep, warmup=warm),
                }
                check = raw.call(tr, raw_get_tensor)
                assert torch.equal(check, tensor), "raw round trip differs (bulk length bug?)"
                del check

                ours = _timed_store_ops(TensorDictStore, kwargs, tensor, td, args)
                theirs: dict[str, Timing] = {}
                if competitor is not None:
                    try:
                        theirs = _timed_store_ops(competitor, kwargs, tensor, td, args)
                    except Exception as err:  # noqa: BLE001 - a baseline failure must not hide ours
                        print(f"# tensordict.store failed over {tr}: {type(err).__name__}: {err}")

                plan: list[tuple[str, str, str, str]] = [
                    ('write  store["x"] = t', "write", "SET", "set"),
                    ('read   store["x"]', "read", "GET + frombuffer", "get+fb"),
                    ('read   store["x"]', "read", "GET bytes", "get"),
                    ("from_tensordict(td)", "from_tensordict", "SET", "set"),
                    ("to_tensordict()", "to_tensordict", "GET + frombuffer", "get+fb"),
                ]
                for label, op, base_label, base in plan:
                    b = raw_times[base]
                    o = ours[op]
                    t = theirs.get(op)
                    goal = GOAL if base != "get" else None
                    rows.append(
                        [
                            label,
                            tr,
                            base_label,
                            _t(b),
                            _t(o),
                            fmt_ratio(o.median, b.median),
                            fmt_goal(o.median, b.median, goal),
                            _t(t),
                            fmt_ratio(t.median, b.median) if t else "-",
                        ]
                    )
        finally:
            raw.cleanup()

        hop = sync_hop_cost()
        headers = [
            "operation",
            "transport",
            "raw baseline",
            "raw ms",
            "tdstore ms",
            "tdstore/raw",
            "goal",
            "tensordict.store ms",
            "tensordict.store/raw",
        ]
        notes = [
            "ratio = median time / median raw time (lower is better; 1.00x = parity with hand-written redis.asyncio).",
            "raw = redis.asyncio + hiredis on the same server and transport, awaited inside its own event loop.",
            "from_tensordict includes connecting a new client and loading tdstore's scripts; the new store is "
            "removed (untimed) after each run.",
            f"one blocking tdstore call's thread hop to its IO loop, without I/O: {hop * 1e6:.0f} us (median).",
        ]
        if competitor is None:
            notes.append("tensordict.store.TensorDictStore: not importable (or --no-baseline): columns empty.")
        print_table("whole 64 MiB entry", headers, rows, notes)


if __name__ == "__main__":
    main()
