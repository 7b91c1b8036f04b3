"""Appends in one packet on an armed connection (tdstore/_backend/append.py, ``append_direct``).

After an append, the direct client's connection stays WATCHing the ring's meta hash and
cursor (and has read the flags of the rows ahead: none in flight); the next append of the handle then writes its rows at the cursor it read
and INCRBYs the cursor in one MULTI, with no reserve step. Anything that changes a watched key
meanwhile (another appender, a reservation, a layout change, a cursor set) aborts that MULTI
and the append takes the two steps; the next ``COOL_APPENDS`` appends do too.

These run on real servers only (``real_server``): fakeredis has no direct client, so its
appends always take the two steps (tests/test_append_flags.py covers those).
"""

from __future__ import annotations

import threading

import pytest
import torch
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore._backend import append as _append

CAP = 8


def batch(value: float, n: int) -> TensorDict:
    return TensorDict(x=torch.full((n, 2), value), y=torch.full((n,), value), batch_size=[n])


SCHEMA = {"x": ([2], torch.float32), "y": ([], torch.float32)}


@pytest.fixture
def store(stores, real_server):
    s = stores(real_server, "from_schema", SCHEMA, batch_size=[CAP])
    yield s
    s.clear_redis()


@pytest.fixture
def admin(real_server):
    client = real_server.sync_client()
    yield client
    client.close()


def calls(admin) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in admin.info("commandstats").items()}


def rows(store) -> list[float]:
    return store["y"].tolist()


def test_uncontended_appends_take_one_packet_and_no_reserve(store, admin):
    store.extend(batch(1.0, 2))  # two steps; arms the connection
    admin.config_resetstat()
    for i in range(5):
        got = store.extend(batch(float(i + 2), 3))
        assert got.tolist() == [(2 + 3 * i + k) % CAP for k in range(3)]
    stats = calls(admin)
    assert stats.get("evalsha", 0) == 0, "an uncontended append ran the reserve script"
    assert stats["exec"] == 5 and stats["incrby"] == 5
    assert rows(store) == [6.0, 4.0, 4.0, 5.0, 5.0, 5.0, 6.0, 6.0]
    assert store.ring_state() == (CAP, 17, CAP, 1)
    assert set(store.sample(300)["y"].tolist()) == {4.0, 5.0, 6.0}
    assert store._conn.append_slot.armed is not None


def test_another_appender_aborts_the_armed_append_and_no_row_is_lost(store, real_server, admin):
    other = TensorDictStore.from_store(td_id=store.td_id, **real_server.connection_kwargs())
    try:
        store.extend(batch(1.0, 1))  # row 0; armed at cursor 1
        other.extend(batch(2.0, 2))  # rows 1-2: moves the cursor the armed connection watches
        admin.config_resetstat()
        assert store.extend(batch(3.0, 2)).tolist() == [3, 4], "the armed append wrote at a stale cursor"
        stats = calls(admin)
        assert stats["evalsha"] == 1, "the aborted armed append did not take the two steps"
        assert stats["exec"] == 2  # the aborted armed MULTI, then the two steps' MULTI
        assert store._conn.append_slot.cool == _append.COOL_APPENDS
        assert rows(store)[:5] == [1.0, 2.0, 2.0, 3.0, 3.0]
        assert store.ring_state().valid == 5
    finally:
        other.close()


def test_appends_cool_down_after_contention_then_arm_again(store, real_server, admin, monkeypatch):
    monkeypatch.setattr(_append, "COOL_APPENDS", 3)
    other = TensorDictStore.from_store(td_id=store.td_id, **real_server.connection_kwargs())
    try:
        store.extend(batch(1.0, 1))
        other.extend(batch(2.0, 1))
        store.extend(batch(3.0, 1))  # aborted armed try, then two steps; cooling starts
        admin.config_resetstat()
        for i in range(3):
            store.extend(batch(4.0 + i, 1))  # two steps each; the last one re-arms
        assert calls(admin)["evalsha"] == 3
        admin.config_resetstat()
        store.extend(batch(9.0, 1))
        assert calls(admin).get("evalsha", 0) == 0, "appends did not arm again after cooling down"
        assert rows(store)[:7] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 9.0]
    finally:
        other.close()


def dead_reservation(store, n: int, capacity: int = CAP) -> int:
    """Reserves ``n`` rows as an appender that dies before writing them; returns the cursor it got."""
    conn = store._conn
    plan = _append.AppendPlan(
        conn.keys, [], lv=store._layout().lv, n=n, capacity=capacity, sub=(), reservation=_append.Reservation()
    )
    keys, args = plan.reserve_keys_args("new")
    return int(conn.run(lambda c: conn.runner.call(c, "reserve", keys, args))[0])


