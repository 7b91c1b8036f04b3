"""A process that uses stores exits silently: nothing on stderr at interpreter exit, with a
plain ``redis.Redis`` and a ``redis.asyncio.Redis`` beside the stores, left unclosed, with and
without ``python -X dev`` (which shows every ResourceWarning): the IO loop disconnects the
clients tdstore built and closes itself while the interpreter is whole
(``tdstore._backend.loop._shutdown``)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest


@pytest.mark.parametrize("dev", [False, True], ids=["plain", "dev"])
def test_exit_prints_nothing(real_server, dev):
    kw = real_server.connection_kwargs()
    where = f"host={kw['host']!r}, port={kw['port']}"
    script = textwrap.dedent(
        f"""
        import redis, redis.asyncio, torch
        from tensordict import LazyStackedTensorDict, TensorDict
        from tdstore import LazyStackedTensorDictStore, TensorDictStore
        plain = redis.Redis({where})
        plain.ping()
        aio = redis.asyncio.Redis({where})  # never connected, never closed
        s = TensorDictStore(batch_size=[4], {where})
        s["x"] = torch.zeros(4, 1000)  # through the IO loop's client
        s.to_tensordict(), s[1], s["x"]
        t = TensorDictStore.from_store(td_id=s.td_id, {where})
        t.del_("x")
        lazy = LazyStackedTensorDictStore.from_lazy_stack(
            LazyStackedTensorDict(TensorDict({{"y": torch.ones(2)}}, []), TensorDict({{"y": torch.ones(3)}}, [])), {where}
        )
        lazy.to_tensordict()
        print("done")
        """
    )
    proc = subprocess.run(
        [sys.executable, *(["-X", "dev"] if dev else []), "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
    assert proc.stderr == "", proc.stderr


#: what stderr of a process that closes its stores (or leaves them to the exit) must not show
_NOISE = ("Exception ignored", "ResourceWarning", "Non-thread-safe", "Traceback")

_CLOSE_SCRIPT = """
import json, sys, threading, torch
from tdstore import TensorDictStore
kw = json.loads(sys.argv[1])
close, threaded = sys.argv[2] == "close", sys.argv[3] == "thread"
s = TensorDictStore.from_dict({"x": torch.zeros(4, 3)}, batch_size=[4], **kw)
s["x"], s[1]  # reads: the direct client and the IO loop's
s["x"] = torch.ones(4, 3)  # a write
s.extend(TensorDictStore.from_dict({"x": torch.zeros(2, 3)}, batch_size=[2], **kw).to_tensordict())
# (that second store is collected unclosed here, while the IO loop runs)
if threaded:
    def work():
        t = TensorDictStore.from_store(td_id=s.td_id, **kw)
        t["x"], t[0]
        t[0] = t[1].to_tensordict()
        s[2], s["x"]
        if close:
            t.close()
    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
if close:
    s.close()
print("done")
"""


@pytest.mark.parametrize("threaded", [False, True], ids=["main", "thread"])
@pytest.mark.parametrize("close", [True, False], ids=["close", "exit"])
def test_close_and_exit_quiet_under_dev_mode(real_server, close, threaded):
    """close(), or the interpreter's exit without it, under ``python -X dev -W error::ResourceWarning``
    prints nothing: every client's pool is disconnected on the IO loop that owns it (issue 24, N12)."""
    kw = real_server.connection_kwargs()
    proc = subprocess.run(
        [
            sys.executable, "-X", "dev", "-W", "error::ResourceWarning", "-c", _CLOSE_SCRIPT, json.dumps(kw),
            "close" if close else "exit", "thread" if threaded else "main",
        ],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
    for noise in _NOISE:
        assert noise not in proc.stderr, proc.stderr
