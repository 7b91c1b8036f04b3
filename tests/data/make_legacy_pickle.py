"""How ``legacy_handles.pickle`` was made: by tdstore at commit b479a68, before the layer packages;
and ``handles_3097af4.pickle``, by tdstore at 3097af4, before the restructure of issue 25
(``PYTHONPATH=<a checkout of 3097af4> python tests/data/make_legacy_pickle.py handles_3097af4.pickle``).

Kept for the record; ``tests/test_pickle_compat.py`` loads the pickle and checks that its handles
reconnect. Its stores sat on a redis-server at the unix socket ``SOCKET``; the test starts one there
and writes the same data under the same ids before it unpickles.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time

import torch
from tensordict import LazyStackedTensorDict, TensorDict

from tdstore import LazyStackedTensorDictStore, RetryPolicy, TensorDictStore

SOCKET = "/tmp/tdstore-legacy-pickle.sock"


def main() -> None:
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--unixsocket", SOCKET, "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            if os.path.exists(SOCKET):
                break
            time.sleep(0.05)
        dense = TensorDictStore.from_dict(
            {"a": torch.arange(6.0).reshape(3, 2), "n": {"b": torch.ones(3, dtype=torch.int64)}},
            batch_size=[3],
            unix_socket_path=SOCKET,
            td_id="legacy-dense",
        )
        lazy = LazyStackedTensorDictStore.from_lazy_stack(
            LazyStackedTensorDict(TensorDict(x=torch.zeros(2)), TensorDict(x=torch.ones(3))),
            unix_socket_path=SOCKET,
            td_id="legacy-lazy",
        )
        handles = {"dense": dense, "sub": dense["n"], "lazy": lazy, "retry": RetryPolicy()}
        name = sys.argv[1] if len(sys.argv) > 1 else "legacy_handles.pickle"
        with open(os.path.join(os.path.dirname(__file__), name), "wb") as f:
            f.write(pickle.dumps(handles))
    finally:
        proc.terminate()


if __name__ == "__main__":
    main()
