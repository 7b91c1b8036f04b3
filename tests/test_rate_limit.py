"""Rate limits of a ring, kept on the server (issue 26, item 2; tdstore/replay/rate_limit.py).

Reverb's semantics: a sample waits for ``min_size`` rows; with ``samples_per_insert``,
samples and inserts wait while ``inserts * spi - samples`` would leave
``spi * min_size ± error_buffer``. The unit rules are tested against a model of Reverb's
``RateLimiter`` in tests/lua/test_rate.py; here, the store's API on real servers: waits
that end in time with a clear error and change nothing, the settings seen by every handle,
the keys cleared and expired with the store, no busy loop, and 4 appending and 2 sampling
processes kept within the error buffer.
"""

from __future__ import annotations

import multiprocessing
import time

import _rate_workers as w
import pytest
import torch
from fixtures import PoolSpec
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore.errors import RateLimitTimeoutError

CAP = 64
POOL = PoolSpec(workers=6, warm_up=w.warm_up, warm_up_arg=0.3)


def rows(n: int, value: float = 1.0) -> TensorDict:
    return TensorDict(x=torch.full((n, 4), value), batch_size=[n])


@pytest.fixture
def ring(make):
    return make("from_schema", {"x": ([4], torch.float32)}, batch_size=[CAP])


def test_a_sample_waits_for_min_size_and_gives_up_in_time(ring):
    ring.set_rate_limit(min_size=4, timeout=0.2)
    ring.extend(rows(3))
    t0 = time.monotonic()
    with pytest.raises(RateLimitTimeoutError, match=r"sample\(2\) on .*held it back for 0\.2\d* s, past its timeout of 0\.2 s"):
        ring.sample(2)
    waited = time.monotonic() - t0
    assert 0.2 <= waited < 0.6, waited
    assert ring.rate_limit().samples == 0  # nothing counted
    ring.extend(rows(1))
    assert ring.sample(5).batch_size == torch.Size([5])
    assert (ring.rate_limit().inserts, ring.rate_limit().samples) == (4, 5)


@pytest.mark.parametrize("filled", [0, 3], ids=["empty", "short"])
def test_a_prioritized_sample_is_held_and_counted_like_a_uniform_one(ring, filled):
    ring.enable_priorities(alpha=1.0, beta=0.5)
    ring.set_rate_limit(min_size=4, timeout=0.1)
    if filled:
        ring.extend(rows(filled))
    with pytest.raises(RateLimitTimeoutError, match=r"sample\(2\) on "):
        ring.sample(2, prioritized=True)
    assert ring.rate_limit().samples == 0  # nothing counted
    ring.extend(rows(4 - filled))
    batch, info = ring.sample(5, prioritized=True, return_info=True)
    assert batch.batch_size == torch.Size([5]) and info["index"].lt(4).all()
    assert (ring.rate_limit().inserts, ring.rate_limit().samples) == (4, 5)  # (counted once, as 5 samples)
    ring.set_rate_limit(min_size=1, samples_per_insert=1.0, error_buffer=2, timeout=0.0)  # (counts from 0 again)
    ring.sample(1, prioritized=True)  # 0 * 1 - 1 = -1 >= 1 - 2
    with pytest.raises(RateLimitTimeoutError):
        ring.sample(2, prioritized=True)  # -3 would leave the buffer
    assert ring.rate_limit().samples == 1


def test_an_append_held_back_writes_nothing(ring):
    ring.set_rate_limit(min_size=2, samples_per_insert=1.0, error_buffer=2, timeout=0.0)
    ring.extend(rows(4))  # (0 + 4) * 1 - 0 = 4 <= 2 + 2
    before, state = ring.to_tensordict(), ring.ring_state()
    with pytest.raises(RateLimitTimeoutError, match=r"extend\(\) of 1 rows"):
        ring.extend(rows(1, 9.0))
    assert ring.ring_state() == state
    assert (ring.to_tensordict() == before).all()
    assert ring.rate_limit().inserts == 4
    ring.sample(2)  # 4 - 2 = 2 >= 0: goes, and lets one more row in
    ring.extend(rows(1, 9.0))
    assert ring.rate_limit()[5:] == (5, 2)


