"""``durability=``: WAIT (``"replicas:N"``) or WAITAOF (``"fsync"``) in the same packet as every
write, on real masters with a replica (``tdstore.server.start_replication``): a write returns
only once a replica has it; a shortfall raises ``DurabilityError`` after the write was applied
(never a half-done operation), at most one wait per operation; reads never wait; bad settings
and servers without the command are refused with clear errors. The failover test with
``"replicas:1"`` is tests/test_sentinel.py's."""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import torch
from tensordict import TensorDict

from tdstore import ClientConfigError, DurabilityError, TensorDictStore
from tdstore._backend import durability as _durability
from tdstore.server import start_replication, start_server

pytestmark = pytest.mark.timeout(300)

SCHEMA = {"obs": ([3], torch.float32), "done": ([], torch.bool), "n": ([], torch.int64)}
WAIT_S = 0.3


@pytest.fixture(scope="module", params=["redis", "valkey"])
def group(request: pytest.FixtureRequest) -> Iterator[Any]:
    with start_replication(request.param, replicas=1) as handle:
        yield handle


def _rows(n: int, start: int = 0) -> TensorDict:
    idx = torch.arange(start, start + n)
    return TensorDict(
        obs=idx[:, None].float().expand(n, 3).clone(), done=(idx % 4 == 3), n=idx, batch_size=[n]
    )


def _waits(client: redis.Redis) -> int:
    """WAIT and WAITAOF commands the master ran so far (INFO commandstats counts them once: outside MULTI)."""
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("wait", "waitaof"))


def _writes(store: TensorDictStore) -> list[tuple[str, Callable[[], object]]]:
    """One of each kind of write (each its own path to the server), in an order that works."""
    return [
        ("extend (the armed append)", lambda: store.extend(_rows(4, 100))),
        ("set a new entry", lambda: store.set("extra", torch.ones(16))),
        ("overwrite an entry", lambda: store.set("extra", torch.full((16,), 2.0))),
        ("indexed write", lambda: store.__setitem__(slice(0, 2), _rows(2, 50))),
        ("in-place entry write", lambda: store.set_("extra", torch.full((16,), 3.0))),
        ("update", lambda: store.update({"extra": torch.full((16,), 4.0)})),
        ("enable priorities", lambda: store.enable_priorities(alpha=0.7)),
        ("update priorities", lambda: store.update_priority([0, 1], [2.0, 3.0])),
        ("set a rate limit", lambda: store.set_rate_limit(min_size=1)),
        ("rename an entry", lambda: store.rename_key_("extra", "extra2")),
        ("delete an entry", lambda: store.del_("extra2")),
    ]


def _sample_flags_per_row(store: TensorDictStore) -> object:
    """A uniform sample as on a ring of more than 65,536 rows: the drawn rows' flags read by
    one BITFIELD of GETs, which reads (before, it was sent as a write: it waited)."""
    from tdstore.store import ring as _ring

    real = _ring._append_mod.FLAGS_READ_MAX
    _ring._append_mod.FLAGS_READ_MAX = 4
    try:
        return store.sample(8)
    finally:
        _ring._append_mod.FLAGS_READ_MAX = real


def test_a_bitfield_of_gets_reads_and_one_that_sets_writes():
    assert not _durability.writes([("BITFIELD", "k", "GET", "u8", "#3", "get", "u8", "#9")])
    assert _durability.writes([("BITFIELD", "k", "GET", "u8", "#3", "SET", "u8", "#9", 1)])
    assert _durability.writes([("BITFIELD", b"k", b"incrby", b"u8", b"#0", 1)])
    assert _durability.writes([("GET", "a"), ("BITFIELD", "k", "OVERFLOW", "SAT", "INCRBY", "u8", "#0", 1)])


def _reads(store: TensorDictStore) -> list[tuple[str, Callable[[], object]]]:
    return [
        ("read an entry", lambda: store["obs"]),
        ("read rows", lambda: store[2:6]),
        ("to_tensordict", lambda: store.to_tensordict()),
        ("keys", lambda: list(store.keys())),
        ("ring_state", lambda: store.ring_state()),
        ("uniform sample", lambda: store.sample(8)),
        ("uniform sample, the flags read per row (one BITFIELD GET)", lambda: _sample_flags_per_row(store)),
        ("prioritized sample", lambda: store.sample(8, prioritized=True, return_info=True)),
        ("slices", lambda: store.sample_slices(2, 2, end_key="done")),
    ]


