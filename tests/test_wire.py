"""redis-py's private parts, used in tdstore/_backend/wire.py only (issue 25, item 2).

The blocking drivers and the streamed large writes read private attributes of redis-py's
connections. A release that moves them must fail here, loudly, naming what moved; and
tdstore must still work without them, on redis-py's public API (tested by taking them away).
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import redis
import torch
from tensordict import TensorDict

import tdstore
from tdstore import TensorDictStore
from tdstore._backend import large as _large
from tdstore._backend import wire

#: The attributes of redis-py's connections and parsers that are private (checked by name).
PRIVATE_ATTRS = {"_sock", "_parser", "_reader", "_writer", "_buffer", "_hiredis_PushNotificationType"}


def test_the_private_parts_are_where_wire_reads_them():
    """Fails on a redis-py release that moved any of them: bound the pin in pyproject.toml
    below it, or teach wire.py where they went (wire.probe names each)."""
    assert wire.MISSING == (), (
        f"redis-py {redis.__version__} lacks {', '.join(wire.MISSING)}: tdstore falls back to the "
        "public API (slower); see tdstore/_backend/wire.py"
    )
    assert wire.direct_ok() and wire.streamable()


def test_probe_names_what_a_release_lacks(monkeypatch):
    monkeypatch.setattr(wire, "_HiredisParser", None)
    monkeypatch.setattr(wire, "NOT_ENOUGH_DATA", None)
    owner = next(k for k in redis.asyncio.connection.Connection.__mro__ if "connect_check_health" in vars(k))
    monkeypatch.delattr(owner, "connect_check_health")
    missing = wire.probe()
    assert "redis._parsers._HiredisParser" in missing
    assert "redis._parsers.hiredis.NOT_ENOUGH_DATA" in missing
    assert "redis.asyncio.connection.Connection.connect_check_health" in missing
    assert set(missing) <= set(wire.SYNC_PARTS) | set(wire.ASYNC_PARTS)


def test_no_private_redis_py_part_outside_wire():
    """Every import from ``redis._*`` and every read of a private connection attribute is in wire.py."""
    root = pathlib.Path(tdstore.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() == "_backend/wire.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "redis":
                if any(part.startswith("_") for part in (node.module or "").split(".")):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: from {node.module}")
            elif isinstance(node, ast.Import):
                found += [
                    f"{path.relative_to(root)}:{node.lineno}: import {a.name}" for a in node.names
                    if a.name.split(".")[0] == "redis" and any(p.startswith("_") for p in a.name.split("."))
                ]
            elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_ATTRS:
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    continue  # (a class of tdstore's own attribute of that name)
                found.append(f"{path.relative_to(root)}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.Constant) and node.value in PRIVATE_ATTRS:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
    assert found == []


@pytest.fixture
def without_private_parts(monkeypatch):
    """A redis-py without any of the parts: every use of one fails the test."""
    monkeypatch.setattr(wire, "MISSING", wire.SYNC_PARTS + wire.ASYNC_PARTS)

    def used(*_args, **_kwargs):
        raise AssertionError("a private part of redis-py was used")

    for name in ("socket_of", "exchange_sync", "send_sync", "_hiredis_reader", "_send_streamed"):
        monkeypatch.setattr(wire, name, used)
    # small thresholds: the streamed writes and the piece reads run on small entries
    monkeypatch.setattr(_large, "READ_MIN", 4096)
    monkeypatch.setattr(_large, "WRITE_MIN", 4096)


def test_every_path_works_on_the_public_api(real_server, without_private_parts):
    """Whole, indexed (large runs: the armed writes) and non-tensor writes, appends, samples,
    reads of large entries: the same results through the IO loop's public-API paths alone."""
    kw = real_server.connection_kwargs()
    store = TensorDictStore(batch_size=[16], **kw)
    assert store._conn.direct_client() is None
    ref = TensorDict(
        {"x": torch.arange(16 * 1024, dtype=torch.float32).reshape(16, 1024), "y": torch.zeros(16, 3, dtype=torch.int64)},
        [16],
    )
    store.update(ref)
    for i in range(3):
        rows = TensorDict({"x": torch.full((4, 1024), float(i)), "y": torch.full((4, 3), i)}, [4])
        store[4 * i : 4 * i + 4] = rows
        ref[4 * i : 4 * i + 4] = rows
    store.set_at_("y", torch.tensor([7, 8, 9]), 15)
    ref.set_at_("y", torch.tensor([7, 8, 9]), 15)
    store["s"] = "text"
    ref["s"] = "text"
    got = TensorDictStore.from_store(td_id=store.td_id, **kw).to_tensordict()
    assert (got == ref).all() and got["s"] == "text"

    ring = TensorDictStore.from_schema({"obs": ([256], torch.float32)}, batch_size=[64], **kw)
    for k in range(5):
        idx = ring.extend(TensorDict(obs=torch.full((8, 256), float(k)), batch_size=[8]))
        assert (ring[idx]["obs"] == k).all()
    assert ring.ring_state().valid == 40
    sample = ring.sample(32)
    assert sample["obs"].shape == (32, 256) and set(sample["obs"][:, 0].tolist()) <= {0.0, 1.0, 2.0, 3.0, 4.0}
    for s in (store, ring):
        s.clear_redis()
        s.close()