def test_an_append_in_flight_on_the_next_rows_keeps_appends_off_the_armed_path(store, admin, monkeypatch):
    """Arming reads the flags of the rows the next appends would take where the ring came
    round to them: an append in flight there (flags clear) keeps the handle on the two
    steps, whose reserve takes those rows over (the fence) instead of writing over them.
    An append in flight elsewhere does not stop arming."""
    monkeypatch.setattr(_append, "COOL_APPENDS", 0)
    store.extend(batch(1.0, CAP))  # a whole lap: from here on the rows were reserved before
    assert dead_reservation(store, 2) == CAP  # rows 0-1, in flight for ever
    admin.config_resetstat()
    assert store.extend(batch(2.0, 2)).tolist() == [2, 3]  # the armed MULTI was aborted (the cursor moved)
    assert calls(admin)["evalsha"] == 1
    for want in ([4, 5], [6, 7]):
        admin.config_resetstat()
        assert store.extend(batch(3.0, 2)).tolist() == want
        assert calls(admin)["evalsha"] == 1, "an append went armed while the rows ahead were in flight"
    held = store._conn.append_slot.armed
    assert held is None or held.lv == "", "the connection was armed"  # (kept for the two steps)
    admin.config_resetstat()
    assert store.extend(batch(4.0, 2)).tolist() == [0, 1]  # two steps: takes the dead rows over
    # (the takeover's fence aborts its own first write too: it checks its rows again, "keep")
    assert calls(admin)["evalsha"] == 2 and admin.get(store._conn.keys.fence) == b"1"
    admin.config_resetstat()
    assert store.extend(batch(5.0, 2)).tolist() == [2, 3]
    assert calls(admin).get("evalsha", 0) == 0, "the rows ahead are written: the append goes armed"
    assert rows(store) == [4.0, 4.0, 5.0, 5.0, 3.0, 3.0, 3.0, 3.0]


def test_cooling_appends_keep_their_connection_then_arm_it_again(store, admin):
    """The two steps of a cooling handle go on the connection it keeps in its slot (no WATCH
    left on it), not through the pool's checkout and return; it is armed again after."""
    store.extend(batch(1.0, 1))
    slot = store._conn.append_slot
    slot.contended(4)  # the next 4 appends take the two steps
    store.extend(batch(2.0, 1))
    kept = slot.armed
    assert kept is not None and not kept.watching
    for i in range(3):
        store.extend(batch(3.0 + i, 1))
        assert slot.armed is not None and slot.armed.connection is kept.connection
    assert slot.armed.watching, "armed again after the cool-down"
    admin.config_resetstat()
    store.extend(batch(9.0, 1))
    assert calls(admin).get("evalsha", 0) == 0 and slot.armed.connection is kept.connection
    assert rows(store)[:6] == [1.0, 2.0, 3.0, 4.0, 5.0, 9.0]


def test_an_append_in_flight_elsewhere_leaves_appends_armed(real_server, admin, monkeypatch):
    monkeypatch.setattr(_append, "COOL_APPENDS", 0)
    store = TensorDictStore.from_schema({"y": ([], torch.float32)}, batch_size=[1000], **real_server.connection_kwargs())
    try:
        store.extend(TensorDict(y=torch.ones(1), batch_size=[1]))  # row 0
        assert dead_reservation(store, 2, 1000) == 1  # rows 1-2, in flight for ever
        store.extend(TensorDict(y=torch.ones(1), batch_size=[1]))  # row 3: armed MULTI aborted, two steps, re-armed
        admin.config_resetstat()
        got = [store.extend(TensorDict(y=torch.full((1,), float(i)), batch_size=[1])).item() for i in range(5)]
        assert got == [4, 5, 6, 7, 8]
        assert calls(admin).get("evalsha", 0) == 0, "a reservation in flight behind the cursor stopped arming"
        assert store.ring_state() == (7, 9, 1000, 9)  # rows 1-2 stay unflagged
    finally:
        store.clear_redis()
        store.close()


def test_a_layout_change_between_appends_is_seen(store, real_server):
    store.extend(batch(1.0, 2))
    other = TensorDictStore.from_store(td_id=store.td_id, **real_server.connection_kwargs())
    try:
        other["z"] = torch.zeros(CAP)  # a new entry: the next append must write it too
    finally:
        other.close()
    with pytest.raises(Exception, match="missing"):
        store.extend(batch(2.0, 1))
    got = store.extend(TensorDict(x=torch.ones(1, 2), y=torch.ones(1), z=torch.full((1,), 5.0), batch_size=[1]))
    assert got.tolist() == [2]
    assert store["z"][2].item() == 5.0
    assert rows(store)[:3] == [1.0, 1.0, 1.0]


