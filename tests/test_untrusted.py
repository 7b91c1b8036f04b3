"""Untrusted data: a no-pickle switch and signed pickles (HMAC-SHA256 with a shared key)."""

from __future__ import annotations

import pytest
import torch
from tensordict import NonTensorData

import tdstore
from tdstore import TensorDictStore, UnsafePayloadError


class Custom:
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Custom) and other.x == self.x


def test_pickle_switch_refuses_reads_and_writes(server, wire):
    writer = TensorDictStore(**server.connection_kwargs())
    writer["obj"] = NonTensorData(data=Custom(3))
    writer["ok"] = NonTensorData(data={"json": [1, 2]})
    careful = TensorDictStore.from_store(td_id=writer.td_id, allow_pickle=False, **server.connection_kwargs())
    with pytest.raises(UnsafePayloadError, match="pickle is switched off"):
        careful["obj"]
    assert careful["ok"] == {"json": [1, 2]}  # JSON values still read
    before = wire(server)
    with pytest.raises(UnsafePayloadError, match="JSON"):
        careful["other"] = NonTensorData(data=Custom(4))
    assert wire(server) == before
    writer.close()
    careful.close()


def test_process_wide_switch(server, monkeypatch):
    writer = TensorDictStore(**server.connection_kwargs())
    writer["obj"] = NonTensorData(data=Custom(1))
    monkeypatch.setenv("TDSTORE_ALLOW_PICKLE", "0")
    careful = TensorDictStore.from_store(td_id=writer.td_id, **server.connection_kwargs())
    with pytest.raises(UnsafePayloadError):
        careful.to_tensordict()
    monkeypatch.delenv("TDSTORE_ALLOW_PICKLE")
    tdstore.set_pickle_policy(allow=False)
    try:
        with pytest.raises(UnsafePayloadError):
            TensorDictStore.from_store(td_id=writer.td_id, **server.connection_kwargs())["obj"]
    finally:
        tdstore.set_pickle_policy()  # back to the environment's default
    assert TensorDictStore.from_store(td_id=writer.td_id, **server.connection_kwargs())["obj"] == Custom(1)
    writer.close()
    careful.close()


def test_signed_pickles(server):
    signer = TensorDictStore(pickle_key=b"secret", batch_size=[2], **server.connection_kwargs())
    signer["obj"] = NonTensorData(data=Custom(7), batch_size=[2])
    same_key = TensorDictStore.from_store(td_id=signer.td_id, pickle_key="secret", **server.connection_kwargs())
    assert same_key["obj"] == Custom(7)
    wrong_key = TensorDictStore.from_store(td_id=signer.td_id, pickle_key=b"other", **server.connection_kwargs())
    with pytest.raises(UnsafePayloadError, match="does not verify"):
        wrong_key["obj"]
    no_key = TensorDictStore.from_store(td_id=signer.td_id, **server.connection_kwargs())
    with pytest.raises(UnsafePayloadError, match="signed"):
        no_key["obj"]
    # a forger without the key writes an unsigned pickle: readers with the key refuse it
    forger = TensorDictStore.from_store(td_id=signer.td_id, **server.connection_kwargs())
    forger["evil"] = NonTensorData(data=Custom(666), batch_size=[2])
    with pytest.raises(UnsafePayloadError, match="not signed"):
        same_key["evil"]
    # tampering with a signed payload is caught too
    client = server.sync_client()
    key = f"tensordict:{{{signer.td_id}}}:d:obj"
    raw = bytearray(client.get(key))
    raw[-2] ^= 1
    client.set(key, bytes(raw))
    with pytest.raises(UnsafePayloadError, match="does not verify"):
        same_key["obj"]
    for store in (signer, same_key, wrong_key, no_key, forger):
        store.close()


def test_index_writes_respect_the_policy(server):
    store = TensorDictStore(batch_size=[3], allow_pickle=False, **server.connection_kwargs())
    store["a"] = torch.zeros(3)
    store["tag"] = "x"
    from tensordict import NonTensorStack, TensorDict

    value = TensorDict(a=torch.ones(2), batch_size=[2])
    value["tag"] = NonTensorStack(Custom(1), Custom(2))
    with pytest.raises(UnsafePayloadError):
        store[0:2] = value
    assert torch.equal(store["a"], torch.zeros(3)) and store["tag"] == "x"
    store.close()
