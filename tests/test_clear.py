"""``clear_redis()`` always finishes, with nothing left behind (issue 24, N3).

A clear seals the store in one step (lua/clear.lua "seal"), then lists its keys and deletes
them in a second one. Between the two no writer can change the store, so the clear never
retries, however busy its writers and however many other keys the server holds.
"""

from __future__ import annotations

import multiprocessing
import time

import _clear_workers as w
import pytest
import torch
from tensordict import TensorDict

from tdstore import StoreExistsError, StoreNotFoundError, TensorDictStore
from tdstore._backend import lifecycle
from tdstore.testing.counts import record

OTHERS = 200_000


def _fill(client, count: int) -> None:
    """``count`` other keys, in MSETs of 5000."""
    for start in range(0, count, 5000):
        client.mset({f"other:{i}": b"1" for i in range(start, min(start + 5000, count))})


def _left(client, store) -> list[bytes]:
    return [k for k in client.scan_iter(match=f"{store._conn.keys.base}:*", count=5000) if b":tmp:" not in k]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_clear_under_churn_beside_200k_keys_finishes(real_server, request):
    """N3: one process adding and deleting a key made every clear's check stale; beside 200,000
    other keys it gave up after 200 tries (48-55 s). Now it finishes in one listing, the churner's
    next write is refused as one to a deleted store, and no key of the store is left."""
    client = real_server.sync_client()
    _fill(client, OTHERS)
    conn = real_server.connection_kwargs()
    rounds = 3
    walls = []
    for r in range(rounds):
        store = TensorDictStore.from_schema({"x": ((3,), torch.float32)}, batch_size=[64], **conn)
        store.extend(TensorDict(x=torch.ones(4, 3), batch_size=[4]))
        ctx = multiprocessing.get_context("spawn")
        started, results = ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=w.churn, args=(conn, store.td_id, started, results, 60.0, 100_000))
        proc.start()
        try:
            assert started.wait(60), "the churner did not start"
            t0 = time.monotonic()
            store.clear_redis()
            walls.append(time.monotonic() - t0)
            got = results.get(timeout=90)
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        assert got["refused"] == 1, f"round {r}: the churner never found the store deleted: {got}"
        assert got["changes"] > 20
        assert _left(client, store) == [], f"round {r}: keys of the store were left"
        with pytest.raises(StoreNotFoundError):
            TensorDictStore.from_store(td_id=store.td_id, **conn)
        store.close()
    record(request, rounds=rounds, other_keys=OTHERS, worst_clear_s=round(max(walls), 3))
    # one SCAN of 200,000 keys in rounds of 1000 takes well under a second on loopback
    assert max(walls) < 15, walls


def test_an_interrupted_clear_is_finished_by_the_next(server, monkeypatch):
    """A clear cut off between its seal and its delete (the process died) leaves a sealed store:
    no handle finds it, a new store at the id is refused with a message that says why, and the
    next ``clear_redis()`` (or ``tdstore rm``) deletes every key."""
    conn = server.connection_kwargs()
    store = TensorDictStore.from_schema({"x": ((3,), torch.float32)}, batch_size=[8], **conn)
    store.extend(TensorDict(x=torch.ones(2, 3), batch_size=[2]))
    store["y"] = torch.ones(8)
    other = TensorDictStore.from_store(td_id=store.td_id, **conn)

    w.clear_killed_after_seal(store, monkeypatch)
    client = server.sync_client()
    assert _left(client, store) != []  # sealed, not deleted
    with pytest.raises(StoreNotFoundError):
        TensorDictStore.from_store(td_id=store.td_id, **conn)
    with pytest.raises(StoreNotFoundError):
        other["y"] = torch.zeros(8)
    with pytest.raises(StoreNotFoundError):
        other.extend(TensorDict(x=torch.ones(2, 3), y=torch.ones(2), batch_size=[2]))
    with pytest.raises(StoreExistsError, match="being deleted"):
        TensorDictStore.from_schema({"x": ((3,), torch.float32)}, batch_size=[8], td_id=store.td_id, **conn)
    other.clear_redis()
    assert _left(client, store) == []
    again = TensorDictStore.from_schema({"x": ((3,), torch.float32)}, batch_size=[8], td_id=store.td_id, **conn)
    assert again.to_tensordict()["x"].abs().sum() == 0
    again.clear_redis()
    for s in (store, other, again):
        s.close()