def test_every_write_waits_for_the_replica_and_reads_do_not(group):
    """replicas:1: each write returns only once the replica has applied it (read there right
    after), with one WAIT in its packet; reads send none."""
    master = group.node_client(group.master_index())
    replica = group.node_client(1 - group.master_index())
    store = TensorDictStore.from_schema(SCHEMA, batch_size=[16], durability="replicas:1", **group.connection_kwargs())
    try:
        store.extend(_rows(8))
        for what, write in _writes(store):
            before = _waits(master)
            write()
            assert _waits(master) > before, f"{what}: no WAIT was sent"
            # acknowledged: the replica has it, right now (no polling)
            on_master = sorted(k for k in master.keys(f"*{store.td_id}*"))
            on_replica = sorted(k for k in replica.keys(f"*{store.td_id}*"))
            assert on_replica == on_master, what
            for key in on_master:
                if master.type(key) == b"string":
                    assert replica.get(key) == master.get(key), (what, key)
                elif master.type(key) == b"hash":
                    assert replica.hgetall(key) == master.hgetall(key), (what, key)
        for what, read in _reads(store):
            before = _waits(master)
            read()
            assert _waits(master) == before, f"{what} sent a WAIT (a read must not wait)"
    finally:
        store.clear_redis()
        store.close()
        master.close()
        replica.close()
    assert not [k for k in group.node_client(group.master_index()).keys(f"*{store.td_id}*")]


def test_a_shortfall_raises_after_the_whole_write_once_per_operation(group):
    """replicas:2 on a master with 1: every write raises DurabilityError naming the shortfall,
    with its data written (the master and the replica have it), after one wait; reads go on."""
    master = group.node_client(group.master_index())
    kwargs = group.connection_kwargs()
    plain = TensorDictStore.from_schema(SCHEMA, batch_size=[16], **kwargs)
    store = TensorDictStore.from_store(td_id=plain.td_id, durability="replicas:2", durability_timeout=WAIT_S, **kwargs)
    try:
        plain.extend(_rows(8))
        for what, write in _writes(store):
            before = _waits(master)
            started = time.monotonic()
            with pytest.raises(DurabilityError, match=r"only 1 of the 2 replicas it requires acknowledged it") as info:
                write()
            took = time.monotonic() - started
            # one wait per server step, and the step that fell short is the operation's last: at most
            # two (a first try the server turned down, e.g. a new-entry write to an existing entry)
            assert before + 1 <= _waits(master) <= before + 2, f"{what}: {_waits(master) - before} waits"
            assert took < 2 * WAIT_S + 2.0, (what, took)
            message = str(info.value)
            assert "applied on the master" in message and "not yet safe" in message and store.td_id in message
            assert info.value.spec == "replicas:2"
        # every write was applied whole: the plain handle sees each one's effect
        assert plain.ring_state().total == 12
        assert plain["n"][8:12].tolist() == [100, 101, 102, 103]
        assert plain["n"][:2].tolist() == [50, 51]
        assert "extra" not in plain.keys() and "extra2" not in plain.keys()
        assert plain.priority_settings() is not None and plain.priority_settings().alpha == pytest.approx(0.7)
        for _what, read in _reads(store):
            read()  # no DurabilityError: reads do not wait
        # the rate limiter's sample counters are not data: a limited sample does not wait either
        before = _waits(master)
        store.sample(4)
        assert _waits(master) == before
        # and the error pickles with its fields (a worker process may raise it to its parent)
        with pytest.raises(DurabilityError) as info:
            store.extend(_rows(1))
        again = pickle.loads(pickle.dumps(info.value))
        assert str(again) == str(info.value) and again.detail == info.value.detail
        # clear_redis waits too, and still removes everything
        with pytest.raises(DurabilityError):
            store.clear_redis()
        assert not master.keys(f"*{plain.td_id}*")
    finally:
        plain.close()
        store.close()
        master.close()