def test_the_ratio_follows_reverb_rules(ring):
    """spi 2, min 4, error buffer 4: the band of inserts * 2 - samples is [4, 12]."""
    ring.set_rate_limit(min_size=4, samples_per_insert=2.0, error_buffer=4, timeout=0)
    limit = ring.rate_limit()
    assert (limit.min_size, limit.samples_per_insert, limit.min_diff, limit.max_diff, limit.timeout) == (4, 2.0, 4.0, 12.0, 0.0)
    ring.extend(rows(4))  # stage 1: free while the ring holds at most min_size rows
    ring.extend(rows(2))  # 6 * 2 - 0 = 12 <= 12
    with pytest.raises(RateLimitTimeoutError):
        ring.extend(rows(1))  # 14 > 12
    ring.sample(8)  # 12 - 8 = 4 >= 4
    with pytest.raises(RateLimitTimeoutError):
        ring.sample(1)  # 3 < 4
    ring.extend(rows(4))  # 10 * 2 - 8 = 12
    ring.sample(8)
    assert ring.rate_limit()[5:] == (10, 16)


def test_the_limiter_is_on_the_server_for_every_handle(ring, server):
    ring.set_rate_limit(min_size=3, timeout=0)
    other = TensorDictStore.from_store(td_id=ring.td_id, **server.connection_kwargs())
    try:
        assert other.rate_limit() == ring.rate_limit()
        other.extend(rows(2))
        with pytest.raises(RateLimitTimeoutError):
            ring.sample(1)
        ring.extend(rows(1))
        other.sample(1)
        assert ring.rate_limit().samples == 1
        other.clear_rate_limit()
        assert ring.rate_limit() is None
        ring.sample(1)  # no limiter: nothing counted, nothing waits
    finally:
        other.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_size": 0}, "min_size must be an int >= 1"),
        ({"min_size": CAP + 1}, "more rows than the ring holds"),
        ({"samples_per_insert": 2.0}, "needs error_buffer"),
        ({"samples_per_insert": 2.0, "error_buffer": 1}, "at least max"),
        ({"samples_per_insert": -1.0, "error_buffer": 4}, "samples_per_insert must be a number > 0"),
        ({"error_buffer": 4}, "error_buffer needs samples_per_insert"),
        ({"timeout": -1}, "timeout must be None or seconds >= 0"),
        ({"min_size": 4, "samples_per_insert": 1.0, "error_buffer": (10.0, 20.0)}, "no sample could go"),
    ],
)
def test_bad_settings_are_refused_and_change_nothing(ring, kwargs, match):
    ring.set_rate_limit(min_size=2, samples_per_insert=1.0, error_buffer=3, timeout=1.5)
    ring.extend(rows(2))
    before = ring.rate_limit()
    with pytest.raises(ValueError, match=match) as info:
        ring.set_rate_limit(**kwargs)
    assert ring.td_id in str(info.value)  # names the store
    assert ring.rate_limit() == before


def test_the_limiter_is_cleared_emptied_and_expired_with_the_store(ring, server):
    ring.set_rate_limit(min_size=2, timeout=0)
    ring.extend(rows(3))
    ring.sample(2)
    client = server.sync_client()
    try:
        rate = ring._conn.keys.rate
        assert client.exists(rate)
        ring.set_ring_total(0)  # the replay buffer's empty(): the counts start again
        assert ring.rate_limit()[5:] == (0, 0)
        ring.expire(60)
        assert 0 < client.pttl(rate) <= 60_000
        ring.persist()
        assert client.pttl(rate) == -1
        ring.clear_redis()
        assert not client.exists(rate)
        assert client.keys(f"{ring._conn.keys.base}*") == []
    finally:
        client.close()


def test_a_wait_does_not_busy_loop(stores, real_server):
    """A sample held back for 0.5 s sends its check at most about 20 times a second (the pause
    doubles from 1 ms to 50 ms), counted by the server."""
    ring = stores(real_server, "from_schema", {"x": ([4], torch.float32)}, batch_size=[CAP])
    ring.set_rate_limit(min_size=2, timeout=0.5)
    client = real_server.sync_client()
    try:
        before = client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
        with pytest.raises(RateLimitTimeoutError):
            ring.sample(1)
        calls = client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0) - before
    finally:
        client.close()
    print(f"evalsha calls during a 0.5 s wait: {calls}")
    assert 3 <= calls <= 25, calls


def test_no_append_goes_armed_past_a_limiter(ring):
    """The one-packet (armed) appends skip the reserve step that counts: a limiter set after
    they started disarms them, and every row is counted."""
    for _ in range(5):
        ring.extend(rows(2))  # arms the direct connection
    ring.set_rate_limit(min_size=1)
    for _ in range(20):
        ring.extend(rows(1))
    assert ring.rate_limit().inserts == 20


