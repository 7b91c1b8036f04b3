"""Pickles made before the layer packages (tdstore at b479a68) and before the restructure of
issue 25 (3097af4: before tdstore.base, ConnectSpec and the ring as a module) still load and
reconnect.

``tests/data/legacy_handles.pickle`` names the old modules (``tdstore._store_api._unpickle``,
``tdstore._retry.RetryPolicy``, ``tdstore.store``, ``tdstore.lazy``); ``tdstore._core.moved`` answers
those names with the modules at their new places. ``tests/data/make_legacy_pickle.py`` made it.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import time
from pathlib import Path

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict

from tdstore import LazyStackedTensorDictStore, RetryPolicy, TensorDictStore
from tdstore.server import find_server_binary

DATA = Path(__file__).parent / "data"
SOCKET = "/tmp/tdstore-legacy-pickle.sock"  # where the pickled handles' server was


@pytest.mark.parametrize(
    ("name", "names"),
    [
        ("legacy_handles.pickle", (b"tdstore._store_api", b"tdstore._retry")),
        ("handles_3097af4.pickle", (b"tdstore.store.api", b"tdstore.lazy.core", b"tdstore._backend.retry")),
    ],
)
def test_pickle_of_an_earlier_layout_loads_and_reconnects(name: str, names: tuple[bytes, ...]) -> None:
    raw = (DATA / name).read_bytes()
    for old in names:
        assert old in raw  # the pickle really names the modules of its time
    if os.path.exists(SOCKET):
        os.unlink(SOCKET)
    proc = subprocess.Popen(
        [find_server_binary("redis"), "--port", "0", "--unixsocket", SOCKET, "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(SOCKET):
            assert time.monotonic() < deadline, "redis-server did not open its socket"
            time.sleep(0.02)
        dense = TensorDictStore.from_dict(
            {"a": torch.arange(6.0).reshape(3, 2), "n": {"b": torch.ones(3, dtype=torch.int64)}},
            batch_size=[3], unix_socket_path=SOCKET, td_id="legacy-dense",
        )
        lazy = LazyStackedTensorDictStore.from_lazy_stack(
            LazyStackedTensorDict(TensorDict(x=torch.zeros(2)), TensorDict(x=torch.ones(3))),
            unix_socket_path=SOCKET, td_id="legacy-lazy",
        )
        handles = pickle.loads(raw)
        assert type(handles["dense"]) is TensorDictStore and type(handles["lazy"]) is LazyStackedTensorDictStore
        assert isinstance(handles["retry"], RetryPolicy)
        assert (handles["dense"]["a"] == torch.arange(6.0).reshape(3, 2)).all()
        assert (handles["sub"]["b"] == 1).all() and handles["sub"].batch_size == torch.Size([3])
        assert (handles["lazy"][1]["x"] == torch.ones(3)).all()
        handles["dense"]["a"] += 1  # the handle writes, too
        assert (dense["a"] == torch.arange(1.0, 7.0).reshape(3, 2)).all()
        for h in (handles["dense"], handles["sub"], handles["lazy"]):
            h.close()
        dense.clear_redis()
        lazy.clear_redis()
        dense.close()
        lazy.close()
    finally:
        proc.terminate()
        proc.wait(10)
