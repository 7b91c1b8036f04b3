"""Appends get in no one's way (issue 16, goal 5).

* A compare-and-set (``apply_``, ``+=``...) on entries that no append writes does not
  conflict with appends: ``extend`` counts its appends per sub-store (field "a:<path>" of
  the hash <base>:ac, tdstore/_backend/append.py), and the commit checks the writes other
  than appends plus the appends into the sub-stores whose entries it read (ARGV[10] of
  lua/commit.lua).
* A compare-and-set on entries an append wrote still conflicts and retries: no update lost.
* ``extend`` refuses non-tensor columns clearly and writes nothing.
"""

from __future__ import annotations

import time

import _append_workers as w
import pytest
import torch
from fixtures import PoolSpec
from tensordict import NonTensorStack, TensorDict

from tdstore import TensorDictStore
from tdstore.errors import SchemaError
from tdstore.testing.counts import record as _record

CAP = 64


def _nested(conn):
    td = TensorDict(
        buf=TensorDict(obs=torch.zeros(CAP, 8), batch_size=[CAP]),
        stats=TensorDict(count=torch.zeros(CAP), batch_size=[CAP]),
        batch_size=[CAP],
    )
    return TensorDictStore.from_tensordict(td, **conn)


def _apply_with_append_between(target, appender, batch):
    """Runs ``target.apply_(x + 1)`` and appends ``batch`` through ``appender`` while the
    first try's snapshot is in hand (between its read and its commit); returns the number
    of tries (1: the commit went through at once, 2: it conflicted and read again)."""
    tries = []

    def bump(x):
        if not tries:
            appender.extend(batch)
        tries.append(1)
        return x + 1

    target.apply_(bump)
    return len(tries) // max(1, len(list(target.keys(True, True))))


def test_cas_on_other_substore_ignores_appends(server):
    store = _nested(server.connection_kwargs())
    other = TensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs())
    batch = TensorDict(obs=torch.ones(3, 8), batch_size=[3])
    tries = _apply_with_append_between(store["stats"], other["buf"], batch)
    assert tries == 1  # the append into "buf" wrote nothing "stats" read
    assert torch.equal(store["stats", "count"], torch.ones(CAP))
    assert torch.equal(store["buf", "obs"][:3], torch.ones(3, 8))
    # several appends in a row, still no conflict
    for _ in range(3):
        assert _apply_with_append_between(store["stats"], other["buf"], batch) == 1
    assert torch.equal(store["stats", "count"], torch.full((CAP,), 4.0))
    other.close()
    store.clear_redis()
    store.close()


@pytest.mark.parametrize("target", ["buf", "root"])
def test_cas_on_appended_entries_still_conflicts(server, target):
    """An append that wrote entries the compare-and-set read makes it read again: the
    appended rows are kept and the update is applied on top of them (no update lost)."""
    store = _nested(server.connection_kwargs())
    other = TensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs())
    batch = TensorDict(obs=torch.full((3, 8), 5.0), batch_size=[3])
    view = store["buf"] if target == "buf" else store
    tries = _apply_with_append_between(view, other["buf"], batch)
    assert tries == 2
    obs = store["buf", "obs"]
    assert torch.equal(obs[:3], torch.full((3, 8), 6.0))  # appended, then + 1
    assert torch.equal(obs[3:], torch.ones(CAP - 3, 8))
    other.close()
    store.clear_redis()
    store.close()


def test_cas_conflicts_with_append_to_the_root(server):
    """``extend`` on the root writes every entry, the ones of "stats" too."""
    conn = server.connection_kwargs()
    store = TensorDictStore.from_tensordict(
        TensorDict(obs=torch.zeros(CAP, 2), stats=TensorDict(count=torch.zeros(CAP), batch_size=[CAP]), batch_size=[CAP]),
        **conn,
    )
    other = TensorDictStore.from_store(td_id=store.td_id, **conn)
    batch = TensorDict(obs=torch.ones(2, 2), stats=TensorDict(count=torch.full((2,), 7.0), batch_size=[2]), batch_size=[2])
    assert _apply_with_append_between(store["stats"], other, batch) == 2
    assert torch.equal(store["stats", "count"][:2], torch.full((2,), 8.0))
    other.close()
    store.clear_redis()
    store.close()


def test_cas_still_conflicts_with_other_writes(server):
    """Writes other than appends conflict as before (one store-wide count of them)."""
    store = _nested(server.connection_kwargs())
    tries = []

    def bump(x):
        if not tries:
            store["buf", "obs"] = torch.full((CAP, 8), 3.0)  # a write elsewhere
        tries.append(1)
        return x + 1

    store["stats"].apply_(bump)
    assert len(tries) == 2
    assert torch.equal(store["stats", "count"], torch.ones(CAP))
    store.clear_redis()
    store.close()


#: the module's ``pool`` (tests/fixtures.py)
POOL = PoolSpec(workers=4, warm_up=w.warm_up, warm_up_arg=0.3)


