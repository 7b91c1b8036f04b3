"""A process that uses stores exits silently: nothing on stderr at interpreter exit, with a
plain ``redis.Redis`` and a ``redis.asyncio.Redis`` beside the stores, left unclosed, with and
without ``python -X dev`` (which shows every ResourceWarning): the IO loop disconnects the
clients tdstore built and closes itself while the interpreter is whole
(``tdstore._backend.loop._shutdown``)."""

from __future__ import annotations

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
