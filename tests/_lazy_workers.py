"""Worker for tests/test_lazy.py: a fresh process that reconnects to a lazy store and reads it.

Usage: ``python _lazy_workers.py JOBS.json``, a list of jobs ``["by_id", '<json {td_id, kwargs}>', OUT]``
or ``["pickled", HANDLE.pkl, OUT]``, each writing the pickled ``to_tensordict()``
result to OUT, as :func:`describe` gives it (torch cannot pickle every dtype, e.g. uint16);
or ``["writer", '<json request>', OUT]`` (see :func:`write_stamps`), or ``["adder", '<json
{td_id, kwargs, count}>', OUT]``: ``count`` times ``store.add_(1)``.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from typing import Any


def describe(td: Any) -> Any:
    """A picklable exact description of a (lazy) tensordict: structure, dtypes, shapes, bytes."""
    import torch
    from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack

    if isinstance(td, LazyStackedTensorDict):
        return ("lazy", td.stack_dim, list(td.batch_size), [describe(m) for m in td.tensordicts])
    out = []
    for key, value in sorted(td.items(), key=lambda kv: str(kv[0])):
        if isinstance(value, (NonTensorData, NonTensorStack)):
            out.append((key, type(value).__name__, list(value.batch_size), value.tolist()))
        elif isinstance(value, torch.Tensor):
            flat = value.contiguous().reshape(-1)
            raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
            out.append((key, str(value.dtype), list(value.shape), raw))
        else:
            out.append((key, "td", list(value.batch_size), describe(value)))
    return ("td", list(td.batch_size), out)


def write_stamps(request: dict[str, Any], out: str) -> None:
    """Writes ``count`` whole elements, each with every value set to a fresh stamp.

    The stamps written to each element go to ``out`` (JSON), for the test to check the
    final values against. Bounded: ``count`` writes.
    """
    import random

    import torch
    from tensordict import TensorDict

    from tdstore import LazyStackedTensorDictStore

    store = LazyStackedTensorDictStore.from_store(td_id=request["td_id"], **request["kwargs"])
    rng = random.Random(request["seed"])
    written: dict[int, list[int]] = {}
    try:
        for i in range(request["count"]):
            j = rng.randrange(request["n"])
            stamp = request["writer"] * 100_000 + i + 1
            store[j] = TensorDict(
                {"a": torch.full((j + 1,), float(stamp), dtype=torch.float64), "b": torch.full((4,), stamp)}, []
            )
            written.setdefault(j, []).append(stamp)
    finally:
        store.close()
    Path(out).write_text(json.dumps(written))


def main() -> None:
    """Runs every job of the JSON file argv[1]: ``[mode, arg, out]`` each (see the module doc)."""
    from tdstore import LazyStackedTensorDictStore

    for mode, arg, out in json.loads(Path(sys.argv[1]).read_text()):
        if mode == "adder":
            request = json.loads(arg)
            store = LazyStackedTensorDictStore.from_store(td_id=request["td_id"], **request["kwargs"])
            try:
                for _ in range(request["count"]):
                    store.add_(1)
            finally:
                store.close()
            Path(out).write_text("done")
            continue
        if mode == "writer":
            write_stamps(json.loads(arg), out)
            continue
        if mode == "by_id":
            request = json.loads(arg)
            store = LazyStackedTensorDictStore.from_store(td_id=request["td_id"], **request["kwargs"])
        elif mode == "pickled":
            store = pickle.loads(Path(arg).read_bytes())
        else:
            raise SystemExit(f"unknown mode {mode!r}")
        try:
            Path(out).write_bytes(pickle.dumps(describe(store.to_tensordict())))
        finally:
            store.close()


if __name__ == "__main__":
    main()
