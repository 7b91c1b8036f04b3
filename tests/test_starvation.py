"""No read starves under layout churn, whatever its size or form (docs/guarantees.md, "Reads
under layout churn").

Writers add and delete keys as fast as they can (2 threads and, on a real server, 2 spawned
processes; 4 threads on fakeredis, which lives in this process), so that the layout version
changes between any read's layout read and data read. Every form of read must finish without
``StaleLayoutError``, return the right data, within a bounded number of tries (a read takes a
lease after ``LEASE_AFTER`` lost tries, then needs at most two more) and a bounded time. And a
reader that dies holding a lease delays layout changes by at most the lease's length.
"""

from __future__ import annotations

import time
from typing import Any

import _starve_workers as w
import pytest
import torch
from fixtures import PoolSpec
from tensordict import LazyStackedTensorDict, TensorDict
from test_threads import _run_threads

import tdstore.lazy.reads as lazy_reads
import tdstore.store.reads as store_reads
from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore._backend import ops as _ops
from tdstore._backend import optimistic as _optimistic

try:
    from tdstore._backend import lease as _lease
except ImportError:  # the code before read leases: these tests are shown to fail there
    _lease = None  # type: ignore[assignment]

CHURN_S = 2.0  # seconds the writers churn
ROWS = 6
#: the most tries a read may need: LEASE_AFTER lost ones, then two under the lease
MAX_TRIES = getattr(_lease, "LEASE_AFTER", 4) + 2
MAX_LATENCY_S = 5.0  # generous: a loaded 2-core machine; the typical worst case is far below


#: the module's ``pool`` (tests/fixtures.py)
POOL = PoolSpec(workers=2, warm_up=w.warm_up, warm_up_arg=0.0)


@pytest.fixture
def tries(monkeypatch):
    """The number of tries of every optimistic read call of this process (instrumented, not replaced)."""
    counts: list[int] = []
    real = _optimistic.optimistic

    def counting(attempt_fn, **kwargs):
        seen = [0]

        def attempt(n):
            seen[0] = n + 1
            return attempt_fn(n)

        try:
            return real(attempt, **kwargs)
        finally:
            counts.append(seen[0])

    monkeypatch.setattr(store_reads, "optimistic", counting)
    monkeypatch.setattr(lazy_reads, "optimistic", counting)
    return counts


def _churn(request, server, td_id: str, lazy: bool, readers: list[Any]) -> list[BaseException]:
    """Runs ``readers`` (callables of ``stop``) in threads while writers churn the store's layout."""
    conn = server.connection_kwargs()
    futures = []
    nthreads = 4
    if server.kind != "fakeredis":  # fakeredis lives in this process: threads only
        pool = request.getfixturevalue("pool")
        futures = [pool.submit(w.churn, conn, td_id, f"p{j}_", lazy, ROWS, CHURN_S) for j in range(2)]
        nthreads = 2

    def writer(name: str):
        return lambda stop: w.churn(conn, td_id, name, lazy, ROWS, CHURN_S)

    errors = _run_threads([writer(f"t{j}_") for j in range(nthreads)] + readers, seconds=CHURN_S)
    for f in futures:
        assert f.result(timeout=120) > 0
    return errors


def _reader(latencies: list[float], reads: list[Any]):
    """A reader thread: runs each read of ``reads`` in turn (each checks its result), timed."""

    def body(stop):
        for i in range(100_000):
            if stop.is_set():
                return
            t0 = time.perf_counter()
            reads[i % len(reads)]()
            latencies.append(time.perf_counter() - t0)

    return body


def _check(errors, latencies, tries, what):
    assert not errors, [f"{type(e).__name__}: {e}" for e in errors[:3]]
    assert len(latencies) >= 4, f"{what}: only {len(latencies)} reads"
    assert max(latencies) < MAX_LATENCY_S, f"{what}: a read took {max(latencies):.2f} s"
    assert max(tries) <= MAX_TRIES, f"{what}: a read took {max(tries)} tries (of {len(tries)} reads)"


def _no_lease_left(server, store) -> None:
    client = server.sync_client()
    assert not client.exists(f"{store._conn.keys.base}:rl"), "a read lease was left behind"