def test_a_parked_connection_the_server_closed_is_not_used(store, admin):
    store.extend(batch(1.0, 1))
    armed = store._conn.append_slot.armed
    assert armed is not None
    armed.connection.send_command("CLIENT", "ID")  # (a parked connection answers it; its WATCH stays)
    client_id = armed.connection.read_response()
    admin.execute_command("CLIENT", "KILL", "ID", client_id)
    # not an unknown outcome: the dead connection is seen before anything is sent on it
    assert store.extend(batch(2.0, 2)).tolist() == [1, 2]
    assert store.extend(batch(3.0, 1)).tolist() == [3]
    assert rows(store)[:4] == [1.0, 2.0, 2.0, 3.0]


def test_the_cursor_set_meanwhile_is_followed(store, real_server):
    store.extend(batch(1.0, 2))
    other = TensorDictStore.from_store(td_id=store.td_id, **real_server.connection_kwargs())
    try:
        other._conn.run(lambda c: _set_total(c, other, 6))
    finally:
        other.close()
    assert store.extend(batch(2.0, 1)).tolist() == [6]


async def _set_total(client, store, total):
    from tdstore._backend import priorities

    assert await priorities.set_ring_total(client, store._conn.keys, store._conn.runner, total, CAP)


def test_armed_appends_keep_the_store_expiry(stores, real_server, admin):
    store = stores(real_server, "from_schema", SCHEMA, batch_size=[CAP], expire=60)
    try:
        store.extend(batch(1.0, 1))
        store.extend(batch(2.0, 1))  # armed: may create the counters, must give them the expiry
        keys = store._conn.keys
        for key in (keys.ring, keys.flags, keys.wv, keys.appends):
            assert 0 < admin.pttl(key) <= 60_000, f"{key} has no expiry"
    finally:
        store.clear_redis()


def test_threads_appending_on_one_handle_get_disjoint_rows(real_server):
    store = TensorDictStore.from_schema({"y": ([], torch.int64)}, batch_size=[4000], **real_server.connection_kwargs())
    errors: list[BaseException] = []
    got: dict[int, list[int]] = {}

    def work(t: int) -> None:
        try:
            mine = []
            for i in range(40):
                value = t * 1000 + i
                mine += store.extend(TensorDict(y=torch.full((3,), value), batch_size=[3])).tolist()
            got[t] = mine
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    try:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        everything = sorted(r for v in got.values() for r in v)
        assert everything == list(range(480)), "rows reserved twice or skipped"
        stored = store["y"][:480]
        for t, mine in got.items():
            values = stored[torch.tensor(mine)].view(-1, 3)
            assert (values == values[:, :1]).all(), "a torn append"
            assert sorted(set(values[:, 0].tolist())) == [t * 1000 + i for i in range(40)]
        assert store.ring_state().valid == 480
    finally:
        store.clear_redis()
        store.close()


def test_appends_that_cannot_arm_do_not_reconnect(real_server, admin, monkeypatch):
    """An append whose re-arming is refused (another handle appended meanwhile), or whose
    armed MULTI is aborted, goes on the connection it has: dropping it would cost the server
    a new connection."""
    monkeypatch.setattr(_append, "COOL_APPENDS", 0)  # every append tries to arm
    kwargs = real_server.connection_kwargs()
    store = TensorDictStore.from_schema({"y": ([], torch.float32)}, batch_size=[1000], **kwargs)
    other = TensorDictStore.from_store(td_id=store.td_id, **kwargs)
    try:
        for handle in (store, other):
            handle.extend(TensorDict(y=torch.zeros(1), batch_size=[1]))
        admin.config_resetstat()
        before = int(admin.info("stats")["total_connections_received"])
        for i in range(50):
            for handle in (store, other):  # each append moves the cursor the other one watches
                handle.extend(TensorDict(y=torch.full((1,), float(i)), batch_size=[1]))
        opened = int(admin.info("stats")["total_connections_received"]) - before
        assert opened == 0, f"{opened} connections opened by 100 appends"
        assert calls(admin)["unwatch"] >= 90, "the appends were not aborted nor refused"
        assert store.ring_state() == (102, 102, 1000, 102)
    finally:
        other.close()
        store.clear_redis()
        store.close()


