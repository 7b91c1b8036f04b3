"""The TorchRL half of ``bench_replay.py``: TorchRL's in-process replay buffer, for reference.

Run by ``bench_replay.py`` in a Python where torchrl imports (TorchRL 0.14.1 pins
tensordict < 0.15, so it runs with e.g. ``PYTHONPATH=/tmp/td014``, see bench_torchrl.py),
with a JSON spec on stdin; prints one line ``RESULT_JSON {...}`` on stdout. It imports
no tdstore.

One ``ReplayBuffer(storage=LazyTensorStorage(rows))`` per sampler, filled with the same
rows as the other systems (obs uint8, action int64, reward float32), all in this
process's memory (no server):

* ``uniform``: ``RandomSampler``, ``rb.sample(256)`` (ms per batch);
* ``prio``: ``PrioritizedSampler(rows, alpha, beta)``, ``rb.sample(256, return_info=True)``
  then ``rb.update_priority(info["index"], priority)`` (ms per round). Its sum tree is a
  C++ extension (``torchrl._torchrl``); where it does not load, the error is reported.
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def main() -> None:
    spec = json.loads(sys.stdin.read())
    result: dict = {"cases": {}, "errors": {}}
    try:
        import tensordict
        import torch
        import torchrl
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, ReplayBuffer
        from torchrl.data.replay_buffers.samplers import PrioritizedSampler, RandomSampler
    except Exception as exc:  # noqa: BLE001 - reported to the driver
        result["errors"]["setup"] = f"torchrl does not import: {type(exc).__name__}: {exc}"
        print("RESULT_JSON " + json.dumps(result), flush=True)
        return
    torch.set_num_threads(1)
    result["versions"] = {
        "torchrl": torchrl.__version__,
        "tensordict": tensordict.__version__,
        "torch": torch.__version__,
    }
    rows, n, obs_shape = spec["rows"], spec["sample"], spec["obs_shape"]
    g = torch.Generator().manual_seed(0)
    chunk = 1024
    fill = TensorDict(
        obs=torch.randint(0, 256, (chunk, *obs_shape), dtype=torch.uint8, generator=g),
        action=torch.randint(0, 18, (chunk,), generator=g),
        reward=torch.rand(chunk, generator=g),
        batch_size=[chunk],
    )

    def per_op(fn) -> list[float]:
        for _ in range(spec["warmup"]):
            fn()
        runs = []
        for _ in range(spec["repeat"]):
            t = time.perf_counter()
            for _ in range(spec["ops"]):
                fn()
            runs.append((time.perf_counter() - t) / spec["ops"])
        return runs

    def buffer(sampler):  # type: ignore[no-untyped-def]
        rb = ReplayBuffer(storage=LazyTensorStorage(rows), sampler=sampler, batch_size=n)
        done = 0
        while done < rows:
            k = min(chunk, rows - done)
            rb.extend(fill[:k])
            done += k
        return rb

    try:
        rb = buffer(RandomSampler())
        result["cases"]["uniform"] = {"s_per_op": per_op(lambda: rb.sample(n))}
        del rb
    except Exception as exc:  # noqa: BLE001
        result["errors"]["uniform"] = f"{type(exc).__name__}: {exc}"
        print(traceback.format_exc(), file=sys.stderr)
    try:
        sampler = PrioritizedSampler(rows, alpha=spec["alpha"], beta=spec["beta"], eps=1e-8)
    except Exception as exc:  # noqa: BLE001
        why = f"{type(exc).__name__}: {exc}"
        try:  # the extension's own import error says why
            import torchrl._torchrl  # noqa: F401
        except Exception as err:  # noqa: BLE001
            why = f"torchrl._torchrl: {type(err).__name__}: {err}"
        result["errors"]["prio"] = f"does not load: {why}"
    else:
        try:
            rb = buffer(sampler)

            def prio_round() -> None:
                _batch, info = rb.sample(n, return_info=True)
                rb.update_priority(info["index"], torch.rand(n, generator=g))

            result["cases"]["prio"] = {"s_per_op": per_op(prio_round)}
        except Exception as exc:  # noqa: BLE001
            result["errors"]["prio"] = f"{type(exc).__name__}: {exc}"
            print(traceback.format_exc(), file=sys.stderr)
    print("RESULT_JSON " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
