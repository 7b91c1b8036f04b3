"""Whole reads at the cached layout: what ``to_tensordict()`` sends, and the invariant it rests on.

A whole read of a handle that holds a layout reads the layout version and the bytes (one MGET)
in one MULTI, not the registry: when the version read is the cached one, the registry is the
cached one, because every step that changes the registry (or the layout fields of the meta
hash) bumps the version in that same step (docs/guarantees.md, 2). The tests check the wire
(what the read sends), the invariant across every kind of write of both store classes (a write
that changed the registry without a bump would let a cached handle decode with stale shapes or
dtypes), and that handles holding a stale layout read other handles' changes right.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict

from tdstore import LazyStackedTensorDictStore, TensorDictStore

#: meta hash fields that are not the layout: the version itself, the registry's field count
#: (which moves with the registry), and the store's expiry (expire(), persist())
NOT_LAYOUT = {"lv", "ne", "exp", "ttl"}


def _state(r: Any, td_id: str) -> tuple[int | None, dict[bytes, bytes], dict[bytes, bytes]]:
    """(layout version, registry, layout fields of the meta hash) as a plain client reads them."""
    base = f"tensordict:{{{td_id}}}"
    meta = r.hgetall(f"{base}:meta")
    lv = meta.get(b"lv")
    layout_meta = {k: v for k, v in meta.items() if k.decode() not in NOT_LAYOUT}
    return (None if lv is None else int(lv)), r.hgetall(f"{base}:reg"), layout_meta


class _Watch:
    """Records, for each named step, whether the registry or the layout fields changed and
    whether the layout version did."""

    def __init__(self, r: Any, td_id: str) -> None:
        self.r, self.td_id = r, td_id
        self.unbumped: list[str] = []
        self.changed: list[str] = []

    def step(self, name: str, fn: Callable[[], Any]) -> None:
        lv0, reg0, meta0 = _state(self.r, self.td_id)
        fn()
        lv1, reg1, meta1 = _state(self.r, self.td_id)
        if reg1 != reg0 or meta1 != meta0:
            self.changed.append(name)
            if lv1 == lv0:
                self.unbumped.append(name)


def _commands(r: Any) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in r.info("commandstats").items()}


def test_whole_read_at_the_cached_layout_reads_no_registry(real_server) -> None:
    """to_tensordict() of a handle holding its layout: the version and one MGET, no HGETALL
    (a real server: fakeredis has no INFO commandstats)."""
    server = real_server
    td = TensorDict({f"k{i}": torch.randn(5, 3) for i in range(6)}, batch_size=[5])
    td["n"] = TensorDict(y=torch.arange(5), batch_size=[5])
    store = TensorDictStore.from_tensordict(td, **server.connection_kwargs())
    store.to_tensordict()  # the layout is cached
    r = server.sync_client()
    before = _commands(r)
    got = store.to_tensordict()
    after = _commands(r)
    assert (got == td).all()
    sent = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    sent = {k: n for k, n in sent.items() if n and k not in ("info",)}
    assert sent.get("hgetall", 0) == 0 and sent.get("hmget", 0) == 0, sent
    assert sent.get("get", 0) == 0 and sent.get("mget") == 1, sent
    assert sent.get("hget") == 1, sent  # the layout version, with the bytes
    store.clear_redis()
    store.close()


def test_every_registry_change_bumps_the_layout_version(server) -> None:
    """Every write of a dense store that changes the registry (or the layout fields of the meta
    hash) bumps the layout version: a whole read relies on it to use its cached layout."""
    store = TensorDictStore(batch_size=[4], **server.connection_kwargs())
    r = server.sync_client()
    w = _Watch(r, store.td_id)
    w.step("new key", lambda: store.set("x", torch.zeros(4, 3)))
    w.step("same shape and dtype", lambda: store.set("x", torch.ones(4, 3)))
    w.step("new shape", lambda: store.set("x", torch.ones(4, 5)))
    w.step("new dtype", lambda: store.set("x", torch.ones(4, 5, dtype=torch.float64)))
    w.step("non-tensor", lambda: store.set("s", "hello"))
    w.step("non-tensor, same kind", lambda: store.set("s", "bye"))
    w.step("non-tensor, other kind", lambda: store.set("s", NonTensorData(data={1, 2}, batch_size=[4])))
    w.step("tensor over non-tensor", lambda: store.set("s", torch.zeros(4)))
    w.step("nested", lambda: store.set("n", TensorDict(y=torch.zeros(4, 2), batch_size=[4])))
    w.step("nested leaf", lambda: store.set(("n", "z"), torch.zeros(4)))
    w.step("update", lambda: store.update({"x": torch.zeros(4, 5, dtype=torch.float64), "u": torch.zeros(4, 1)}))
    w.step("update_", lambda: store.update_({"u": torch.ones(4, 1)}))
    w.step("set_", lambda: store.set_("u", torch.full((4, 1), 2.0)))
    w.step("fill_", lambda: store.fill_("u", 3.0))
    w.step("apply_", lambda: store.apply_(lambda t: t + 1))
    w.step("+=", lambda: store.__iadd__(1))
    w.step("rows of existing keys", lambda: store.__setitem__(slice(0, 2), store[0:2].to_tensordict()))
    w.step("rows with a new key", lambda: store.__setitem__(1, TensorDict(fresh=torch.ones(2), batch_size=[])))
    w.step("rename", lambda: store.rename_key_("fresh", "renamed"))
    w.step("delete", lambda: store.del_("renamed"))
    w.step("lock", store.lock_)
    w.step("unlock", store.unlock_)
    w.step("expire", lambda: store.expire(600))
    w.step("persist", store.persist)
    w.step("batch size", lambda: setattr(store, "batch_size", [4]))
    w.step("names", lambda: setattr(store, "names", ["rows"]))
    assert w.unbumped == [], f"registry changed without a layout version bump: {w.unbumped}"
    # the check sees what it is meant to: these steps did change the registry
    assert {"new key", "new shape", "new dtype", "non-tensor, other kind", "rows with a new key", "rename"} <= set(w.changed)
    assert "same shape and dtype" not in w.changed and "apply_" not in w.changed
    store.clear_redis()
    store.close()


def test_every_registry_change_of_a_lazy_store_bumps_the_layout_version(server) -> None:
    members = [TensorDict(obs=torch.zeros(k), s=NonTensorData("a"), batch_size=[]) for k in (2, 3, 4)]
    store = LazyStackedTensorDictStore.from_lazy_stack(LazyStackedTensorDict(*members, stack_dim=0), **server.connection_kwargs())
    r = server.sync_client()
    w = _Watch(r, store.td_id)
    w.step("element write", lambda: store.__setitem__(1, TensorDict(obs=torch.ones(3), batch_size=[])))
    w.step("element non-tensor", lambda: store.__setitem__(2, TensorDict(s=NonTensorData("b"), batch_size=[])))
    w.step("element non-tensor, other kind", lambda: store.__setitem__(0, TensorDict(s=NonTensorData({1}), batch_size=[])))
    w.step("new key", lambda: store.__setitem__("act", torch.zeros(3, 2)))
    w.step("replaced key", lambda: store.__setitem__("act", torch.zeros(3, 4, dtype=torch.int32)))
    w.step("in-place math", lambda: store.apply_(lambda t: t + 1))
    w.step("rename", lambda: store.rename_key_("act", "a2"))
    w.step("delete", lambda: store.del_("a2"))
    assert w.unbumped == [], f"registry changed without a layout version bump: {w.unbumped}"
    assert {"new key", "replaced key", "rename", "delete"} <= set(w.changed)
    store.clear_redis()
    store.close()


def test_the_check_sees_a_registry_change_without_a_bump(server) -> None:
    """The watch above flags a registry edit that leaves the version alone (a hand edit here)."""
    store = TensorDictStore.from_tensordict(TensorDict(x=torch.zeros(2), batch_size=[2]), **server.connection_kwargs())
    r = server.sync_client()
    reg = f"tensordict:{{{store.td_id}}}:reg"
    w = _Watch(r, store.td_id)
    meta = json.loads(r.hget(reg, "x"))
    w.step("hand edit", lambda: r.hset(reg, "x", json.dumps({**meta, "dtype": "int32"})))
    assert w.unbumped == ["hand edit"]
    store.clear_redis()
    store.close()


@pytest.mark.parametrize("cache_metadata", [True, False])
def test_cached_handle_reads_every_layout_change(server, cache_metadata: bool) -> None:
    """A handle holding an old layout reads each change of another handle whole and right,
    and its compare-and-set methods work on the new layout."""
    kwargs = server.connection_kwargs()
    ref = TensorDict(x=torch.arange(8.0).reshape(4, 2), n=TensorDict(y=torch.ones(4, 3), batch_size=[4]), batch_size=[4])
    reader = TensorDictStore.from_tensordict(ref, cache_metadata=cache_metadata, **kwargs)
    writer = TensorDictStore.from_store(td_id=reader.td_id, **kwargs)
    assert (reader.to_tensordict() == ref).all()
    changes: list[Callable[[], None]] = [
        lambda: ref.set("x", torch.arange(8, dtype=torch.int16).reshape(4, 2)),  # new dtype
        lambda: ref.set("x", torch.arange(12.0).reshape(4, 3)),  # new shape
        lambda: ref.set(("n", "y"), torch.zeros(4, 1, dtype=torch.float64)),
        lambda: ref.set("new", torch.full((4,), 7)),
        lambda: ref.del_("new"),
        lambda: ref.rename_key_("x", "x2"),
    ]
    for change in changes:
        change()
        for key in set(writer.keys(True, True)) - set(ref.keys(True, True)):
            writer.del_(key)
        writer.update(ref.to_dict())
        got = reader.to_tensordict()
        assert set(got.keys(True, True)) == set(ref.keys(True, True))
        for key, value in ref.items(True, True):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert torch.equal(got[key], value), key
    reader.apply_(lambda t: t * 2)
    assert torch.equal(writer["x2"], ref["x2"] * 2)
    reader.clear_redis()
    reader.close()
    writer.close()


def test_store_made_again_at_a_lower_version_is_read_at_once(server, monkeypatch) -> None:
    """A store deleted and made again starts at a random layout version, which may be lower
    than the one a handle holds: its next whole read takes the new layout (one refresh), not
    the one-step fallback after three stale tries."""
    kwargs = server.connection_kwargs()
    reader = TensorDictStore(batch_size=[4], **kwargs)
    reader["x"] = torch.arange(4.0)
    reader.to_tensordict()  # caches the layout
    other = TensorDictStore.from_store(td_id=reader.td_id, **kwargs)
    other.clear_redis()
    from tdstore._backend import ops as _ops

    monkeypatch.setattr(_ops.secrets, "randbits", lambda _bits: 0)  # the new store starts at version 0
    other["x"] = torch.arange(4, dtype=torch.int32)
    other["y"] = torch.ones(4)
    monkeypatch.undo()

    def no_one_step(*_args: Any) -> Any:
        raise AssertionError("a whole read fell back to the one-step read")

    monkeypatch.setattr(TensorDictStore, "_snapshot_one_step", no_one_step)
    got = reader.to_tensordict()
    assert got["x"].dtype == torch.int32 and torch.equal(got["x"], torch.arange(4, dtype=torch.int32))
    assert set(got.keys()) == {"x", "y"}
    lv = int(server.sync_client().hget(f"tensordict:{{{reader.td_id}}}:meta", "lv"))
    assert reader._conn.layout is not None and reader._conn.layout.lv == lv
    reader.clear_redis()
    reader.close()
    other.close()