@pytest.mark.multiprocess
def test_apply_on_substore_succeeds_while_4_processes_append(request, pool, race_server, tmp_path):
    """Issue 16: with 4 actors calling extend(), ``s["stats"].apply_`` used to fail with
    StaleLayoutError after ~15 s. Now every apply_ goes through within a bounded time and
    none is lost.

    The appenders run until told to stop (a file), so that the apply_ calls overlap them
    however the machine schedules the processes: the test waits until the first appends
    land, and makes at least 20 apply_ calls, more (up to 10 s) until appends are seen
    between its first and its last."""
    conn = race_server.connection_kwargs()
    store = _nested(conn)
    stop = tmp_path / "stop"
    start = time.time() + 0.5
    appenders = [
        pool.submit(w.sub_appender, conn, store.td_id, "buf", start, 100_000, 30.0, str(stop)) for _ in range(4)
    ]
    try:
        started = time.monotonic() + 20.0
        while store.ring_state().total == 0 and time.monotonic() < started:
            time.sleep(0.01)
        assert store.ring_state().total > 0, "the appenders did not start within 20 s"
        stats = store["stats"]
        rounds, slowest, tries = 0, 0.0, []

        def bump(x):
            tries.append(1)  # once per try: "stats" holds one leaf
            return x + 1

        total_before = store.ring_state().total
        t_all = time.perf_counter()
        appended_meanwhile = 0
        while rounds < 20 or (appended_meanwhile == 0 and time.perf_counter() - t_all < 10.0):
            t0 = time.perf_counter()
            stats.apply_(bump)
            rounds += 1
            slowest = max(slowest, time.perf_counter() - t0)
            appended_meanwhile = store.ring_state().total - total_before
        elapsed = time.perf_counter() - t_all
    finally:
        stop.touch()
        appended = sum(f.result(60) for f in appenders)
    _record(request, appends=appended, rows_appended_during_apply=appended_meanwhile, apply_calls=rounds,
            apply_tries=len(tries), slowest_apply_s=f"{slowest:.3f}")
    assert appended_meanwhile > 0, "the appenders did not run while apply_ did"
    assert torch.equal(store["stats", "count"], torch.full((CAP,), float(rounds)))
    assert len(tries) == rounds, f"apply_ conflicted with appends it has nothing to do with: {len(tries)} tries"
    assert elapsed < 10.0 + slowest, f"{rounds} apply_ took {elapsed:.1f} s while 4 processes appended"
    assert slowest < 5.0, f"one apply_ took {slowest:.1f} s while 4 processes appended"
    store.clear_redis()
    store.close()


def _labelled(conn):
    td = TensorDict(x=torch.zeros(4), label=NonTensorStack("a", "b", "c", "d"), batch_size=[4])
    return TensorDictStore.from_tensordict(td, **conn)


def _state(store):
    return store.ring_state(), store["x"].clone(), list(store["label"])


def test_extend_refuses_non_tensor_columns_and_writes_nothing(server):
    """Issue 16: extend() with x=ones(2) and label=NonTensorStack("new0", "new1") wrote x
    into rows 0-1 and kept the old labels. Now it refuses, naming the key and the store."""
    store = _labelled(server.connection_kwargs())
    before = _state(store)
    td = TensorDict(x=torch.ones(2), label=NonTensorStack("new0", "new1"), batch_size=[2])
    with pytest.raises(SchemaError, match=r"non-tensor entry 'label'") as err:
        store.extend(td)
    assert store.td_id in str(err.value)
    assert "Nothing was written" in str(err.value)
    after = _state(store)
    assert after[0] == before[0] and torch.equal(after[1], before[1]) and after[2] == before[2] == ["a", "b", "c", "d"]
    store.clear_redis()
    store.close()


def test_extend_refuses_a_store_with_per_row_non_tensor_entries(server):
    """Without the column the new rows would keep the labels of the rows they replace."""
    store = _labelled(server.connection_kwargs())
    before = _state(store)
    with pytest.raises(SchemaError, match=r"non-tensor entry 'label' holds one value per row") as err:
        store.extend(TensorDict(x=torch.ones(2), batch_size=[2]))
    assert store.td_id in str(err.value)
    after = _state(store)
    assert after[0] == before[0] and torch.equal(after[1], before[1]) and after[2] == before[2]
    store.clear_redis()
    store.close()


def test_extend_refuses_nested_non_tensor_column(server):
    store = TensorDictStore.from_schema({"x": ([], torch.float32)}, batch_size=[4], **server.connection_kwargs())
    td = TensorDict(
        x=torch.ones(2), sub=TensorDict(note=NonTensorStack("p", "q"), batch_size=[2]), batch_size=[2]
    )
    with pytest.raises(SchemaError, match=r"non-tensor entry \('sub', 'note'\)"):
        store.extend(td)
    assert store.ring_state().total == 0
    assert torch.equal(store["x"], torch.zeros(4))
    store.clear_redis()
    store.close()


def test_set_ring_total(server):
    """The public form of what TorchRL's empty() and load_state_dict() do (tdstore.torchrl)."""
    from tdstore.errors import StoreNotFoundError

    s = TensorDictStore.from_schema({"x": ([2], torch.float32)}, batch_size=[8], **server.connection_kwargs())
    s.extend(TensorDict(x=torch.ones(5, 2), batch_size=[5]))
    other = TensorDictStore.from_store(td_id=s.td_id, **server.connection_kwargs())
    other.set_ring_total(3)
    assert tuple(s.ring_state()) == (3, 3, 8, 3)
    assert s.extend(TensorDict(x=torch.full((2, 2), 2.0), batch_size=[2])).tolist() == [3, 4]
    other.set_ring_total(0)
    assert tuple(s.ring_state()) == (0, 0, 8, 0)
    with pytest.raises(ValueError, match="no row was appended"):
        s.sample(1)
    for bad in (-1, 2**52 + 1):
        with pytest.raises(ValueError, match="2\\*\\*52"):
            s.set_ring_total(bad)
        assert tuple(s.ring_state()) == (0, 0, 8, 0)
    s.clear_redis()
    with pytest.raises(StoreNotFoundError):
        other.set_ring_total(1)