def test_a_constructor_that_falls_short_hands_over_the_store_it_created(group):
    """replicas:2 on a master with 1: each constructor raises DurabilityError after creating the
    store on the master, and the error holds the open handle of that store (``.store``), which
    reads and can clear it; other writes' errors hold None, and so does a pickled error."""
    master = group.node_client(group.master_index())
    kwargs = {**group.connection_kwargs(), "durability": "replicas:2", "durability_timeout": WAIT_S}
    td = _rows(6)
    makers = {
        "TensorDictStore(...)": lambda: TensorDictStore(batch_size=[6], **kwargs),
        "from_schema": lambda: TensorDictStore.from_schema(SCHEMA, batch_size=[6], **kwargs),
        "from_tensordict": lambda: TensorDictStore.from_tensordict(td, **kwargs),
        "from_dict": lambda: TensorDictStore.from_dict(td.to_dict(), batch_size=[6], **kwargs),
    }
    try:
        for what, make in makers.items():
            with pytest.raises(DurabilityError, match="only 1 of the 2 replicas") as info:
                make()
            store = info.value.store
            assert isinstance(store, TensorDictStore), what
            assert master.keys(f"*{store.td_id}*"), f"{what}: the store is on the master"
            assert store.batch_size == torch.Size([6])  # (an open handle: it reads)
            if what == "from_tensordict":
                assert (store.to_tensordict() == td).all()
            assert pickle.loads(pickle.dumps(info.value)).store is None
            with pytest.raises(DurabilityError) as cleared:
                store.clear_redis()  # (the clear waits too, and still removes everything)
            assert cleared.value.store is None
            assert not master.keys(f"*{store.td_id}*"), what
            store.close()
    finally:
        master.close()


def test_durability_survives_pickling_from_store_and_the_sharded_ring(group):
    kwargs = group.connection_kwargs()
    plain = TensorDictStore.from_schema(SCHEMA, batch_size=[8], **kwargs)
    store = TensorDictStore.from_store(td_id=plain.td_id, durability="replicas:2", durability_timeout=WAIT_S, **kwargs)
    try:
        copy = pickle.loads(pickle.dumps(store))
        with pytest.raises(DurabilityError):
            copy.extend(_rows(2))
        assert copy.ring_state().total == 2
        copy.close()
        ok = TensorDictStore.from_store(td_id=store.td_id, durability="replicas:1", **kwargs)
        ok.extend(_rows(2))  # (1 replica: enough)
        ok.close()
    finally:
        plain.clear_redis()  # (the plain handle cleans up without waiting)
        plain.close()
        store.close()
    from tdstore import ShardedStore

    plain_ring = ShardedStore.from_schema(SCHEMA, batch_size=[8], block_rows=4, **kwargs)
    sharded = ShardedStore.from_store(td_id=plain_ring.td_id, durability="replicas:2", durability_timeout=WAIT_S, **kwargs)
    try:
        with pytest.raises(DurabilityError):
            sharded.extend(_rows(2))
        assert plain_ring.ring_state().valid == 2
    finally:
        plain_ring.clear_redis()
        plain_ring.close()
        sharded.close()


def test_threads_sharing_a_handle_each_get_their_own_outcome(group):
    """Two threads on one replicas:1 handle: all writes acknowledged; one replicas:2 handle's
    shortfall never shows in another handle's operation."""
    kwargs = group.connection_kwargs()
    good = TensorDictStore.from_schema({"n": ([], torch.int64)}, batch_size=[400], durability="replicas:1", **kwargs)
    short = TensorDictStore.from_store(td_id=good.td_id, durability="replicas:2", durability_timeout=0.05, **kwargs)
    errors: list[BaseException] = []
    shortfalls = [0]

    def writer(handle: TensorDictStore, count: int) -> None:
        for i in range(count):
            try:
                handle.extend(TensorDict(n=torch.tensor([i]), batch_size=[1]))
            except DurabilityError:
                if handle is good:
                    errors.append(AssertionError("a shortfall on the replicas:1 handle"))
                shortfalls[0] += 1
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)

    threads = [threading.Thread(target=writer, args=(good, 60)) for _ in range(2)]
    threads.append(threading.Thread(target=writer, args=(short, 10)))
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[:3]
        assert shortfalls[0] == 10
        assert good.ring_state().total == 130
    finally:
        good.clear_redis()
        good.close()
        short.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"durability": "replicas:0"}, "0 replicas is the default"),
        ({"durability": "replicas:x"}, 'takes "replicas:N"'),
        ({"durability": "replicas"}, 'takes "replicas:N"'),
        ({"durability": 1}, 'takes "replicas:N"'),
        ({"durability": "fsync:2"}, 'takes "replicas:N"'),
        ({"durability": "replicas:1", "durability_timeout": 0}, "durability_timeout= is the seconds"),
        ({"durability": "replicas:1", "durability_timeout": True}, "durability_timeout= is the seconds"),
        ({"durability": "replicas:1", "durability_timeout": 60.0, "timeout": 10.0}, "below the store's timeout="),
        ({"durability_timeout": 1.0}, "without durability="),
    ],
)
def test_bad_settings_are_refused_before_anything_is_sent(kwargs, match, redis_server):
    before = redis_server.sync_client().dbsize()
    with pytest.raises(ClientConfigError, match=match):
        TensorDictStore(batch_size=[2], **redis_server.connection_kwargs(), **kwargs)
    assert redis_server.sync_client().dbsize() == before


