"""TorchRL replay buffers: extend and sample times of tdstore's storage next to TorchRL's own.

    # TorchRL 0.14.1 pins tensordict<0.15: run it where tensordict 0.14.3 is imported, e.g.
    # as .ci/run does (a --no-deps --target folder first on PYTHONPATH):
    pip install --no-deps --target /tmp/td014 tensordict==0.14.3 torchrl==0.14.1 hoptorch==0.1.4
    PYTHONPATH=/tmp/td014 python benchmarks/bench_torchrl.py --server valkey

One ``ReplayBuffer`` per storage, all with ``--capacity`` rows (default 10,000) of
obs (``--obs`` float32 values, default 64), action (4 float32) and reward (float32):

* ``LazyTensorStorage``: TorchRL's in-memory storage (the floor: no server at all);
* ``TensorDictStoreStorage`` + ``TensorDictStoreWriter`` (tdstore): rows on the server,
  appended through the store's atomic cursor, so several processes can share the buffer;
* ``StoreStorage`` (TorchRL's own Redis-backed storage, over ``tensordict.store``), on the
  same server and transport, when it is importable.

Timed: ``rb.extend(batch)`` of ``--batch`` rows (default 256) into a full buffer, and
``rb.sample()`` of ``--sample`` rows (default 256). Ratios are time / LazyTensorStorage's
time and tdstore's time / StoreStorage's (lower is better for tdstore).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import (  # noqa: E402
    base_parser,
    bench_server,
    compare,
    fmt_ms,
    fmt_ratio,
    load_average,
    parse,
    print_table,
    server_banner,
    timed,
    transports,
)
from tensordict import TensorDict  # noqa: E402


def _batch(n: int, obs: int, value: float = 1.0) -> TensorDict:
    return TensorDict(
        obs=torch.full((n, obs), value),
        action=torch.full((n, 4), value),
        reward=torch.full((n,), value),
        batch_size=[n],
    )


def _buffers(conn: dict, args, transport: str) -> dict:
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    from tdstore.torchrl import TensorDictStoreStorage, TensorDictStoreWriter

    out = {
        "LazyTensorStorage (memory)": ReplayBuffer(storage=LazyTensorStorage(args.capacity), batch_size=args.sample),
        "tdstore TensorDictStoreStorage": ReplayBuffer(
            storage=TensorDictStoreStorage(args.capacity, **conn), writer=TensorDictStoreWriter(), batch_size=args.sample
        ),
    }
    try:
        from torchrl.data.replay_buffers.storages import StoreStorage

        if transport == "unix":
            theirs = StoreStorage(args.capacity, unix_socket_path=conn["unix_socket_path"])
        else:
            theirs = StoreStorage(args.capacity, host=conn["host"], port=conn["port"])
        out["torchrl StoreStorage (tensordict.store)"] = ReplayBuffer(storage=theirs, batch_size=args.sample)
    except Exception as exc:  # noqa: BLE001 - shown in the table, not fatal
        print(f"# torchrl StoreStorage not available: {type(exc).__name__}: {exc}")
    return out


def _cleanup(buffers: dict) -> None:
    for rb in buffers.values():
        storage = rb.storage
        store = getattr(storage, "_storage", None)
        for name in ("clear_redis", "close"):
            method = getattr(store, name, None)
            if callable(method) and type(store).__module__.startswith(("tdstore", "tensordict.store")):
                try:
                    method()
                except Exception as exc:  # noqa: BLE001
                    print(f"# cleanup of {type(storage).__name__}: {exc}")


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=10_000, help="rows in each buffer (default 10000)")
    parser.add_argument("--obs", type=int, default=64, help="float32 values of obs per row (default 64)")
    parser.add_argument("--batch", type=int, default=256, help="rows per extend (default 256)")
    parser.add_argument("--sample", type=int, default=256, help="rows per sample (default 256)")
    args = parse(parser)
    import tensordict
    import torchrl

    with bench_server(args.server) as server:
        print(f"# {server_banner(server)}; torch {torch.__version__}, tensordict {tensordict.__version__}, "
              f"torchrl {torchrl.__version__}; load {load_average()}")
        for transport in transports(args):
            conn = server.connection_kwargs(unix=transport == "unix")
            buffers = _buffers(conn, args, transport)
            try:
                fill = _batch(args.capacity, args.obs, 0.5)
                for rb in buffers.values():  # full buffers: every sample draws from all rows
                    for start in range(0, args.capacity, 1000):
                        rb.extend(fill[start : start + 1000])
                    assert len(rb) == args.capacity, (type(rb.storage).__name__, len(rb))
                batch = _batch(args.batch, args.obs, 2.0)
                extend = compare(
                    {name: timed(lambda rb=rb, batch=batch: rb.extend(batch)) for name, rb in buffers.items()},
                    repeat=max(args.repeat, 15), warmup=args.warmup,
                )
                sample = compare(
                    {name: timed(lambda rb=rb: rb.sample()) for name, rb in buffers.items()},
                    repeat=max(args.repeat, 15), warmup=args.warmup,
                )
                ref = "LazyTensorStorage (memory)"
                theirs = "torchrl StoreStorage (tensordict.store)"
                rows = []
                for name in buffers:
                    rows.append([
                        name,
                        fmt_ms(extend[name].median),
                        fmt_ratio(extend[name].median, extend[ref].median),
                        fmt_ms(sample[name].median),
                        fmt_ratio(sample[name].median, sample[ref].median),
                    ])
                notes = []
                ours = "tdstore TensorDictStoreStorage"
                if theirs in buffers:
                    notes.append(
                        f"tdstore / torchrl StoreStorage: extend {fmt_ratio(extend[ours].median, extend[theirs].median)}, "
                        f"sample {fmt_ratio(sample[ours].median, sample[theirs].median)}"
                    )
                print_table(
                    f"{transport}: extend {args.batch} rows, sample {args.sample} rows, of {args.capacity} "
                    f"(obs {args.obs} float32 + action 4 + reward); medians in ms",
                    ["storage", "extend ms", "vs memory", "sample ms", "vs memory"],
                    rows,
                    notes,
                )
            finally:
                _cleanup(buffers)


if __name__ == "__main__":
    main()