def test_a_write_after_the_seal_is_refused_and_leaves_nothing(server, monkeypatch):
    """Every kind of write that lands between the seal and the delete is refused as one to a
    deleted store (layout change, in-place write, append, expiry), and creates no key."""
    conn = server.connection_kwargs()
    store = TensorDictStore.from_schema({"x": ((3,), torch.float32)}, batch_size=[8], **conn)
    other = TensorDictStore.from_store(td_id=store.td_id, **conn)
    writes = {
        "new key": lambda: other.__setitem__("z", torch.ones(8)),
        "row write": lambda: other.__setitem__(slice(0, 2), TensorDict(x=torch.ones(2, 3), batch_size=[2])),
        "set_": lambda: other.set_("x", torch.ones(8, 3)),
        "append": lambda: other.extend(TensorDict(x=torch.ones(2, 3), batch_size=[2])),
        "expire": lambda: other.expire(60),
    }
    outcomes: dict[str, str] = {}
    real = lifecycle._listed_keys

    async def listed_then_write(client, keys, cluster_node):
        import asyncio

        for name, write in writes.items():
            try:
                await asyncio.to_thread(write)
                outcomes[name] = "written"
            except StoreNotFoundError:
                outcomes[name] = "refused"
        return await real(client, keys, cluster_node)

    monkeypatch.setattr(lifecycle, "_listed_keys", listed_then_write)
    store.clear_redis()
    assert outcomes == dict.fromkeys(writes, "refused")
    assert _left(server.sync_client(), store) == []
    store.close()
    other.close()


def test_a_clear_killed_after_its_seal_frees_the_store_within_the_grace(real_server, monkeypatch):
    """Killed after the doom step (before the delete), a clear leaves keys that all expire within
    ``CLEAR_GRACE_MS``: no key of the store outlives it, chunked entries and rings included."""
    conn = real_server.connection_kwargs()
    store = TensorDictStore.from_schema(
        {"x": ((3,), torch.float32), "big": ((64,), torch.float32)}, batch_size=[8], chunk_bytes=512, **conn
    )
    store.extend(TensorDict(x=torch.ones(2, 3), big=torch.ones(2, 64), batch_size=[2]))
    store["n"] = TensorDict(y=torch.ones(8, 2), batch_size=[8])
    client = real_server.sync_client()
    before = _left(client, store)
    assert any(b":c:" in k for k in before), "the test needs a chunked entry"

    w.clear_killed_after_seal(store, monkeypatch)
    left = _left(client, store)
    assert sorted(left) == sorted(before)  # sealed, not yet deleted
    ttls = {k: client.pttl(k) for k in left}
    assert all(0 < t <= lifecycle.CLEAR_GRACE_MS for t in ttls.values()), ttls
    store.close()


def test_a_new_store_made_at_the_id_is_not_doomed(server):
    """The doom step gives a grace only to a sealed store: a store made at the id meanwhile keeps
    its keys without an expiry."""
    conn = server.connection_kwargs()
    store = TensorDictStore.from_schema({"x": ((3,), torch.float32)}, batch_size=[8], **conn)
    keys = store._conn.keys
    runner = store._conn.runner
    doomed = store._conn.run(lambda c: runner.call(c, "clear", [keys.meta, keys.reg, keys.data(("x",))], ["doom", "60000"]))
    assert doomed == 0
    client = server.sync_client()
    assert client.pttl(keys.meta) == -1 and client.pttl(keys.data(("x",))) == -1
    store.clear_redis()
    store.close()
