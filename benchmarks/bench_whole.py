"""Whole-entry throughput (issue "core"): one 64 MB float32 entry (or --shape) vs raw redis-py SET/GET.

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

import torch
from _common import (
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

SHAPE = (16, 1024, 1024)  # 64 MiB of float32
GOAL = 1.0


def _t(timing: Timing | None) -> str:
    if timing is None:
        return "-"
    return f"{fmt_ms(timing.median)} ({fmt_ms(timing.min)})"


class _Subject:
    """One store class under test, connected to the server over one transport."""

    def __init__(self, cls: Any, kwargs: dict[str, Any], tensor: torch.Tensor, td: TensorDict) -> None:
        self.cls, self.kwargs, self.tensor, self.td = cls, kwargs, tensor, td
        self.store = cls(batch_size=[tensor.shape[0]], **kwargs)
        self.store["x"] = tensor
        back = self.store["x"]
        assert torch.equal(back, tensor), f"{cls.__module__}: read back differs"
        local = self.store.to_tensordict()
        assert torch.equal(local["x"], tensor), f"{cls.__module__}: to_tensordict differs"
        self._made: list[Any] = []

    def cases(self, group: str) -> dict[str, Callable[[], float]]:
        store, tensor = self.store, self.tensor
        if group == "write":

            def write() -> None:
                store["x"] = tensor

            def upload() -> None:
                self._made.append(self.cls.from_tensordict(self.td, **self.kwargs))

            return {"write": timed(write), "from_tensordict": timed(upload, after=self._drop)}
        return {"read": timed(lambda: store["x"]), "to_tensordict": timed(store.to_tensordict)}

    def _drop(self) -> None:
        while self._made:
            s = self._made.pop()
            s.clear_redis()
            s.close()

    def close(self) -> None:
        self._drop()
        self.store.clear_redis()
        self.store.close()


def main() -> None:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--no-baseline", action="store_true", help="skip tensordict.store.TensorDictStore")
    parser.add_argument(
        "--shape", default=",".join(map(str, SHAPE)),
        help="the float32 entry's shape, comma-separated (default 16,1024,1024: 64 MiB; 256: 1 KiB, where the "
        "cost per call shows)",
    )  # fmt: skip
    args = parse(parser)
    rep, warm = args.repeat, args.warmup
    shape = tuple(int(n) for n in args.shape.split(","))

    torch.manual_seed(0)
    tensor = torch.randn(*shape)
    td = TensorDict({"x": tensor}, batch_size=[shape[0]])
    nbytes = tensor.numel() * tensor.element_size()
    competitor = None if args.no_baseline else TDStoreBaseline

    with bench_server(args.server) as srv:
        size = f"{nbytes / 2**20:.0f} MiB" if nbytes >= 2**20 else f"{nbytes:,} bytes"
        print(f"# bench_whole: one {list(shape)} float32 entry ({size})")
        print(f"# {datetime.datetime.now().isoformat(timespec='minutes')}; {server_banner(srv)}")
        print(f"# load average at start: {load_average()}")
        print(f"# each cell: median (min) ms of {rep} runs after {warm} warm-up runs; cases interleaved")
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
                    return tensor_from_bytes(await c.get(key), torch.float32, shape)

                raw.call(tr, raw_set)
                check = raw.call(tr, raw_get_tensor)
                assert torch.equal(check, tensor), "raw round trip differs (bulk length bug?)"
                del check

                subjects = {"tdstore": _Subject(TensorDictStore, kwargs, tensor, td)}
                if competitor is not None:
                    try:
                        subjects["tensordict.store"] = _Subject(competitor, kwargs, tensor, td)
                    except Exception as err:  # noqa: BLE001 - a baseline failure must not hide ours
                        print(f"# tensordict.store failed over {tr}: {type(err).__name__}: {err}")
                times: dict[str, Timing] = {}
                try:
                    groups = {
                        "write": {"raw:set": raw.timed(tr, raw_set)},
                        "read": {"raw:get": raw.timed(tr, raw_get), "raw:get+fb": raw.timed(tr, raw_get_tensor)},
                    }
                    for group, cases in groups.items():
                        for name, subject in subjects.items():
                            for op, case in subject.cases(group).items():
                                cases[f"{name}:{op}"] = case
                        times.update(compare(cases, repeat=rep, warmup=warm))
                finally:
                    for subject in subjects.values():
                        subject.close()

                plan: list[tuple[str, str, str, str]] = [
                    ('write  store["x"] = t', "write", "SET", "raw:set"),
                    ('read   store["x"]', "read", "GET + frombuffer", "raw:get+fb"),
                    ('read   store["x"]', "read", "GET bytes", "raw:get"),
                    ("from_tensordict(td)", "from_tensordict", "SET", "raw:set"),
                    ("to_tensordict()", "to_tensordict", "GET + frombuffer", "raw:get+fb"),
                ]
                for label, op, base_label, base in plan:
                    b = times[base]
                    o = times[f"tdstore:{op}"]
                    t = times.get(f"tensordict.store:{op}")
                    goal = GOAL if base != "raw:get" else None
                    rows.append(
                        [
                            label,
                            tr,
                            base_label,
                            _t(b),
                            _t(o),
                            fmt_ratio(o.median, b.median),
                            fmt_ratio(o.min, b.min),
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
            "(of mins)",
            "goal",
            "tensordict.store ms",
            "tensordict.store/raw",
        ]
        notes = [
            "ratio = median time / median raw time (lower is better; 1.00x = parity with hand-written "
            "redis.asyncio); '(of mins)' = min time / min raw time.",
            "raw = redis.asyncio + hiredis on the same server and transport, awaited inside its own event loop.",
            "from_tensordict includes connecting a new client and loading the store's scripts; the new store is "
            "removed (untimed) after each run.",
            f"one blocking tdstore call's thread hop to its IO loop, without I/O: {hop * 1e6:.0f} us (median).",
            f"load average at end: {load_average()}",
        ]
        if competitor is None:
            notes.append("tensordict.store.TensorDictStore: not importable (or --no-baseline): columns empty.")
        print_table(f"whole {size} entry", headers, rows, notes)


if __name__ == "__main__":
    main()
