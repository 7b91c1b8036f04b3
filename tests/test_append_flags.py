"""The written-row flags of the two-step append, in one process (tdstore/_backend/append.py).

A reservation made with the reserve script alone (an appender that died between its two
steps) leaves rows that ``sample()`` and ``ring_state()`` never count; a write whose EXEC a
layout change aborted is re-planned onto the same rows; a reservation the ring came round
to is taken over.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore._backend import append as _append
from tdstore._core.keys import StoreKeys
from tdstore.store import ring as _ring

CAP = 8


def batch(value: float, n: int) -> TensorDict:
    return TensorDict(x=torch.full((n, 2), value), y=torch.full((n,), value), batch_size=[n])


@pytest.fixture
def store(server):
    s = TensorDictStore.from_schema({"x": ([2], torch.float32), "y": ([], torch.float32)}, batch_size=[CAP],
                                    **server.connection_kwargs())
    yield s
    s.clear_redis()
    s.close()


def dead_reservation(store, n: int) -> int:
    """Reserves ``n`` rows as an appender that dies before writing them; returns the cursor it got."""
    conn = store._conn
    layout = store._layout()
    plan = _append.AppendPlan(conn.keys, [], lv=layout.lv, n=n, capacity=CAP, sub=(), reservation=_append.Reservation())
    keys, args = plan.reserve_keys_args("new")
    return int(conn.run(lambda c: conn.runner.call(c, "reserve", keys, args))[0])


@pytest.mark.parametrize("large", [False, True], ids=["flags-read-whole", "flags-per-row"])
def test_sample_skips_rows_reserved_and_not_written(store, monkeypatch, large):
    if large:
        monkeypatch.setattr(_ring._append_mod, "FLAGS_READ_MAX", 2)  # the BITFIELD path of large rings
    store.extend(batch(1.0, 2))  # rows 0-1
    assert dead_reservation(store, 3) == 2  # rows 2-4: reserved, never written
    store.extend(batch(2.0, 2))  # rows 5-6
    state = store.ring_state()
    assert (state.valid, state.total, state.cursor) == (4, 7, 7)
    drawn = store.sample(400)
    assert set(drawn["y"].tolist()) == {1.0, 2.0}, "a sampled row was reserved but never written"
    rows = _ring.draw_written(store, 400, torch.Generator().manual_seed(0))
    assert set(rows.tolist()) == {0, 1, 5, 6}


def test_the_ring_comes_round_and_takes_the_dead_rows_over(store, server):
    store.extend(batch(1.0, 2))
    dead_reservation(store, 3)  # rows 2-4
    for i in range(4):
        store.extend(batch(float(i + 2), 2))  # rows 5-6, 7-0, 1-2, 3-4: over the dead rows
    assert store.ring_state().valid == CAP
    client = server.sync_client()
    try:
        base = store._conn.keys
        assert client.exists(base.inflight) == 0, "no in-flight hash: the flags record the appends in flight"
        # the appends at rows 1-2 and 3-4 each came round to some of the dead rows (flags
        # clear) and took them over; the one at 7-0 reused only written rows
        assert client.get(base.fence) == b"2", "one takeover per append over the dead rows"
        assert client.getrange(base.flags, 0, CAP - 1) == b"\x01" * CAP
    finally:
        client.close()
    assert 0.0 not in store.sample(200)["y"].tolist()


def test_sample_of_an_empty_ring_and_of_only_dead_rows(store):
    with pytest.raises(ValueError, match="no row was appended yet"):
        store.sample(1)
    dead_reservation(store, 2)
    with pytest.raises(ValueError, match="no row was appended yet"):
        store.sample(1)
    assert store.ring_state().valid == 0


def test_a_layout_change_between_the_steps_rewrites_the_same_rows(server, monkeypatch):
    """The first EXEC is aborted by a layout change after the reserve (the layout version
    bumped, as every commit that changes the layout does): the append is re-planned and
    lands in the rows it reserved, written whole."""
    store = TensorDictStore.from_schema({("buf", "x"): ([2], torch.float32), ("buf", "y"): ([], torch.float32)},
                                        batch_size=[CAP], **server.connection_kwargs())
    store["z"] = torch.zeros(CAP)
    real = _append.AppendPlan.write_commands
    calls = []
    client = server.sync_client()

    def change_layout_first(self, start, exp):
        if not calls:  # (a raw client: this may run on tdstore's IO loop, which a store call would need)
            client.hincrby(store._conn.keys.meta, "lv", 1)
        calls.append(start)
        return real(self, start, exp)

    monkeypatch.setattr(_append.AppendPlan, "write_commands", change_layout_first)
    assert store["buf"].extend(batch(1.0, 3)).tolist() == [0, 1, 2]
    monkeypatch.setattr(_append.AppendPlan, "write_commands", real)
    assert calls == [0, 0]  # the same rows, planned twice
    state = store.ring_state()
    assert (state.valid, state.total) == (3, 3)
    assert store["buf", "y"][:4].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert store["z"].tolist() == [0.0] * CAP
    client.close()
    store.clear_redis()
    store.close()


def test_a_cursor_set_by_the_client_counts_its_rows_as_written(store):
    """torchrl's load_state_dict sets the cursor (set_ring_total): those rows are valid,
    and stay so after the next append."""
    from tdstore._backend import priorities as _backend

    conn = store._conn
    store[0:5] = batch(3.0, 5)
    assert conn.run(lambda c: _backend.set_ring_total(c, conn.keys, conn.runner, 5, CAP))
    assert store.ring_state().valid == 5
    store.extend(batch(4.0, 1))  # row 5
    assert store.ring_state().valid == 6
    assert set(store.sample(300)["y"].tolist()) == {3.0, 4.0}
    assert conn.run(lambda c: _backend.set_ring_total(c, conn.keys, conn.runner, 0, CAP))
    assert store.ring_state().valid == 0


def _set_total_elsewhere(server, store, total: int) -> None:
    """``set_ring_total`` from another connection on a loop of its own (this may run on
    tdstore's IO loop, which another store's call would need)."""
    import asyncio
    import threading

    from tdstore._backend import priorities as _backend

    got: list[object] = []

    async def run() -> None:
        client = server.async_client()
        try:
            got.append(await _backend.set_ring_total(client, store._conn.keys, store._conn.runner, total, CAP))
        finally:
            await client.aclose()

    thread = threading.Thread(target=lambda: asyncio.run(run()))
    thread.start()
    thread.join(30)
    assert got == [True]


@pytest.mark.parametrize(("total", "rows"), [(7, [5, 6]), (3, [3, 4])], ids=["rows-kept", "rows-taken-anew"])
def test_a_cursor_set_between_an_appends_two_steps_keeps_every_counted_row(store, server, monkeypatch, total, rows):
    """The cursor is set (torchrl's load_state_dict) after an append reserved rows 5-6 and
    before its write. The write is aborted (the fence moved) and checks its rows against the
    new cursor: still below it (total 7), it writes them; past it (total 3), it takes rows
    3-4. Before, its EXEC went through and set its flags in a flags string that the cursor
    set had deleted: rows 0-4 were then counted as never written, and sample() never drew
    them again."""
    store.extend(batch(1.0, 5))  # rows 0-4
    real = _append.AppendPlan.write_commands
    calls: list[int] = []

    def set_cursor_first(self, start, exp):
        if not calls:
            _set_total_elsewhere(server, store, total)
        calls.append(start)
        return real(self, start, exp)

    monkeypatch.setattr(_append.AppendPlan, "usable", lambda self, held: False)  # the two steps, not one packet
    monkeypatch.setattr(_append.AppendPlan, "write_commands", set_cursor_first)
    got = store.extend(batch(2.0, 2)).tolist()
    monkeypatch.setattr(_append.AppendPlan, "write_commands", real)
    state = store.ring_state()
    assert (state.valid, state.total) == (max(total, rows[-1] + 1), max(total, rows[-1] + 1))
    assert store["y"][: state.valid].tolist() == [1.0] * rows[0] + [2.0, 2.0] + [1.0] * (state.valid - rows[-1] - 1)
    assert set(_ring.draw_written(store, 400, torch.Generator().manual_seed(0)).tolist()) == set(range(state.valid))
    assert got == rows
    assert calls[0] == 5 and len(calls) == 2, calls  # planned for rows 5-6, aborted, planned again


def test_a_cursor_set_keeps_the_store_expiry(store, server):
    """The keys that setting the cursor writes expire with the store, whether or not they
    existed (here: a store never appended to). Before, the cursor key lost its expiry and
    outlived the store."""
    from tdstore._backend import priorities as _backend

    store.expire(60)
    conn = store._conn
    client = server.sync_client()
    try:
        for total in (0, 5):
            assert conn.run(lambda c, t=total: _backend.set_ring_total(c, conn.keys, conn.runner, t, CAP))
            for key in (conn.keys.ring, conn.keys.flags, conn.keys.fence, conn.keys.wv):
                if key == conn.keys.flags and total == 0:
                    assert client.exists(key) == 0, "no row counted: no flags"
                    continue
                assert 0 < client.pttl(key) <= 60_000, f"{key} has no expiry after the cursor was set to {total}"
    finally:
        client.close()
    assert store.ring_state().valid == 5


def test_a_cursor_set_on_a_deleted_store_writes_nothing(store, server):
    from tdstore._backend import priorities as _backend

    store.extend(batch(1.0, 2))
    other = TensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs())
    other.clear_redis()
    other.close()
    conn = store._conn
    assert conn.run(lambda c: _backend.set_ring_total(c, conn.keys, conn.runner, 4, CAP)) is False
    client = server.sync_client()
    try:
        assert list(client.scan_iter(match=f"{store.prefix}:{{{store.td_id}}}:*")) == []
    finally:
        client.close()
    for total in (-1, 2**52 + 1):  # 2**52: the cursor bound appends hold to (lua/reserve.lua)
        with pytest.raises(ValueError, match=r"a row count from 0 to 2\*\*52 and a capacity >= 1"):
            conn.run(lambda c, total=total: _backend.set_ring_total(c, conn.keys, conn.runner, total, CAP))


def test_a_data_key_gone_from_the_server_is_reported(store, server):
    """An evicted (here: deleted) data key: the write's SETRANGE replies are short, extend() says so."""
    from tdstore.errors import DataLostError

    store.extend(batch(1.0, 2))
    client = server.sync_client()
    try:
        client.delete(store._conn.keys.data(("x",)))
    finally:
        client.close()
    with pytest.raises(DataLostError, match="bytes were gone from the server"):
        store.extend(batch(2.0, 2))


def test_a_reply_lost_after_the_write_is_an_unknown_outcome_not_a_second_append(store, monkeypatch):
    """The IO-loop driver: the connection dies after the server ran the MULTI/EXEC, before its
    replies came back. The append raises OutcomeUnknownError and is not sent again: its rows
    are in the store once (sending it again took new rows for the same data: a duplicate
    append, found by tests/test_restart.py through real crashes)."""
    import redis.exceptions

    from tdstore._backend import wire
    from tdstore.errors import OutcomeUnknownError

    monkeypatch.setattr(type(store._conn), "direct_client", lambda self: None)  # the IO-loop driver
    real = wire.exchange
    lost = []

    async def exchange_then_lose_the_reply(connection, commands):
        writes = any(str(command[0]).upper() == "SETRANGE" for command in commands)
        replies = await real(connection, commands)  # the server runs it
        if writes and not lost:
            lost.append(1)
            await connection.disconnect()
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return replies

    monkeypatch.setattr(wire, "exchange", exchange_then_lose_the_reply)
    with pytest.raises(OutcomeUnknownError, match="may or may not have been applied"):
        store.extend(batch(1.0, 2))
    monkeypatch.setattr(wire, "exchange", real)
    assert lost == [1]
    state = store.ring_state()
    assert (state.valid, state.total) == (2, 2)  # applied once, not sent again
    assert store["y"].tolist() == [1.0, 1.0] + [0.0] * (CAP - 2)
    assert store.extend(batch(2.0, 1)).tolist() == [2]  # the store goes on


def test_a_reply_lost_during_the_reserve_step_sends_the_append_again_once(store, monkeypatch):
    """The IO-loop driver: the connection dies after the server ran the reserve script,
    before its reply came back. No row was written yet, so the append is sent again
    (ReserveReplyLost, retried as nothing applied): it succeeds once, in new rows; the first
    reservation's rows are left as a dead appender's (unflagged, never sampled, counted by total)."""
    monkeypatch.setattr(type(store._conn), "direct_client", lambda self: None)
    _lose_the_reserve_reply(store, monkeypatch)


def test_reserve_replies_lost_until_the_retries_run_out_say_what_was_left(store, monkeypatch):
    """Every reserve reply lost: the append gives up with ServerUnavailableError, which says
    that no row was written and what the reservations left (not "nothing was applied": a
    reserve that ran counts its rows in ring_state().total)."""
    import redis.exceptions

    from tdstore._backend import wire
    from tdstore._backend.retry import RetryPolicy
    from tdstore.errors import ServerUnavailableError

    monkeypatch.setattr(type(store._conn), "direct_client", lambda self: None)
    store._conn.retry_policy = RetryPolicy(attempts=3, backoff_base=0.001, backoff_cap=0.002, deadline=30.0)
    real = wire.exchange
    lost = []

    async def exchange_then_lose(connection, commands):
        replies = await real(connection, commands)
        names = [str(command[0]).upper() for command in commands]
        if "EVALSHA" in names and "SETRANGE" not in names:
            lost.append(1)
            await connection.disconnect()
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return replies

    monkeypatch.setattr(wire, "exchange", exchange_then_lose)
    store._conn.append_slot.cool = 10**6
    with pytest.raises(ServerUnavailableError, match=r"None of its rows was written.*ring_state\(\)\.total") as info:
        store.extend(batch(1.0, 2))
    assert "Nothing of this operation was applied" not in str(info.value)
    monkeypatch.setattr(wire, "exchange", real)
    assert len(lost) == 3
    state = store.ring_state()
    assert state.valid == 0 and state.total == 6  # (three reservations of 2 rows, none written)
    assert store.extend(batch(2.0, 1)).tolist() == [6]


def test_a_reply_lost_during_the_reserve_step_of_a_direct_append(real_server, monkeypatch):
    """The same through the blocking driver of the calling thread (real servers: fakeredis
    has no direct client), whose failure goes on through the IO loop."""
    s = TensorDictStore.from_schema({"x": ([2], torch.float32), "y": ([], torch.float32)}, batch_size=[CAP],
                                    **real_server.connection_kwargs())
    try:
        assert s._conn.direct_client() is not None  # (the driver this test is for)
        _lose_the_reserve_reply(s, monkeypatch)
    finally:
        s.clear_redis()
        s.close()


def _lose_the_reserve_reply(store, monkeypatch) -> None:
    import redis.exceptions

    from tdstore._backend import wire

    lost = []

    def reserves(commands) -> bool:
        return any(str(command[0]).upper() == "EVALSHA" for command in commands) and not any(
            str(command[0]).upper() == "SETRANGE" for command in commands
        )

    real_async, real_sync = wire.exchange, wire.exchange_sync

    async def exchange_then_lose(connection, commands):
        replies = await real_async(connection, commands)  # the server runs it
        if reserves(commands) and not lost:
            lost.append(1)
            await connection.disconnect()
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return replies

    def exchange_sync_then_lose(connection, commands):
        replies = real_sync(connection, commands)
        if reserves(commands) and not lost:
            lost.append(1)
            connection.disconnect()
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return replies

    monkeypatch.setattr(wire, "exchange", exchange_then_lose)
    monkeypatch.setattr(wire, "exchange_sync", exchange_sync_then_lose)
    store._conn.append_slot.cool = 10**6  # (never armed: every append takes the two steps)
    got = store.extend(batch(1.0, 2))
    monkeypatch.setattr(wire, "exchange", real_async)
    monkeypatch.setattr(wire, "exchange_sync", real_sync)
    assert lost == [1]
    assert got.tolist() == [2, 3], "the append was sent again into the rows after its first reservation"
    state = store.ring_state()
    assert (state.valid, state.total) == (2, 4)  # written once; rows 0-1 reserved, never written
    assert store["y"].tolist() == [0.0, 0.0, 1.0, 1.0] + [0.0] * (CAP - 4)
    assert set(store.sample(200, return_info=True)[1]["index"].tolist()) == {2, 3}
    assert store.extend(batch(2.0, 1)).tolist() == [4]


def test_a_damaged_counter_fails_the_append_once_and_clearly(store, server):
    """A key of the store holding another type (here the append counters): the write's MULTI
    ran but for that command; the append is reported once, never sent again."""
    from tdstore.errors import CorruptMetadataError

    store.extend(batch(1.0, 2))
    client = server.sync_client()
    try:
        client.delete(store._conn.keys.appends)
        client.set(store._conn.keys.appends, "not a hash")
        for value in (2.0, 3.0):
            with pytest.raises(CorruptMetadataError, match="refused part of an append"):
                store.extend(batch(value, 2))
        assert int(client.get(store._conn.keys.ring)) == 6, "an append was sent again"
        assert store["y"][:6].tolist() == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    finally:
        client.close()
    store.clear_redis()
    assert not any(True for _ in server.sync_client().scan_iter(match=f"*{store.td_id}*"))


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (b"\x01\x00\x01\x01", [True, False, True, False]),  # (short: the rows past the end are not flagged)
        (b"\x01\x00\x01\x01\x01\x01\x01\x00", [True, False, True, True]),
        (b"", [False, False, False, False]),
        (b"\x01\x02", None),  # (a byte other than 0 and 1: not flags)
        ([1, 0, 1, 1], [True, False, True, True]),  # (a BITFIELD of the rows' GETs)
        ([1, 0, 1], None),  # (not one per row)
        ([1, 0, 2, 1], None),
        (Exception("WRONGTYPE Operation against a key holding the wrong kind of value"), None),
    ],
)
def test_rows_flagged_reads_whole_flags_or_the_rows_and_refuses_what_is_not_flags(flags, expected):
    """One reading of the flags a sample's snapshot took (draw_check_prefix): the ring's whole
    by GETRANGE, padded with clear rows past their end, or the drawn rows' by BITFIELD; None
    where the reply is not flags, for the caller to refuse or to check another way."""
    got = _append.rows_flagged(flags, torch.tensor([0, 1, 2, 6]) if isinstance(flags, bytes) else torch.tensor([0, 1, 2, 3]), CAP)
    assert (None if got is None else got.tolist()) == expected


def test_draw_check_prefix_reads_the_whole_flags_up_to_the_threshold_and_the_rows_above(monkeypatch):
    """The snapshot's flags: one GETRANGE of the ring's whole flags on a ring of at most
    FLAGS_READ_MAX rows, else one BITFIELD of the rows' GETs; the cursor and the limiter mark
    before them either way."""
    keys = StoreKeys("tensordict", "t")
    rows = torch.tensor([5, 0, 5])
    whole = _append.draw_check_prefix(keys, CAP, rows)
    bracket = [("HGET", keys.meta, "lv"), ("GET", keys.wv), ("HGETALL", keys.appends)]
    assert whole == [("GET", keys.ring), ("HGET", keys.meta, "lim"), ("GETRANGE", keys.flags, 0, CAP - 1), *bracket]
    monkeypatch.setattr(_append, "FLAGS_READ_MAX", CAP - 1)
    per_row = _append.draw_check_prefix(keys, CAP, rows)
    assert per_row[:2] == whole[:2] and per_row[3:] == bracket
    assert per_row[2] == ("BITFIELD", keys.flags, "GET", "u8", "#5", "GET", "u8", "#0", "GET", "u8", "#5")
