"""Multi-process violation tests of the two-step append (tdstore/_backend/append.py).

An append reserves rows (lua/reserve.lua), then writes them in a MULTI that flags them as
written. These count, across processes, what must never happen (0 expected):

* appenders and samplers at once: a sampled row torn (two appends mixed) or never written
  (reserved, not yet written);
* an appender SIGKILLed between its reserve and its write: the others keep appending,
  its rows are never sampled (not even after the ring came round), the store stays usable
  and clear_redis() leaves no key;
* layout changes (entries added and deleted beside the appended ones) racing appenders:
  every append lands whole in the rows it returned, in the right entries; no debris key.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import _append_step_workers as w
import pytest
import torch
from fixtures import PoolSpec

from tdstore import TensorDictStore
from tdstore.testing.counts import record as _record

SCHEMA = {"tag": ([3], torch.int64), "obs": ([8], torch.float32)}

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


#: the module's ``pool`` (tests/fixtures.py): 5 workers, started (and imported) up front
POOL = PoolSpec(workers=5, warm_up=time.sleep, warm_up_arg=0.3)


def _keys(server, store) -> set[str]:
    client = server.sync_client()
    try:
        return {k.decode().split(":", 2)[2] for k in client.scan_iter(match=f"{store.prefix}:{{{store.td_id}}}:*")}
    finally:
        client.close()


def test_samplers_never_see_a_torn_or_unwritten_row(real_server, pool, request):
    conn = real_server.connection_kwargs()
    cap, rows, count = 48, 4, 40  # the ring comes round 10 times
    store = TensorDictStore.from_schema(SCHEMA, batch_size=[cap], **conn)
    appenders = [pool.submit(w.appender, conn, store.td_id, (), p, count, rows, 30.0) for p in (1, 2, 3)]
    samplers = [pool.submit(w.sampler, conn, store.td_id, 16, 400, 30.0, -1) for _ in range(2)]
    got = [f.result(90) for f in appenders]
    sampled, torn, unwritten, _ = (sum(x) for x in zip(*(f.result(90) for f in samplers), strict=True))
    state = store.ring_state()
    # (an appender slower than a lap of the ring is taken over and reserves again: rows
    # reserved but never written, counted in total, skipped by sample)
    _record(request, appended=sum(map(len, got)), sampled=sampled, torn_rows=torn, unwritten_rows=unwritten,
            rows_reserved_again=state.total - 3 * count * rows)
    assert sum(map(len, got)) == 3 * count * rows
    assert sampled > 0
    assert (torn, unwritten) == (0, 0)
    assert state.valid == cap and state.total >= 3 * count * rows
    store.clear_redis()
    store.close()


def test_armed_and_two_step_appends_mixed_never_collide(real_server, pool, request):
    """Appenders whose appends go armed (one packet) and in two steps, armed ones aborted by
    the others (no cool-down), beside samplers: every append lands whole in the rows it
    returned, no row is returned twice, no sampled row is torn or unwritten."""
    conn = real_server.connection_kwargs()
    cap, rows, count = 2000, 3, 200  # no wrap: every acknowledged append must still be there
    store = TensorDictStore.from_schema(SCHEMA, batch_size=[cap], **conn)
    admin = real_server.sync_client()
    try:
        admin.config_resetstat()
        appenders = [pool.submit(w.appender, conn, store.td_id, (), p, count, rows, 30.0, 0, 0.001) for p in (1, 2, 3)]
        samplers = [pool.submit(w.sampler, conn, store.td_id, 16, 300, 30.0, -1) for _ in range(2)]
        got = {p: f.result(90) for p, f in zip((1, 2, 3), appenders, strict=True)}
        sampled, torn, unwritten, _ = (sum(x) for x in zip(*(f.result(90) for f in samplers), strict=True))
        stats = {k.removeprefix("cmdstat_"): v["calls"] for k, v in admin.info("commandstats").items()}
        appends = 3 * count
        # (no wrap) each append SETRANGEs its rows of the two entries and their flags; one in
        # two steps also clears the flags when it reserves
        two_step = stats.get("setrange", 0) - 3 * appends
        aborted = stats.get("unwatch", 0)  # an aborted armed MULTI, or an arming refused, ends in UNWATCH
        rows_all = [r for v in got.values() for r in v]
        twice = len(rows_all) - len(set(rows_all))
        tags = store["tag"]
        misplaced = 0
        for p, mine in got.items():
            for seq in range(count):
                want = torch.tensor([[p, seq, i] for i in range(rows)])
                misplaced += int(not torch.equal(tags[torch.tensor(mine[seq * rows : (seq + 1) * rows])], want))
        _record(request, appended=appends, armed_appends=appends - two_step, armed_aborted_or_refused=aborted,
                rows_returned_twice=twice, misplaced_appends=misplaced, sampled=sampled, torn_rows=torn,
                unwritten_rows=unwritten)
        assert len(rows_all) == appends * rows
        assert (twice, misplaced, torn, unwritten) == (0, 0, 0, 0)
        assert sorted(rows_all) == list(range(appends * rows)), "a gap or a row taken twice"
        assert 0 < two_step < appends, "the appends did not go both ways"
        assert sampled > 0
        assert store.ring_state() == (appends * rows, appends * rows, cap, appends * rows)
    finally:
        admin.close()
        store.clear_redis()
        store.close()


def test_appender_killed_between_its_two_steps(real_server, pool, request):
    conn = real_server.connection_kwargs()
    cap, rows = 32, 2
    store = TensorDictStore.from_schema(SCHEMA, batch_size=[cap], **conn)
    store.extend(w.batch(1, 0, rows))
    ctx = multiprocessing.get_context("spawn")
    reserved = ctx.Event()
    dead = 9
    proc = ctx.Process(target=w.stuck_appender, args=(conn, store.td_id, dead, reserved))
    proc.start()
    try:
        assert reserved.wait(60), "the stuck appender did not reserve"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.join(10)
    # its 3 rows (2-4) are reserved, never written: not valid, never sampled
    state = store.ring_state()
    assert (state.total, state.valid) == (rows + 3, rows)
    before, torn0, unwritten0, _ = w.sampler(conn, store.td_id, 8, 50, 10.0, dead)
    # the others keep appending, past the dead rows and round the ring several times
    count = 30
    appenders = [pool.submit(w.appender, conn, store.td_id, (), p, count, rows, 30.0) for p in (2, 3)]
    samplers = [pool.submit(w.sampler, conn, store.td_id, 8, 300, 30.0, dead) for _ in range(2)]
    got = [f.result(90) for f in appenders]
    sampled, torn, unwritten, of_dead = (sum(x) for x in zip(*(f.result(90) for f in samplers), strict=True))
    after, _, _, of_dead_after = w.sampler(conn, store.td_id, 64, 20, 10.0, dead)
    torn, unwritten = torn + torn0, unwritten + unwritten0
    _record(request, appended=sum(map(len, got)), sampled=before + sampled + after, torn_rows=torn,
            unwritten_rows=unwritten, rows_of_killed_sampled=of_dead + of_dead_after)
    assert sum(map(len, got)) == 2 * count * rows
    assert before == 400
    assert (torn, unwritten, of_dead, of_dead_after) == (0, 0, 0, 0)
    assert int((store["tag"][:, 0] == dead).sum()) == 0  # it wrote nothing
    state = store.ring_state()
    again = state.total - (rows + 3 + 2 * count * rows)  # rows reserved again (an appender slower than a lap)
    assert cap - again <= state.valid <= cap, "the ring came round and reused the dead appender's rows"
    if again == 0:
        assert "rif" not in _keys(real_server, store), "its reservation was taken over, no other is left"
    store.clear_redis()
    assert _keys(real_server, store) == set()
    store.close()


SETS = 150


def test_cursor_sets_racing_appenders_and_samplers(real_server, pool, request):
    """The cursor set (TorchRL's empty() and load_state_dict()) again and again while 3
    processes append, in one packet and in two steps: a sampled row is never torn or never
    written, the rows counted as written never outnumber the rows the cursor counts, and once
    the ring has come round every row counts again."""
    conn = real_server.connection_kwargs()
    cap, rows, count = 64, 4, 60
    store = TensorDictStore.from_schema(SCHEMA, batch_size=[cap], **conn)
    store[:] = w.batch(9, 0, cap)  # every row whole (as load_state_dict writes them), none flagged yet
    # (each cursor set aborts the armed appends, whose handles then take the two steps for a while)
    appenders = [pool.submit(w.appender, conn, store.td_id, (), p, count, rows, 30.0, None, 0.002) for p in (1, 2, 3)]
    setter = pool.submit(w.cursor_setter, conn, store.td_id, SETS, 30.0, 11)
    checker = pool.submit(w.ring_checker, conn, store.td_id, 16, 400, 30.0)
    got = [f.result(90) for f in appenders]
    sets = setter.result(90)
    checks, over, sampled, torn, unwritten = checker.result(90)
    for seq in range(cap // rows):  # a lap of the ring after the last cursor set
        store.extend(w.batch(4, seq, rows))
    state = store.ring_state()
    final_torn, final_unwritten = w.bad_rows(store.to_tensordict())
    _record(request, appended=sum(map(len, got)), cursor_sets=sets, ring_checks=checks, rows_over_counted=over,
            sampled=sampled, torn_rows=torn + final_torn, unwritten_rows=unwritten + final_unwritten,
            rows_uncounted_after_a_lap=cap - state.valid)
    assert sum(map(len, got)) == 3 * count * rows
    assert sets == SETS and checks > 0 and sampled > 0
    assert (over, torn, unwritten, final_torn, final_unwritten) == (0, 0, 0, 0, 0)
    assert state.valid == cap
    store.clear_redis()
    store.close()


def test_layout_changes_racing_appenders(real_server, pool, request):
    conn = real_server.connection_kwargs()
    cap, rows, count = 240, 2, 30  # 180 rows appended: no lap, whatever is reserved again
    store = TensorDictStore.from_schema({("buf", k): v for k, v in SCHEMA.items()}, batch_size=[cap], **conn)
    appenders = [pool.submit(w.appender, conn, store.td_id, ("buf",), p, count, rows, 40.0) for p in (1, 2, 3)]
    changer = pool.submit(w.layout_changer, conn, store.td_id, 200, 40.0)
    got = [f.result(120) for f in appenders]
    changes = changer.result(120)
    indices = [i for g in got for i in g]
    final = store.to_tensordict()
    buf = final["buf"]
    # each append's rows hold exactly its batch: in the rows it returned, in the right entries
    misplaced = 0
    for p, g in zip((1, 2, 3), got, strict=True):
        for seq in range(count):
            idx = torch.tensor(g[seq * rows : (seq + 1) * rows])
            want = w.batch(p, seq, rows)
            misplaced += int((buf["tag"][idx] != want["tag"]).any(dim=-1).sum())
            misplaced += int((buf["obs"][idx] != want["obs"]).any(dim=-1).sum())
    side = final.get("side", None)
    debris_rows = 0 if side is None else sum(int((v != 0).any(dim=-1).sum()) for v in side.values(True, True))
    keys = _keys(real_server, store)
    expected = {"meta", "reg", "wv", "ring", "rf", "ac", "d:buf.tag", "d:buf.obs"}
    expected |= {f"d:side.{k}" for k in (side.keys() if side is not None else ())}
    # (a reservation abandoned after a lost connection stays in flight, "rif", till the ring comes round)
    debris = keys - expected - {"fence"} - ({"rif"} if store.ring_state().total > len(indices) else set())
    _record(request, appended=len(indices), layout_changes=changes, duplicate_rows=len(indices) - len(set(indices)),
            misplaced_rows=misplaced, rows_in_other_entries=debris_rows, debris_keys=sorted(debris))
    assert changes > 10, "the layout did not change while the appends ran"
    assert len(indices) == 3 * count * rows == len(set(indices))
    assert (misplaced, debris_rows, sorted(debris)) == (0, 0, [])
    assert store.ring_state().valid == len(indices)
    store.clear_redis()
    assert _keys(real_server, store) == set()
    store.close()
