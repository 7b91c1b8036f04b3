"""A server that forgot tdstore's scripts (SCRIPT FLUSH, a restart) costs one reload, never an error.

NOSCRIPT is handled in one place, ``ScriptRunner`` (tdstore/_backend/scripts.py): ``call`` for
one EVALSHA (it loads that script), ``run_pipeline`` for a pipeline or MULTI that queued
EVALSHAs (it loads every script and sends the pipeline again), ``ensure_loaded`` before a
MULTI whose other commands must not run without the script. Each test flushes the scripts
between two calls and checks the second still does its work, and which scripts the server
holds after it: that tells which of the three paths ran.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore._backend.scripts import get_script, script_names
from tdstore.testing.fixtures import StoreFixtures


def _loaded(server, store) -> set[str]:
    """The scripts the server holds now (by the SHA1 this store's runner calls)."""
    shebang = store._conn.runner.shebang
    names = script_names()
    there = server.sync_client().script_exists(*[get_script(name).sha(shebang) for name in names])
    return {name for name, ok in zip(names, there, strict=True) if ok}


def _flush(server, store) -> None:
    server.sync_client().script_flush()
    assert _loaded(server, store) == set()


def _tmp_keys(server) -> list[bytes]:
    return [key for key in server.sync_client().keys("*") if b":tmp:" in key or key.endswith(b":tmp")]


class TestScriptsForgotten(StoreFixtures):
    """``make(batch_size=[n])`` (tdstore.testing's fixture) makes a store on the test's server."""

    def test_a_plain_script_call_reloads_its_script(self, server, make):
        store = make(batch_size=[4])
        store["a"] = torch.arange(4.0)
        _flush(server, store)
        store.lock_()  # one EVALSHA of commit (ScriptRunner.call)
        assert _loaded(server, store) == {"commit"}  # that script alone
        assert store.is_locked
        store.unlock_()

    def test_a_pipelined_read_reloads_and_reads_again(self, server, make):
        store = make(batch_size=[24])
        store["a"] = torch.arange(24.0)
        x = torch.arange(24 * 3, dtype=torch.float32).reshape(24, 3)
        store["x"] = x
        index = torch.arange(22, -1, -2)  # 12 scattered rows: read by the gather script
        _flush(server, store)
        got = store[index]  # gather scripts queued in one snapshot (ScriptRunner.run_pipeline)
        assert _loaded(server, store) == set(script_names())  # every script, loaded at once
        assert torch.equal(got["x"], x[index]) and torch.equal(got["a"], torch.arange(24.0)[index])

    def test_a_commit_in_a_multi_reloads_and_leaves_no_tmp_key(self, server, make):
        store = make(batch_size=[4])
        store["a"] = torch.arange(4.0)
        _flush(server, store)
        value = torch.arange(4 * 5, dtype=torch.float32).reshape(4, 5)
        store["b"] = value  # SETs of tmp keys and the commit script in one MULTI (ScriptRunner.run_pipeline)
        assert _loaded(server, store) == set(script_names())
        assert _tmp_keys(server) == []  # the first try's tmp keys are deleted, not left to their TTL
        assert torch.equal(store["b"], value) and torch.equal(store["a"], torch.arange(4.0))

    def test_an_indexed_write_in_a_multi_loads_its_script_before(self, server, make):
        store = make(batch_size=[6])
        store["a"] = torch.arange(6.0)
        _flush(server, store)
        # creates the entry "b" in the same MULTI as the row writes: write_runs_watched, whose small
        # runs go through the write_runs script (ScriptRunner.ensure_loaded before MULTI)
        store[1:3] = TensorDict(a=torch.ones(2), b=torch.full((2,), 5.0), batch_size=[2])
        assert _loaded(server, store) == {"write_runs"}
        assert torch.equal(store["a"], torch.tensor([0.0, 1, 1, 3, 4, 5]))
        assert torch.equal(store["b"], torch.tensor([0.0, 5, 5, 0, 0, 0]))


def test_a_lazy_element_write_and_read_after_a_flush(server):
    stack = lazy_stack([TensorDict(x=torch.full((n,), float(n))) for n in (1, 2, 3)])
    store = LazyStackedTensorDictStore.from_lazy_stack(stack, **server.connection_kwargs())
    _flush(server, store)
    store[1] = TensorDict(x=torch.tensor([7.0, 8.0]))
    _flush(server, store)
    assert torch.equal(store[1]["x"], torch.tensor([7.0, 8.0]))
    assert torch.equal(store[2]["x"], torch.full((3,), 3.0))
    store.clear_redis()
    store.close()


@pytest.mark.parametrize("fails", [1, 2])
def test_run_pipeline_sends_again_once(server, fails):
    """A pipeline answered NOSCRIPT is sent once more after a reload, not more."""
    import redis.exceptions

    from tdstore._backend.scripts import ScriptRunner

    store = TensorDictStore(batch_size=[1], **server.connection_kwargs())
    runner: ScriptRunner = store._conn.runner
    sent: list[int] = []
    undone: list[list] = []

    async def call(client):
        async def send():
            sent.append(1)
            if len(sent) <= fails:
                await client.script_flush()
            async with client.pipeline(transaction=True) as pipe:
                pipe.set(f"{store._conn.keys.base}:probe", b"1")
                runner.queue(pipe, "read_one", [store._conn.keys.meta, "nokey"], ["0", "0"])
                return await pipe.execute(raise_on_error=False)

        async def undo(replies):
            undone.append(replies)

        return await runner.run_pipeline(client, send, undo)

    replies = store._conn.run(call)
    assert len(sent) == 2 and len(undone) == 1
    assert isinstance(undone[0][-1], redis.exceptions.NoScriptError)
    if fails == 1:
        assert not isinstance(replies[-1], Exception)
    else:  # forgotten again: the second replies are returned as they are, for the caller to raise
        assert isinstance(replies[-1], redis.exceptions.NoScriptError)
    store.clear_redis()
    store.close()


def test_a_new_handle_loads_only_the_scripts_the_server_lacks(server, monkeypatch):
    """A handle's setup asks SCRIPT EXISTS with its limits, in one round trip, and loads only
    the scripts the server lacks, pipelined: after a flush the next handle loads them all, and
    the handle after it none (a server compiles each script once, not once per handle). Counted
    on the client (every SCRIPT LOAD a pipeline queues) and, where the server counts SCRIPT
    subcommands apart (Redis 7, Valkey), by INFO commandstats too."""
    import redis.asyncio.client

    queued: list[str] = []
    real = redis.asyncio.client.Pipeline.script_load

    def counted(self, script):
        queued.append(script)
        return real(self, script)

    monkeypatch.setattr(redis.asyncio.client.Pipeline, "script_load", counted)
    client = server.sync_client()

    def server_loads() -> int | None:
        if server.kind == "fakeredis":
            return None  # (no INFO)
        stats = client.info("commandstats")
        return int(stats.get("cmdstat_script|load", {}).get("calls", 0)) if "cmdstat_script" not in stats else None

    first = TensorDictStore(batch_size=[2], **server.connection_kwargs())
    first["x"] = torch.zeros(2)
    _flush(server, first)
    queued.clear()
    before = server_loads()
    again = TensorDictStore.from_store(td_id=first.td_id, **server.connection_kwargs())
    assert again["x"].tolist() == [0.0, 0.0]
    assert _loaded(server, again) == set(script_names()) and len(queued) == len(script_names())
    middle = server_loads()
    queued.clear()
    third = TensorDictStore.from_store(td_id=first.td_id, **server.connection_kwargs())
    third["x"] = torch.ones(2)
    assert queued == [] and again["x"].tolist() == [1.0, 1.0]
    after = server_loads()
    if before is not None and middle is not None and after is not None:
        assert (middle - before, after - middle) == (len(script_names()), 0)
    for store in (first, again, third):
        store.close()
    client.close()
