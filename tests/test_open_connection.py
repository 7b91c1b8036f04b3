"""Both store classes open their connection through ``open_connection`` (tdstore/_backend/connect.py).

The lazy class used to build a whole ``TensorDictStore`` only to take its connection; it must
not build one any more, and must take the same connection keywords.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore._backend.connect import ConnectSpec, open_connection
from tdstore._backend.connection import Connection
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


def test_connect_spec_takes_the_connection_keywords_once():
    """``ConnectSpec.take``: a constructor's connection keywords, popped from its ``**kwargs``
    (the store's own keywords stay), or the spec handed on by another constructor."""
    kwargs = {"timeout": 3.0, "retry": 0, "batch_size": [2], "socket_keepalive": True}
    spec = ConnectSpec.take(kwargs, host="h", port=1, db=2, unix_socket_path=None, prefix="p")
    assert (spec.host, spec.port, spec.db, spec.prefix, spec.timeout, spec.retry) == ("h", 1, 2, "p", 3.0, 0)
    assert kwargs == {"batch_size": [2], "socket_keepalive": True}
    handed = {"_connect": spec, "progress": False}
    again = ConnectSpec.take(handed, host="ignored")
    assert again.host == "h" and again.progress is False and again.timeout == 3.0 and handed == {}
    assert spec.with_redis_kwargs({"socket_keepalive": True}).redis_kwargs == {"socket_keepalive": True}
    with pytest.raises(TypeError, match="_connect= takes a ConnectSpec, got dict"):
        ConnectSpec.take({"_connect": {"host": "x"}})


@pytest.mark.parametrize("how", ["init", "from_dict", "from_tensordict", "from_schema", "from_store", "lazy"])
def test_every_constructor_passes_every_connection_keyword_on(server, how):
    """The connection keywords reach the connection whichever constructor takes them (one
    ConnectSpec carries them from the public constructor to the connection)."""
    kw = {**server.connection_kwargs(), "prefix": "cs", "timeout": 9.0, "progress": False, "allow_pickle": True,
          "pickle_key": "k2"}
    td = TensorDict(x=torch.zeros(2, 3), batch_size=[2])
    if how == "init":
        store = TensorDictStore(batch_size=[2], **kw)
    elif how == "from_dict":
        store = TensorDictStore.from_dict({"x": torch.zeros(2, 3)}, batch_size=[2], **kw)
    elif how == "from_tensordict":
        store = TensorDictStore.from_tensordict(td, **kw)
    elif how == "from_schema":
        store = TensorDictStore.from_schema({"x": ([3], torch.float32)}, batch_size=[2], **kw)
    elif how == "from_store":
        first = TensorDictStore.from_tensordict(td, **kw)
        store = TensorDictStore.from_store(td_id=first.td_id, **kw)
        first.close()
    else:
        store = TensorDictStore.from_tensordict(lazy_stack([TensorDict(x=torch.zeros(n)) for n in (1, 2)]), **kw)
        assert type(store) is LazyStackedTensorDictStore
    try:
        conn = store._conn
        assert conn.keys.prefix == "cs" and conn.timeout == 9.0 and conn.progress is False
        assert conn.pickle_policy.allow is True and conn.pickle_policy.key == b"k2"
    finally:
        store.clear_redis()
        store.close()
