"""Workers of tests/test_kill.py (killed with SIGKILL mid-operation) and the wire checker.

Each worker loops, bounded in count and time, over one kind of large operation and
records in a shared ``phase`` array what it is doing (``phase[0]``) and how many cycles
it finished (``phase[1]``), so the test can report where the kills landed.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore._core.codec import dtype_from_name, tensor_nbytes
from tdstore._core.keys import decode_path

IDLE, CREATE, WRITE, CLEAR = 0, 1, 2, 3
PHASES = {IDLE: "between", CREATE: "create", WRITE: "write", CLEAR: "clear"}

#: a large schema: ~2 x 56 MB zero-filled entries beside small ones, nested keys included
BIG_SCHEMA = {
    "obs": ([84, 84, 3], torch.uint8),
    "next_obs": ([84, 84, 3], torch.uint8),
    ("agent", "action"): ([6], torch.float32),
    ("agent", "reward"): ([], torch.float32),
    "done": ([], torch.bool),
}
BIG_ROWS = 2048


def schema_cycler(conn: dict[str, Any], prefix: str, phase: Any, rounds: int, duration: float) -> None:
    """from_schema of a large store, then clear_redis, over and over."""
    deadline = time.monotonic() + duration
    for i in range(rounds):
        if time.monotonic() > deadline:
            break
        phase[0] = CREATE
        store = TensorDictStore.from_schema(BIG_SCHEMA, batch_size=[BIG_ROWS], prefix=prefix, td_id=f"s{os.getpid()}-{i}", **conn)
        phase[0] = CLEAR
        store.clear_redis()
        phase[0] = IDLE
        store.close()
        phase[1] += 1


def cycler_values(n: int = 32) -> tuple[TensorDict, dict[str, torch.Tensor]]:
    """The tensordict created and the update written by tensordict_cycler (built before the fork:
    a forked child must not run torch's parallel kernels, whose thread pool the fork breaks)."""
    td = TensorDict({f"e{j}": torch.full((n, 16 * 1024), 1, dtype=torch.int32) for j in range(8)}, batch_size=[n])
    td["nested", "x"] = torch.ones(n, 3)
    td["label"] = "created"
    update = {f"e{j}": torch.full((n, 16 * 1024), 2, dtype=torch.int32) for j in range(8)}
    return td, update


def tensordict_cycler(
    conn: dict[str, Any], prefix: str, phase: Any, rounds: int, duration: float, values: Any
) -> None:
    """from_tensordict of many entries (2 MB each), a multi-entry update, then clear_redis, over and over."""
    td, update = values
    deadline = time.monotonic() + duration
    for i in range(rounds):
        if time.monotonic() > deadline:
            break
        phase[0] = CREATE
        store = TensorDictStore.from_tensordict(td, prefix=prefix, td_id=f"t{os.getpid()}-{i}", **conn)
        phase[0] = WRITE
        store.update(update)
        phase[0] = CLEAR
        store.clear_redis()
        phase[0] = IDLE
        store.close()
        phase[1] += 1


def check_wire(client: Any, prefix: str, clean: bool = False) -> dict[str, int]:
    """Counts broken invariants among every key under ``prefix``.

    Returns ``stores``, ``sealed`` (stores of a clear killed between its seal and its delete:
    deleted for every handle; the next ``clear_redis()`` or ``tdstore rm`` frees the keys), ``orphan_keys`` (a key of a store whose meta hash is gone, a data key
    no registry entry names, a tmp key), ``missing_entries`` (registered, but the data key is
    absent or has the wrong length) and ``mixed_values`` (a store written by
    tensordict_cycler whose int entries do not all hold one value). With ``clean``, every key
    under ``prefix`` is deleted after the check.
    """
    by_store: dict[str, set[bytes]] = {}
    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        text = key.decode()
        td_id = text[text.index("{") + 1 : text.index("}")]
        by_store.setdefault(td_id, set()).add(key)
    orphans = missing = mixed = stores = sealed = 0
    for td_id, keys in by_store.items():
        base = f"{prefix}:{{{td_id}}}"
        meta_key = f"{base}:meta".encode()
        if meta_key not in keys:
            orphans += len(keys)
            continue
        stores += 1
        if client.hexists(meta_key, "clearing") and not client.hexists(meta_key, "lv"):
            sealed += 1  # a clear_redis() killed between its two steps: the next clear finishes it
        allowed = {meta_key, f"{base}:reg".encode(), f"{base}:wv".encode(), f"{base}:ring".encode()}
        values = set()
        for field, raw in client.hgetall(f"{base}:reg").items():
            meta = json.loads(raw)
            if meta.get("k") == "td":
                continue
            key = f"{base}:d:{field.decode()}".encode()
            allowed.add(key)
            if key not in keys:
                missing += 1
                continue
            if meta.get("k") == "t":
                want = tensor_nbytes(tuple(meta["shape"]), dtype_from_name(meta["dtype"]))
                if client.strlen(key) != want:
                    missing += 1
                elif meta["dtype"] == "int32" and decode_path(field)[0].startswith("e"):
                    data = torch.frombuffer(bytearray(client.get(key)), dtype=torch.int32)
                    values.update(int(v) for v in torch.aminmax(data))
        mixed += int(len(values) > 1)
        orphans += len(keys - allowed)
    if clean:  # the next check looks at what the next kill leaves only
        for keys in by_store.values():
            client.delete(*keys)
    return {"stores": stores, "sealed": sealed, "orphan_keys": orphans, "missing_entries": missing, "mixed_values": mixed}
