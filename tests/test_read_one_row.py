"""One-row reads cost the server what a raw GETRANGE does (issue 16, goal 1).

A single run is read with a pipelined GETRANGE followed by an HGET of the layout version
(no script: Lua copies every byte it returns, 2-3.5x the server CPU of the GETRANGE). The
version is read after the bytes and only grows, so a layout change made by another client
before the read is still caught, and the read is planned again.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tdstore import TensorDictStore


def _script_calls(handle) -> int:
    client = handle.sync_client()
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_evalsha_ro"))


@pytest.mark.parametrize("kind", ["redis", "valkey", "redis6"])
def test_one_row_read_runs_no_script(request, kind):
    handle = request.getfixturevalue(f"{kind}_server")
    data = torch.arange(64 * 21, dtype=torch.float32).reshape(64, 21)
    store = TensorDictStore.from_tensordict(TensorDict(x=data, batch_size=[64]), **handle.connection_kwargs())
    store[3]  # the layout is cached
    before = _script_calls(handle)
    for i in (0, 5, 63):
        assert torch.equal(store[i]["x"], data[i])
        assert torch.equal(store["x"][i], data[i])
    assert _script_calls(handle) == before
    store.clear_redis()
    store.close()


def test_one_row_read_sees_a_layout_change_made_elsewhere(server):
    conn = server.connection_kwargs()
    store = TensorDictStore.from_tensordict(TensorDict(x=torch.zeros(8, 4), batch_size=[8]), **conn)
    assert torch.equal(store[2]["x"], torch.zeros(4))  # layout cached: x is float32 [8, 4]
    other = TensorDictStore.from_store(td_id=store.td_id, **conn)
    other["x"] = torch.arange(8 * 6, dtype=torch.int64).reshape(8, 6)  # new dtype and shape
    got = store[2]["x"]
    assert got.dtype == torch.int64 and torch.equal(got, torch.arange(12, 18))
    other.close()
    store.clear_redis()
    store.close()


def test_small_store_snapshot_skips_the_io_loop(server, monkeypatch):
    """to_tensordict() of small one-string entries reads on the direct client (one MULTI from
    the calling thread): the IO loop's read_entries is not called. Chunked entries still are."""
    from tdstore._backend import ops as _ops

    calls = []
    real = _ops.read_entries

    async def spy(*args, **kwargs):
        calls.append(1)
        return await real(*args, **kwargs)

    monkeypatch.setattr(_ops, "read_entries", spy)
    conn = server.connection_kwargs()
    data = TensorDict({f"k{i}": torch.full((10, 4), float(i)) for i in range(8)}, batch_size=[10])
    store = TensorDictStore.from_tensordict(data, **conn)
    direct = store._conn.direct_client() is not None
    got = store.to_tensordict()
    assert all(torch.equal(got[k], data[k]) for k in data.keys())
    assert len(calls) == (0 if direct else 1)
    other = TensorDictStore.from_store(td_id=store.td_id, **conn)
    other["k3"] = torch.arange(20, dtype=torch.float32).reshape(10, 2)  # a layout change made elsewhere
    assert torch.equal(store.to_tensordict()["k3"], torch.arange(20, dtype=torch.float32).reshape(10, 2))
    calls.clear()
    chunked = TensorDictStore.from_tensordict(data, chunk_bytes=64, **conn)
    assert torch.equal(chunked.to_tensordict()["k7"], data["k7"])
    assert len(calls) >= 1
    other.close()
    for s in (chunked, store):
        s.clear_redis()
        s.close()