@pytest.mark.parametrize("form", ["chunked", "large"])
def test_whole_reads_are_not_starved(server, request, tries, monkeypatch, form):
    """to_tensordict() of a chunked store, and of a store above the one-step limit (which the
    read_all script does not read), under churn."""
    x = torch.arange(ROWS * 16.0).reshape(ROWS, 16)
    if form == "chunked":
        store = TensorDictStore(batch_size=[ROWS], chunk_bytes=64, **server.connection_kwargs())
    else:
        monkeypatch.setattr(_ops, "READ_ALL_MAX_BYTES", 16)
        store = TensorDictStore(batch_size=[ROWS], **server.connection_kwargs())
    store["x"] = x
    store["n", "y"] = torch.ones(ROWS, 3, dtype=torch.int64)
    if form == "chunked":
        assert store._conn.keys.chunks, "the entries must be chunked"
    latencies: list[float] = []

    def whole():
        td = store.to_tensordict()
        assert (td["x"] == x).all() and (td["n", "y"] == 1).all() and td.batch_size == torch.Size([ROWS])

    errors = _churn(request, server, store.td_id, False, [_reader(latencies, [whole]) for _ in range(2)])
    _check(errors, latencies, tries, form)
    _no_lease_left(server, store)
    store.clear_redis()


def test_indexed_reads_are_not_starved(server, request, tries, monkeypatch):
    """store[i], store[list], get_at and sample() under churn (the store above the one-step limit)."""
    monkeypatch.setattr(_ops, "READ_ALL_MAX_BYTES", 16)
    x = torch.arange(ROWS * 4.0).reshape(ROWS, 4)
    store = TensorDictStore(batch_size=[ROWS], **server.connection_kwargs())
    store["x"] = torch.zeros(ROWS, 4)
    store.extend(TensorDict({"x": x}, [ROWS]))  # every row valid, for sample()
    latencies: list[float] = []

    def one_row():
        assert (store[2]["x"] == x[2]).all()

    def rows():
        assert (store[[4, 0, 4]]["x"] == x[[4, 0, 4]]).all()

    def get_at():
        assert (store.get_at("x", 3) == x[3]).all()

    def sample():
        got = store.sample(3)["x"]
        assert got.shape == (3, 4) and all(any((row == r).all() for r in x) for row in got)

    readers = [_reader(latencies, [one_row, rows, get_at, sample]) for _ in range(2)]
    errors = _churn(request, server, store.td_id, False, readers)
    _check(errors, latencies, tries, "indexed")
    _no_lease_left(server, store)
    store.clear_redis()


def test_lazy_reads_are_not_starved(server, request, tries):
    """A lazy store's whole, element, leaf and indexed reads under churn."""
    elems = [TensorDict({"x": torch.full((3,), float(i))}, []) for i in range(ROWS)]
    store = LazyStackedTensorDictStore.from_lazy_stack(LazyStackedTensorDict(*elems), **server.connection_kwargs())
    latencies: list[float] = []
    want = torch.arange(float(ROWS))

    def whole():
        assert (store.to_tensordict()["x"][:, 0] == want).all()

    def element():
        assert (store[2]["x"] == 2).all()

    def leaf():
        assert (store["x"][:, 1] == want).all()

    def indexed():
        assert (store[[1, 4]]["x"][:, 0] == torch.tensor([1.0, 4.0])).all()

    readers = [_reader(latencies, [whole, element, leaf, indexed]) for _ in range(2)]
    errors = _churn(request, server, store.td_id, True, readers)
    _check(errors, latencies, tries, "lazy")
    _no_lease_left(server, store)
    store.clear_redis()


def test_a_dead_readers_lease_delays_layout_changes_by_at_most_its_length(server, monkeypatch):
    """A lease taken and never dropped (its reader died): layout changes wait for it to end,
    at most its length; writes that keep the layout do not wait; no key is left behind."""
    _dead_lease(server, monkeypatch)


def test_leases_on_a_cluster(cluster_server, monkeypatch):
    """The same on a Redis Cluster: the lease key lives in the store's slot."""
    _dead_lease(cluster_server, monkeypatch)