@pytest.mark.parametrize("protocol", [2, 3])
@pytest.mark.parametrize("parser", ["hiredis", "python"])
def test_an_exchange_reads_every_reply_in_place(real_server, parser, protocol):
    """``wire.exchange_sync`` reads a packet's replies straight from the hiredis reader (or one by
    one through ``read_response`` for another parser): the same replies, errors in place."""
    import redis
    from redis._parsers import _HiredisParser, _RESP2Parser

    from tdstore._backend import wire

    if parser == "python":
        from redis._parsers import _RESP3Parser

        cls = _RESP2Parser if protocol == 2 else _RESP3Parser
    else:
        cls = _HiredisParser
    kwargs = real_server.connection_kwargs()
    pool_class = redis.UnixDomainSocketConnection if "unix_socket_path" in kwargs else redis.Connection
    client = redis.Redis(connection_pool=redis.ConnectionPool(
        connection_class=pool_class, parser_class=cls, protocol=protocol, **kwargs
    ))
    connection = client.connection_pool.get_connection()
    try:
        assert (wire._hiredis_reader(connection) is not None) == (parser == "hiredis")
        client.delete("t:x", "t:s")
        client.set("t:s", "text")
        big = b"y" * 300_000
        replies = wire.exchange_sync(connection, [
            ("INCR", "t:s"), ("MULTI",), ("INCR", "t:x"), ("INCR", "t:s"), ("SET", "t:b", memoryview(big)), ("EXEC",),
            ("GET", "t:b"), ("GET", "t:missing"), ("HLEN", "t:missing"),
        ])
        assert isinstance(replies[0], redis.exceptions.ResponseError)
        assert replies[1] == b"OK" and replies[2:5] == [b"QUEUED"] * 3
        assert replies[5][0] == 1 and isinstance(replies[5][1], redis.exceptions.ResponseError) and replies[5][2] == b"OK"
        assert replies[6] == big and replies[7] is None and replies[8] == 0
        assert client.ping()  # the connection is still in step
    finally:
        client.connection_pool.release(connection)
        client.delete("t:x", "t:s", "t:b")
        client.close()


def test_an_armed_handle_appends_after_fork_in_the_children_and_the_parent(real_server):
    """The parent's armed connection is never used by a forked child (it has its own client)."""
    import multiprocessing as mp

    store = TensorDictStore.from_schema({"y": ([], torch.int64)}, batch_size=[100], **real_server.connection_kwargs())
    try:
        store.extend(TensorDict(y=torch.full((2,), 1), batch_size=[2]))
        store.extend(TensorDict(y=torch.full((2,), 1), batch_size=[2]))
        assert store._conn.append_slot.armed is not None
        ctx = mp.get_context("fork")
        q = ctx.Queue()

        def child(value: int) -> None:
            try:
                got = [store.extend(TensorDict(y=torch.full((2,), value), batch_size=[2])).tolist() for _ in range(3)]
                q.put(("ok", got))
            except Exception as err:  # noqa: BLE001 - reported to the parent
                q.put(("err", repr(err)))

        procs = [ctx.Process(target=child, args=(v,)) for v in (2, 3)]
        for p in procs:
            p.start()
        results = [q.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        assert all(kind == "ok" for kind, _ in results), results
        mine = store.extend(TensorDict(y=torch.full((2,), 9), batch_size=[2])).tolist()
        rows = sorted(r for _, got in results for batch_rows in got for r in batch_rows) + mine
        assert sorted(rows) == list(range(4, 18)), "rows reserved twice or skipped"
        values = store["y"][:18]
        assert values[torch.tensor(mine)].tolist() == [9, 9]
        assert sorted(values.tolist()) == [1] * 4 + [2] * 6 + [3] * 6 + [9] * 2
        assert store.ring_state().valid == 18
    finally:
        store.clear_redis()
        store.close()


def test_a_failure_after_the_append_was_applied_does_not_send_it_again(real_server, monkeypatch):
    """The UNWATCH that gives back a connection that could not arm (when another thread's
    connection holds the slot) runs after the append was applied: its failure must not
    reach the driver, which would send the append again."""
    import redis

    from tdstore._backend.armed_write import ArmedSlot

    monkeypatch.setattr(_append, "COOL_APPENDS", 0)  # every append tries to arm after its write
    monkeypatch.setattr(ArmedSlot, "keep", lambda self, armed: False)  # the slot is always another thread's
    store = TensorDictStore.from_schema({"y": ([], torch.float32)}, batch_size=[4], **real_server.connection_kwargs())
    try:
        # row 0 in flight: every arming fails (the ring comes round to it) until an append takes it over
        assert dead_reservation(store, 1, 4) == 0
        store.extend(TensorDict(y=torch.zeros(1), batch_size=[1]))
        real_send = redis.connection.AbstractConnection.send_command

        def send(self, *args, **kwargs):
            if args and args[0] == "UNWATCH":
                raise redis.exceptions.ConnectionError("the connection broke after the append")
            return real_send(self, *args, **kwargs)

        monkeypatch.setattr(redis.connection.AbstractConnection, "send_command", send)
        got = [store.extend(TensorDict(y=torch.full((1,), float(i)), batch_size=[1])).tolist() for i in range(1, 4)]
        assert got == [[2], [3], [0]]
        assert store.ring_state().total == 5, "an append was sent twice"
        assert store["y"].tolist() == [3.0, 0.0, 1.0, 2.0]
    finally:
        store.clear_redis()
        store.close()
