"""Both store classes open their connection through ``open_connection`` (tdstore/_backend/connection.py).

The lazy class used to build a whole ``TensorDictStore`` only to take its connection; it must
not build one any more, and must take the same connection keywords.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore._backend.connection import Connection, open_connection
from tdstore.store import core as _dense


@pytest.fixture
def dense_inits(monkeypatch):
    """Counts the TensorDictStore objects built (the class itself runs as it is)."""
    calls: list[dict] = []
    init = _dense.TensorDictStore.__init__

    def counted(self, **kwargs):
        calls.append(kwargs)
        init(self, **kwargs)

    monkeypatch.setattr(_dense.TensorDictStore, "__init__", counted)
    return calls


def test_the_lazy_class_builds_no_dense_store(server, dense_inits):
    kw = server.connection_kwargs()
    stack = lazy_stack([TensorDict(x=torch.full((n,), float(n))) for n in (1, 2)])
    store = LazyStackedTensorDictStore.from_lazy_stack(stack, prefix="oc", timeout=7.0, progress=False, **kw)
    again = LazyStackedTensorDictStore.from_store(td_id=store.td_id, prefix="oc", batch_size=[2], **kw)
    assert torch.equal(again[1]["x"], torch.full((2,), 2.0))
    assert dense_inits == []
    assert isinstance(store._conn, Connection) and store._conn.timeout == 7.0 and store._conn.progress is False
    assert store._conn.keys.prefix == "oc" and store._conn.keys.td_id == store.td_id
    if server.kind != "fakeredis":  # a store on an in-process server cannot be pickled
        copy = pickle.loads(pickle.dumps(store))
        assert type(copy) is LazyStackedTensorDictStore and torch.equal(copy[0]["x"], torch.ones(1))
        copy.close()
    assert dense_inits == []
    store.clear_redis()
    store.close()
    again.close()


def test_open_connection_checks_its_keywords():
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0, got 0"):
        open_connection(td_id="x", timeout=0)
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
        LazyStackedTensorDictStore(td_id="x", timeout=-1)
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
        TensorDictStore(td_id="x", timeout=True)
    conn = open_connection(td_id="x", allow_pickle=False, pickle_key="k")
    assert conn.pickle_policy.allow is False and conn.pickle_policy.key == b"k"
    conn.close()
