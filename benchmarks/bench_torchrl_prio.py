"""Prioritized TorchRL sampling: ``rb.sample()`` next to the store's own ``sample(n, prioritized=True)``.

    # TorchRL 0.14.1 pins tensordict<0.15: run it where tensordict 0.14.3 is imported, e.g.
    pip install --no-deps --target /tmp/td014 tensordict==0.14.3 torchrl==0.14.1 hoptorch==0.1.4
    PYTHONPATH=/tmp/td014 python benchmarks/bench_torchrl_prio.py --server valkey

A ``TensorDictReplayBuffer`` on a ``TensorDictStoreStorage`` of ``--capacity`` rows (default
2,048) of obs (``--obs`` float32 values, default 5,376: 21 KB a row), with a
``TensorDictStorePrioritizedSampler`` (alpha 0.6, beta 0.4) and random priorities. Timed,
interleaved: ``rb.sample()`` of ``--sample`` rows (default 256), and
``store.sample(256, prioritized=True, return_info=True)`` on the same store. The sampler
hands the rows it read to the storage, so the buffer's ``storage.get(index)`` reads nothing:
the goal is ``rb.sample()`` <= 1.2x the store's time (issue 26, item 4). A third case,
``rb.sample()`` with the hand-over defeated (the rows read again by ``storage.get``), shows
what the hand-over saves.

The slice samplers the same way: a ``TensorDictStoreSliceSampler`` and a
``TensorDictStorePrioritizedSliceSampler`` (``--slice-len`` rows a slice, default 8; episodes
of 50 rows marked by ``("next", "done")``) against ``store.sample_slices`` of the same slices,
uniform and prioritized, with the same 1.2x goal; TorchRL's own ``SliceSampler`` on an
in-memory ``LazyTensorStorage`` of the same rows is printed beside them for reference.
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
    fmt_goal,
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

GOAL = 1.2


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=2048, help="rows in the buffer (default 2048)")
    parser.add_argument("--obs", type=int, default=5376, help="float32 values of obs per row (default 5376: 21 KB)")
    parser.add_argument("--sample", type=int, default=256, help="rows per sample (default 256)")
    parser.add_argument("--slice-len", type=int, default=8, help="rows per slice of the slice cases (default 8)")
    args = parse(parser)
    import tensordict
    import torchrl
    from torchrl.data import TensorDictReplayBuffer

    from tdstore.torchrl import TensorDictStorePrioritizedSampler, TensorDictStoreStorage, TensorDictStoreWriter


    with bench_server(args.server) as server:
        print(f"# {server_banner(server)}; torch {torch.__version__}, tensordict {tensordict.__version__}, "
              f"torchrl {torchrl.__version__}; load {load_average()}")
        for transport in transports(args):
            conn = server.connection_kwargs(unix=transport == "unix")
            storage = TensorDictStoreStorage(args.capacity, **conn)
            rb = TensorDictReplayBuffer(
                storage=storage, sampler=TensorDictStorePrioritizedSampler(0.6, 0.4),
                writer=TensorDictStoreWriter(), batch_size=args.sample,
            )
            try:
                for start in range(0, args.capacity, 256):
                    rows = min(256, args.capacity - start)
                    rb.extend(TensorDict(obs=torch.rand(rows, args.obs), batch_size=[rows]))
                rb.update_priority(torch.arange(args.capacity), torch.rand(args.capacity) + 0.01)
                store = storage.store

                def reread(rb: TensorDictReplayBuffer = rb) -> object:
                    _, info = rb.sample(return_info=True)
                    return rb.storage.get(info["index"].clone())  # (a copy: read from the server again)

                cases = {
                    "store.sample(prioritized=True)": timed(
                        lambda store=store, n=args.sample: store.sample(n, prioritized=True, return_info=True)
                    ),
                    "rb.sample()": timed(lambda rb=rb: rb.sample()),
                    "rb.sample() + a second read": timed(reread),
                }
                hits = storage.handoff_hits
                got = compare(cases, repeat=max(args.repeat, 15), warmup=args.warmup)
                ref = got["store.sample(prioritized=True)"].median
                rows = [[name, fmt_ms(t.median), fmt_ratio(t.median, ref)] for name, t in got.items()]
                notes = [
                    f"rb.sample() / store.sample(prioritized=True): {fmt_goal(got['rb.sample()'].median, ref, GOAL)}",
                    f"rows handed over (not read again): {storage.handoff_hits - hits} of "
                    f"{2 * (max(args.repeat, 15) + args.warmup)} rb.sample() calls",
                ]
                print_table(
                    f"{transport}: sample {args.sample} of {args.capacity} rows of {args.obs * 4 / 1024:.0f} KB; medians in ms",
                    ["call", "ms", "vs store"], rows, notes,
                )
            finally:
                store = storage._storage
                if store is not None:
                    store.clear_redis()
                    store.close()
    slice_cases(args, TensorDictReplayBuffer)


def slice_cases(args: object, TensorDictReplayBuffer: type) -> None:
    """rb.sample() with the slice samplers against store.sample_slices of the same slices."""
    with bench_server(args.server) as server:
        for transport in transports(args):
            _slice_transport(args, TensorDictReplayBuffer, server.connection_kwargs(unix=transport == "unix"), transport)


def _slice_transport(args: object, TensorDictReplayBuffer: type, conn: dict, transport: str) -> None:
    from torchrl.data import LazyTensorStorage, SliceSampler

    from tdstore.torchrl import (
        TensorDictStorePrioritizedSliceSampler,
        TensorDictStoreSliceSampler,
        TensorDictStoreStorage,
        TensorDictStoreWriter,
    )

    n, length, capacity = args.sample, args.slice_len, args.capacity
    done = torch.zeros(capacity, 1, dtype=torch.bool)
    done[49::50] = True  # episodes of 50 rows
    data = TensorDict(obs=torch.rand(capacity, args.obs), next=TensorDict(done=done, batch_size=[capacity]), batch_size=[capacity])
    made = []
    try:
        buffers = {}
        for name, sampler in (
            ("uniform", TensorDictStoreSliceSampler(slice_len=length)),
            ("prioritized", TensorDictStorePrioritizedSliceSampler(0.6, 0.4, slice_len=length)),
        ):
            storage = TensorDictStoreStorage(capacity, **conn)
            rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, writer=TensorDictStoreWriter(), batch_size=n)
            for start in range(0, capacity, 256):
                rb.extend(data[start : start + 256])
            made.append(storage)
            buffers[name] = rb
        buffers["prioritized"].sample()  # (enables the priorities)
        buffers["prioritized"].update_priority(torch.arange(capacity), torch.rand(capacity) + 0.01)
        ref = TensorDictReplayBuffer(storage=LazyTensorStorage(capacity), sampler=SliceSampler(slice_len=length), batch_size=n)
        ref.extend(data)
        uni, pri = buffers["uniform"].storage.store, buffers["prioritized"].storage.store
        key = ("next", "done")
        cases = {
            "store.sample_slices()": timed(lambda: uni.sample_slices(n // length, length, end_key=key)),
            "rb.sample(), slices": timed(lambda: buffers["uniform"].sample()),
            "store.sample_slices(prioritized=True)": timed(
                lambda: pri.sample_slices(n // length, length, end_key=key, prioritized=True, return_info=True)
            ),
            "rb.sample(), prioritized slices": timed(lambda: buffers["prioritized"].sample()),
            "TorchRL SliceSampler, in memory": timed(lambda: ref.sample()),
        }
        got = compare(cases, repeat=max(args.repeat, 15), warmup=args.warmup)
        base = {
            "rb.sample(), slices": "store.sample_slices()",
            "rb.sample(), prioritized slices": "store.sample_slices(prioritized=True)",
        }
        rows = [
            [name, fmt_ms(t.median), fmt_ratio(t.median, got[base[name]].median) if name in base else ""]
            for name, t in got.items()
        ]
        notes = [f"{name} / {of}: {fmt_goal(got[name].median, got[of].median, GOAL)}" for name, of in base.items()]
        print_table(
            f"{transport}: {n // length} slices of {length} of {capacity} rows of {args.obs * 4 / 1024:.0f} KB; medians in ms",
            ["call", "ms", "vs store"], rows, notes,
        )
    finally:
        for storage in made:
            if storage._storage is not None:
                storage._storage.clear_redis()
                storage._storage.close()

if __name__ == "__main__":
    main()