def test_servers_without_the_wait_are_refused_at_first_contact(redis_server, fake_server):
    """fakeredis has no WAIT; Redis 7.0 (the OS package here) has no WAITAOF: a clear error, nothing written."""
    for handle, durability, match in (
        (fake_server, "replicas:1", "refused WAIT"),
        (redis_server, "fsync", "refused WAITAOF"),
    ):
        if durability == "fsync":
            version = handle.sync_client().info("server").get("redis_version", "0")
            if tuple(int(p) for p in str(version).split(".")[:2]) >= (7, 2):
                continue  # (a newer OS package has it: the appendonly case below covers the refusal)
        before = handle.sync_client().dbsize()
        with pytest.raises(ClientConfigError, match=match) as info:
            TensorDictStore.from_schema(SCHEMA, batch_size=[4], durability=durability, **handle.connection_kwargs())
        assert "Nothing was written" in str(info.value)
        assert handle.sync_client().dbsize() == before


def test_fsync_waits_for_the_append_only_file():
    """Valkey 8 with appendonly: each write's packet ends with WAITAOF 1 0; without appendonly, refused."""
    with start_server("valkey", config={"appendonly": "yes", "appendfsync": "everysec"}) as server:
        client = server.sync_client()
        store = TensorDictStore.from_schema(SCHEMA, batch_size=[16], durability="fsync", **server.connection_kwargs())
        try:
            before = _waits(client)
            started = time.monotonic()
            for i in range(20):
                store.extend(_rows(2, i))
            took = time.monotonic() - started
            assert _waits(client) >= before + 20
            assert store.ring_state().total == 40
            assert took < 20.0  # (WAITAOF makes the server fsync at once: no wait for the once-a-second fsync)
            stats = client.info("persistence")
            assert int(stats["aof_enabled"]) == 1
        finally:
            store.clear_redis()
            store.close()
            client.close()
    with start_server("valkey") as server:  # appendonly no
        with pytest.raises(ClientConfigError, match="appendonly"):
            TensorDictStore.from_schema(SCHEMA, batch_size=[4], durability="fsync", **server.connection_kwargs())
        assert server.sync_client().dbsize() == 0


def test_a_two_step_append_waits_once(group):
    """An append in two steps (its rows reserved by the reserve script, then written: here every
    append, the one-packet way cooled down) sends one WAIT, after its write step, and returns
    only once the replica has the rows and the cursor the reserve moved."""
    master = group.node_client(group.master_index())
    replica = group.node_client(1 - group.master_index())
    store = TensorDictStore.from_schema(SCHEMA, batch_size=[64], durability="replicas:1", **group.connection_kwargs())
    try:
        store.extend(_rows(2))
        store._conn.append_slot.cool = 10**6  # (no armed append: each goes in two steps)
        store._conn.direct_slot.cool = 10**6
        for i in range(5):
            before = _waits(master)
            store.extend(_rows(3, 10 * i))
            assert _waits(master) - before == 1, i
            cursor = store._conn.keys.ring
            assert replica.get(cursor) == master.get(cursor) == str(2 + 3 * (i + 1)).encode()
        assert store["n"][2:17].tolist() == [10 * i + k for i in range(5) for k in range(3)]
    finally:
        store.clear_redis()
        store.close()
        master.close()
        replica.close()
