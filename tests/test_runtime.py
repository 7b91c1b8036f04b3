"""The process runtime: one IO loop per process, fork safety, loop re-entry and timeouts."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import tdstore
from tdstore import TensorDictStore
from tdstore._backend import loop as _io


def test_one_io_loop_for_all_stores(real_server):
    kw = real_server.connection_kwargs()
    stores = [TensorDictStore(batch_size=[1], **kw) for _ in range(5)]
    for store in stores:
        store["a"] = torch.zeros(1)
    loops = [t for t in threading.enumerate() if t.name == "tdstore-io"]
    assert len(loops) == 1
    for store in stores:
        store.clear_redis()
        store.close()


@pytest.mark.multiprocess
def test_store_inherited_through_fork(real_server):
    store = TensorDictStore(batch_size=[4], **real_server.connection_kwargs())
    store["a"] = torch.arange(4)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a fork-based DataLoader worker would look like this
        code = 1
        try:
            ok = torch.equal(store["a"], torch.arange(4))
            store[1] = tdstore_td(torch.tensor(40))
            store["child"] = torch.ones(4)
            code = 0 if ok else 2
        finally:
            os.write(write, bytes([code]))
            os._exit(code)
    os.close(write)
    status = os.read(read, 1)
    os.waitpid(pid, 0)
    assert status == b"\x00"
    assert torch.equal(store["a"], torch.tensor([0, 40, 2, 3]))
    assert torch.equal(store["child"], torch.ones(4))  # visible to the parent's cached handle
    store.clear_redis()
    store.close()


def tdstore_td(value):
    from tensordict import TensorDict

    return TensorDict(a=value, batch_size=[])


def test_call_from_inside_the_io_loop_is_a_clear_error(server):
    store = TensorDictStore(batch_size=[1], **server.connection_kwargs())
    store["a"] = torch.zeros(1)
    errors = []

    async def inside():
        try:
            store["a"]
        except tdstore.EventLoopError as err:
            errors.append(err)

    import asyncio

    asyncio.run_coroutine_threadsafe(inside(), _io.get_loop()).result(10)
    assert errors and "IO loop" in str(errors[0])
    store.close()


def test_every_call_has_a_timeout(real_server):
    client = real_server.sync_client()
    store = TensorDictStore(batch_size=[1], timeout=0.5, **real_server.connection_kwargs())
    store["a"] = torch.zeros(1)
    # a server busy in a long script cannot answer: the call times out instead of hanging
    blocker = threading.Thread(target=lambda: _busy(client), daemon=True)
    blocker.start()
    import time

    time.sleep(0.4)  # the script is running: the server answers nobody for 2 s
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="did not answer within 0.5 s"):
            store["a"]
        assert time.monotonic() - start < 1.5
    finally:
        blocker.join(10)
    store.close()


def _busy(client):
    try:
        client.eval("local t = redis.call('TIME') local s = t[1] repeat t = redis.call('TIME') until t[1] - s >= 2 return 1", 0)
    except Exception:  # noqa: BLE001 - only the blocking matters
        pass


@pytest.mark.parametrize("kind", ["redis", "valkey"])
def test_busy_server_is_waited_for_and_nothing_is_applied_twice(kind):
    """Another client's script past busy-reply-threshold makes the server answer BUSY to
    everything: a read, a write and an append wait for it (retry policy) and each lands once."""
    from tdstore.server import start_server

    handle = start_server(kind, config={"busy-reply-threshold": "100"})
    try:
        client = handle.sync_client()
        store = TensorDictStore.from_schema({"x": ([2], torch.float32)}, batch_size=[8], **handle.connection_kwargs())
        blocker = threading.Thread(target=lambda: _busy(client), daemon=True)
        blocker.start()
        import time

        time.sleep(0.5)  # past the threshold: the server now answers BUSY
        probe = handle.sync_client()
        with pytest.raises(Exception, match="^BUSY "):
            probe.ping()
        probe.close()
        start = time.monotonic()
        store[0] = torch.ones(2)  # refused (BUSY), then sent again
        rows = store.extend(_rows(torch.full((1, 2), 2.0)))
        assert torch.equal(store["x"][:2], torch.tensor([[2.0, 2.0], [0.0, 0.0]])) and rows.tolist() == [0]
        assert time.monotonic() - start > 0.5  # it did wait for the script
        assert store.ring_state().total == 1  # the append landed once
        blocker.join(10)
        store.clear_redis()
        store.close()
        client.close()
    finally:
        handle.stop()


def _rows(x: torch.Tensor):
    from tensordict import TensorDict

    return TensorDict(x=x, batch_size=[x.shape[0]])