@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "prioritized"])
def test_a_sample_the_limiter_lets_through_waits_for_the_rows_it_counted(stores, real_server, prioritized):
    """The limiter counts rows when their append reserves them; a sample it lets through while
    they are still being written waits for them (bounded, tdstore.replay.rate_limit.IN_FLIGHT_WAIT_S)
    instead of finding the ring empty: the race the 4+2 process test below once met."""
    ring = stores(real_server, "from_schema", {"x": ([4], torch.float32)}, batch_size=[CAP])
    if prioritized:
        ring.enable_priorities(alpha=1.0, beta=0.5)
    ring.set_rate_limit(min_size=2, timeout=2.0)
    ctx = multiprocessing.get_context("spawn")
    reserved = ctx.Event()
    proc = ctx.Process(target=w.slow_appender, args=(real_server.connection_kwargs(), ring.td_id, 0.4, reserved))
    proc.start()
    try:
        assert reserved.wait(60), "the slow appender did not reserve"
        state = ring.ring_state()
        assert (state.total, state.valid) == (2, 0)  # reserved, not written
        t0 = time.monotonic()
        batch = ring.sample(8, prioritized=prioritized)
        waited = time.monotonic() - t0
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
    assert (batch["x"] == 7.0).all()
    assert 0.1 < waited < 1.5, waited
    assert ring.rate_limit().samples == 8  # counted once


@pytest.mark.multiprocess
def test_four_appenders_and_two_samplers_stay_within_the_error_buffer(pool, race_server):
    """While 4 processes append and 2 sample for 3 s, a monitor reads the counts (one HMGET,
    atomic) and counts the moments ``inserts * spi - samples`` left its band: never above
    max_diff, and never below min_diff once a sample went. Samplers and appenders both made
    progress, and the final ratio is within the buffer."""
    conn = race_server.connection_kwargs()
    ring = TensorDictStore.from_schema({"x": ([4], torch.float32)}, batch_size=[1024], **conn)
    spi, min_size, buffer = 4.0, 32, 64.0
    ring.set_rate_limit(min_size=min_size, samples_per_insert=spi, error_buffer=buffer, timeout=0.5)
    lo, hi = spi * min_size - buffer, spi * min_size + buffer
    client = race_server.sync_client()
    try:
        start = time.time() + 1.0
        futures = [pool.submit(w.appender, conn, ring.td_id, start, 3.0, 2) for _ in range(4)]
        futures += [pool.submit(w.sampler, conn, ring.td_id, start, 3.0, 16) for _ in range(2)]
        reads = violations = 0
        deadline = time.monotonic() + 30
        while not all(f.done() for f in futures) and time.monotonic() < deadline:
            ins, smp = (int(v) for v in client.hmget(ring._conn.keys.rate, ["ins", "smp"]))
            diff = ins * spi - smp
            reads += 1
            violations += diff > hi or (smp > 0 and diff < lo)
            time.sleep(0.002)
        appended = [f.result(timeout=30) for f in futures[:4]]
        sampled = [f.result(timeout=30) for f in futures[4:]]
        limit = ring.rate_limit()
    finally:
        client.close()
        ring.clear_redis()
        ring.close()
    print(f"reads={reads} violations={violations} inserts={limit.inserts} samples={limit.samples} "
          f"appended={appended} sampled={sampled}")
    assert violations == 0
    assert limit.inserts == sum(a for a, _ in appended) and limit.samples == sum(s for s, _ in sampled)
    assert limit.inserts > min_size and limit.samples > 0
    assert lo <= limit.inserts * spi - limit.samples <= hi
    assert reads > 50


def _lose_rate_sample_replies(store, monkeypatch, times: int) -> list[int]:
    """The first ``times`` rate_sample calls run on the server and then lose their reply (the
    connection drops), on whichever driver sends them: the direct client's blocking exchange or
    the IO loop's ScriptRunner.call. Returns the list that counts the losses."""
    import redis.exceptions

    from tdstore._backend import blocking, scripts

    lost: list[int] = []
    sha = store._conn.runner.sha("rate_sample") if store._conn._runner is not None else None
    real_exchange, real_call = blocking.exchange, scripts.ScriptRunner.call

    def exchange_then_lose(client, commands):
        replies = real_exchange(client, commands)
        if len(lost) < times and any(c[0] == "EVALSHA" and c[1] == sha for c in commands):
            lost.append(1)
            client.connection_pool.disconnect()
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return replies

    async def call_then_lose(self, client, name, keys, args):
        reply = await real_call(self, client, name, keys, args)
        if name == "rate_sample" and len(lost) < times:
            lost.append(1)
            await client.connection_pool.disconnect()
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return reply

    monkeypatch.setattr(blocking, "exchange", exchange_then_lose)
    monkeypatch.setattr(scripts.ScriptRunner, "call", call_then_lose)
    return lost


