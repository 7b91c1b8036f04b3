"""Memory limits and eviction: refused writes apply nothing; lost data is reported, never invented."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import tdstore
from tdstore import TensorDictStore
from tdstore.server import start_server
from tdstore.testing.counts import record


@pytest.mark.parametrize("kind", ["redis", "valkey", "redis6"])
def test_write_over_maxmemory_is_refused_whole(kind, wire, request):
    with start_server(kind, config={"maxmemory": "24mb", "maxmemory-policy": "noeviction"}) as srv:
        store = TensorDictStore(batch_size=[4], **srv.connection_kwargs())
        store["a"] = torch.zeros(4)
        refused = 1
        with pytest.raises(tdstore.ServerOutOfMemoryError, match=r"maxmemory.*Nothing of this operation was applied") as info:
            for i in range(20):  # 8 MB each: the server fills up
                store.update({f"big{i}": torch.zeros(4, 512 * 1024), f"small{i}": torch.ones(4)})
        assert store.td_id in str(info.value)
        # Redis refuses a write while it is over maxmemory (it does not predict the size of
        # one that would cross it): each attempt is refused whole or applied whole
        changed_on_refusal = applied = 0
        attempts = (
            lambda: store.update({"x": torch.zeros(4, 512 * 1024), "y": torch.ones(4)}),
            lambda: TensorDictStore.from_tensordict(TensorDict(z=torch.zeros(4, 512 * 1024), batch_size=[4]), **srv.connection_kwargs()),
            lambda: TensorDictStore.from_schema({"z": ([512 * 1024], torch.float32)}, batch_size=[4], **srv.connection_kwargs()),
            lambda: store.__setitem__(slice(0, 2), TensorDict(a=torch.ones(2), big0=torch.ones(2, 512 * 1024), batch_size=[2])),
        )
        expected_a = torch.zeros(4)
        for _ in range(3):
            for i, attempt in enumerate(attempts):
                before = wire(srv)
                try:
                    attempt()
                    applied += 1
                    if i == 3:  # the row write (no new string: tdstore's memory guard lets it through)
                        expected_a[0:2] = 1
                except tdstore.ServerOutOfMemoryError:
                    refused += 1
                    changed_on_refusal += int(wire(srv) != before)
        record(request, refused_writes=refused, applied_writes=applied, partial_effects=changed_on_refusal)
        assert changed_on_refusal == 0 and refused >= 1  # no tmp key, no half-made store, no partial update
        assert torch.equal(store["a"], expected_a)  # reads still work, and show each write whole or not at all
        store.close()


@pytest.mark.parametrize("kind", ["redis", "valkey"])
def test_evicted_data_is_never_returned_as_garbage(kind, request):
    with start_server(kind, config={"maxmemory": "12mb", "maxmemory-policy": "allkeys-random"}) as srv:
        stores = []
        for i in range(16):
            try:
                store = TensorDictStore(batch_size=[4], **srv.connection_kwargs())
                store["x"] = torch.full((4, 64 * 1024), float(i))  # 1 MB per store
                stores.append((i, store))
            except (tdstore.StoreNotFoundError, tdstore.DataLostError, tdstore.ServerOutOfMemoryError):
                continue  # evicted while being written, or refused while the server evicts
        intact = lost = garbage = 0
        for i, store in stores:
            for read in (lambda store=store: store["x"], lambda store=store: store[1:3]["x"]):
                try:
                    value = read()
                except (tdstore.DataLostError, tdstore.StoreNotFoundError):
                    lost += 1
                    continue
                if bool((value == float(i)).all()):
                    intact += 1
                else:
                    garbage += 1
            store.close()
        record(request, stores=len(stores), intact_reads=intact, lost_reported=lost, garbage_reads=garbage)
        assert garbage == 0 and lost > 0  # eviction happened, and was reported every time


def test_a_lost_registry_is_reported_not_taken_for_an_empty_store(server):
    """The meta hash counts the registry's entries, so a registry evicted as a whole (or
    deleted by hand) raises DataLostError instead of looking like a store with no keys."""
    kw = server.connection_kwargs()
    store = TensorDictStore(batch_size=[4], **kw)
    store["a"] = torch.ones(4)
    store.set(("n", "b"), torch.zeros(4, 2))
    store[1:3] = TensorDict(c=torch.full((2,), 7.0), batch_size=[2])  # created through an index
    assert set(store.keys(include_nested=True, leaves_only=True)) == {"a", ("n", "b"), "c"}
    store.del_("a")
    client = server.sync_client()
    assert client.hget(store._conn.keys.meta, "ne") == str(client.hlen(store._conn.keys.reg)).encode() == b"3"

    emptied = TensorDictStore(batch_size=[2], **kw)
    emptied["x"] = torch.ones(2)
    emptied.del_("x")  # every entry deleted: an empty store, not a lost one
    assert list(TensorDictStore.from_store(td_id=emptied.td_id, **kw).keys()) == []

    client.delete(store._conn.keys.reg)
    with pytest.raises(tdstore.DataLostError, match=rf"registry of .*{store.td_id}.* held 3 entries, 0 remain"):
        TensorDictStore.from_store(td_id=store.td_id, **kw)
    with pytest.raises(tdstore.DataLostError):
        store._conn.layout = None  # the next read refreshes the layout, as after another writer's change
        store["c"]
    for handle in (store, emptied):
        handle.close()