def _dead_lease(server, monkeypatch):
    monkeypatch.setattr(_lease, "LEASE_MS", 600)
    store = TensorDictStore(batch_size=[4], **server.connection_kwargs())
    store["x"] = torch.zeros(4)
    dead = _lease.ReadLease(TensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs())._conn)
    client = server.sync_client()
    rl = f"{store._conn.keys.base}:rl"

    dead.take()
    t0 = time.perf_counter()
    store["x"] = torch.ones(4)  # same shape and dtype: no layout change, no wait
    assert time.perf_counter() - t0 < 0.45  # a wait for the lease would take its 0.6 s
    store["new"] = torch.ones(4)  # a new key: waits for the lease
    waited = time.perf_counter() - t0
    assert 0.3 < waited < 0.6 + 1.0, waited
    assert "new" in store.keys()

    dead.take()  # again: an indexed write that creates an entry (the WATCHed path) waits too
    t0 = time.perf_counter()
    store[1:3] = TensorDict({"created": torch.full((2,), 5.0)}, [2])
    waited = time.perf_counter() - t0
    assert 0.3 < waited < 0.6 + 1.0, waited
    assert (store["created"] == torch.tensor([0.0, 5.0, 5.0, 0.0])).all()

    dead.take()  # and a delete
    t0 = time.perf_counter()
    store.del_("new")
    assert 0.3 < time.perf_counter() - t0 < 0.6 + 1.0
    time.sleep(0.7)
    assert not client.exists(rl), "an ended lease leaves no key behind"

    dead.take()
    store.clear_redis()  # deletes a live lease with the rest of the store
    assert not client.exists(rl)
    with pytest.raises(KeyError):
        TensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs())
    dead.take()  # a reader of a store deleted meanwhile leaves no lease either
    assert not client.exists(rl)


def test_a_released_lease_frees_writers_at_once(server):
    """A read that took a lease drops it when it returns: writers do not wait for its deadline."""
    store = TensorDictStore(batch_size=[4], **server.connection_kwargs())
    store["x"] = torch.zeros(4)
    lease = _lease.ReadLease(store._conn)
    lease.take()
    assert server.sync_client().exists(f"{store._conn.keys.base}:rl")
    lease.release()
    t0 = time.perf_counter()
    store["new"] = torch.ones(4)
    assert time.perf_counter() - t0 < 0.45  # a wait for the lease would take its 2 s
    store.clear_redis()


def test_lease_length():
    """A lease covers its read at 50 MB/s, from 2 s up to 60 s (what a dead reader can hold writers back)."""
    assert _lease.lease_ms(0) == _lease.LEASE_MS == 2000
    assert _lease.lease_ms(100 * 10**6) == 4000
    assert _lease.lease_ms(10**12) == _lease.LEASE_MAX_MS == 60_000


def test_poll_delay_is_capped_at_any_number_of_polls():
    """The writer's backoff doubles to a cap: ``0.001 * 2**polls`` overflowed a float at poll 1024."""
    assert _lease.poll_delay(0, 40_000) == 0.001
    assert [_lease.poll_delay(n, 40_000) for n in (5, 1023, 1024, 10**6)] == [_lease._POLL_MAX] * 4
    assert _lease.poll_delay(10**6, 0) == 0.001  # never past the lease that refused it


def test_a_long_lease_makes_writers_wait_to_the_bound_then_stale_layout(server, monkeypatch):
    """A lease 40 s long (a reader of more than ~1 GB, or one that died): a layout change
    waits for it up to the writer bound, then raises StaleLayoutError, however many polls
    that took (here thousands, by a shortened bound and poll: before, OverflowError at poll
    1024, after ~21.6 s of real time)."""
    from tdstore.errors import StaleLayoutError

    monkeypatch.setattr(_lease, "WRITER_WAIT_MAX", 8.0)
    monkeypatch.setattr(_lease, "_POLL_MAX", 0.00005)
    polls = []
    real_delay = _lease.poll_delay
    monkeypatch.setattr(_lease, "poll_delay", lambda n, left: polls.append(n) or real_delay(n, left))
    store = TensorDictStore(batch_size=[4], **server.connection_kwargs())
    store["x"] = torch.zeros(4)
    client = server.sync_client()
    sec, usec = client.time()
    client.hset(f"{store._conn.keys.base}:rl", "dead-reader", str(int(sec) * 1000 + int(usec) // 1000 + 40_000))
    t0 = time.perf_counter()
    with pytest.raises(StaleLayoutError, match="lease"):
        store["new"] = torch.ones(4)
    took = time.perf_counter() - t0
    assert max(polls) >= 1024, max(polls)
    assert took < 40, took  # the bound, not the lease's 40 s
    assert "new" not in TensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs()).keys()