def _sample_with_lost_limiter_replies(ring, monkeypatch, prioritized: bool, direct: bool) -> None:
    if prioritized:
        ring.enable_priorities(alpha=1.0, beta=0.5)
    ring.set_rate_limit(min_size=2, timeout=1.0)
    ring.extend(rows(8))
    ring.sample(1, prioritized=prioritized)  # (sets up both drivers: scripts loaded, client open)
    if direct:
        assert ring._conn.direct_client() is not None  # (the driver this case is for)
    else:
        monkeypatch.setattr(type(ring._conn), "direct_client", lambda self: None)
    lost = _lose_rate_sample_replies(ring, monkeypatch, times=2)
    batch = ring.sample(3, prioritized=prioritized)
    assert batch.batch_size == torch.Size([3]) and len(lost) == 2
    assert ring.rate_limit().samples == 4  # 1 + 3: the two tries sent again counted nothing more
    ring.sample(2, prioritized=prioritized)  # (a new sample: a new token, counted)
    assert ring.rate_limit().samples == 6


@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "prioritized"])
def test_a_sample_whose_limiter_reply_was_lost_is_counted_once(ring, monkeypatch, prioritized):
    """The IO-loop driver: the limiter step of a sample runs, then its reply is lost (twice in a
    row); the retry policy sends it again with the sample's token and the sample counts its rows
    once. Without the tokens, each lost reply counted the sample once more."""
    _sample_with_lost_limiter_replies(ring, monkeypatch, prioritized, direct=False)


@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "prioritized"])
def test_a_direct_sample_whose_limiter_reply_was_lost_is_counted_once(stores, real_server, monkeypatch, prioritized):
    """The same from the calling thread's blocking client (real servers: fakeredis has none),
    whose lost reply goes on through the IO loop (Connection.script's fallback)."""
    ring = stores(real_server, "from_schema", {"x": ([4], torch.float32)}, batch_size=[CAP])
    _sample_with_lost_limiter_replies(ring, monkeypatch, prioritized, direct=True)


def test_sample_tokens_are_checked_kept_bounded_and_damage_is_ignored(ring, server):
    """rate_sample itself: a malformed token is refused (nothing counted); a token counted is not
    counted again, 64 are kept (the oldest then forgotten); a damaged "tok" field reads as no
    token, and a try after it counts and rewrites it."""
    from tdstore._backend.scripts import get_script
    from tdstore.errors import SchemaError

    ring.set_rate_limit(min_size=1)
    ring.extend(rows(4))
    keys = ring._conn.keys
    names = [keys.meta, keys.ring, keys.rate]

    def count(token: str, n: int = 1) -> object:
        return ring._conn.script("rate_sample", names, [str(n), str(CAP), token])

    for bad in ("ABCDEF0123456789", "abc", "0123456789abcdef0", "01234567 9abcdef"):
        with pytest.raises(SchemaError, match="a sample token is 16 lowercase hex digits"):
            count(bad)
    assert ring.rate_limit().samples == 0
    first = f"{1:016x}"
    assert count(first)[0] == 1 and count(first)[0] == 1 and ring.rate_limit().samples == 1
    assert count("")[0] == 1 and count("")[0] == 1 and ring.rate_limit().samples == 3  # (no token: each counts)
    for i in range(2, 66):  # 64 more: the first is forgotten
        count(f"{i:016x}")
    assert ring.rate_limit().samples == 67
    client = server.sync_client()
    try:
        assert client.hstrlen(keys.rate, "tok") == 64 * 16
        count(f"{40:016x}")  # (kept: not counted again)
        assert ring.rate_limit().samples == 67
        count(first)  # (forgotten: counted)
        assert ring.rate_limit().samples == 68
        client.hset(keys.rate, "tok", "x" * 1000)  # damaged: not a whole number of tokens
        count(f"{40:016x}")
        assert ring.rate_limit().samples == 69 and client.hget(keys.rate, "tok") == f"{40:016x}".encode()
    finally:
        client.close()
    assert "lowercase hex" in get_script("rate_sample").source  # (the header says what is checked)
