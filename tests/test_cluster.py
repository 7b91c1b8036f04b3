"""TensorDictStore and ShardedStore on a real local Redis Cluster (3 masters, redis-server 7).

Three parts:

* the conformance suite on the cluster: ``TestCluster``, the setting of
  :class:`tdstore.testing.TensorDictStoreTests` whose ``server`` is the cluster
  (``cluster_server`` in conftest: started once per session, flushed on every master after
  each test); the race tests marked ``ALSO_ON_CLUSTER`` in ``test_races`` run on it too;
* what is particular to a cluster: stores spread over the masters, each store on one
  master; a RedisCluster client or ``cluster_nodes=`` accepted, bad settings refused;
  resharding (MOVED, ASK/TRYAGAIN during a slot migration); scripts reloaded per node;
  listing stores scans every master;
* :class:`tdstore.ShardedStore`: blocks on several masters, differential against an
  in-memory TensorDict, reconnect, bad input refused with nothing written, atomicity per
  block under concurrent writers.
"""

from __future__ import annotations

import random
import threading
import time
import uuid

import pytest
import torch
from tensordict import TensorDict

from tdstore import ClientConfigError, ShardedStore, StoreExistsError, StoreNotFoundError, TensorDictStore
from tdstore._backend import lifecycle as _lifecycle
from tdstore._backend import loop as _io
from tdstore.testing import TensorDictStoreTests
from tdstore.testing.counts import record as _record

ON_CLUSTER = pytest.mark.parametrize("server", ["cluster"], indirect=True)

# ---------------------------------------------------------------------------------------------
# The conformance suite, on the cluster
# ---------------------------------------------------------------------------------------------


class TestCluster(TensorDictStoreTests):
    """The conformance suite with ``server`` the cluster (fewer random stores than one server)."""

    server_kind = "cluster"
    index_configs = 8
    differential_seeds = 6
    nontensor_seeds = 2
    # they take host/port/db/unix_socket_path of one server (a cluster has one db and no socket)
    test_redis_kwargs_pass_through = None
    test_db_argument = None
    test_unix_socket = None
    # they lower proto-max-bulk-len with CONFIG SET on one node: tests/test_limits.py covers it
    test_oversize_value_is_refused_before_sending = None
    test_failed_from_tensordict_leaves_nothing = None


# ---------------------------------------------------------------------------------------------
# What is particular to a cluster
# ---------------------------------------------------------------------------------------------


def _node_keys(cluster):
    """``[set of keys]`` per master, read from each node directly."""
    out = []
    for index in range(cluster.masters):
        client = cluster.node_client(index)
        try:
            out.append(set(client.keys("*")))
        finally:
            client.close()
    return out


def test_stores_spread_over_masters_each_in_one_slot(cluster_server):
    conn = cluster_server.connection_kwargs()
    stores = []
    for i in range(12):
        store = TensorDictStore(batch_size=[4], **conn)
        store["x"] = torch.full((4, 3), float(i))
        store["nested", "y"] = torch.arange(4) + i
        store[1:3] = {"x": torch.zeros(2, 3)}
        stores.append(store)
    per_node = _node_keys(cluster_server)
    used = set()
    for i, store in enumerate(stores):
        keys = {k for k in set().union(*per_node) if b"{" + store.td_id.encode() + b"}" in k}
        holders = [n for n, node_keys in enumerate(per_node) if keys & node_keys]
        assert len(keys) >= 4 and holders == [cluster_server.node_of_key(store._conn.keys.meta)], (keys, holders)
        used.update(holders)
        assert torch.equal(store["x"][:, 0], torch.tensor([i, 0, 0, i], dtype=torch.float32))
        assert torch.equal(store["nested", "y"], torch.arange(4) + i)
    assert len(used) >= 2, "12 random td_ids all hashed to one master"
    for store in stores:
        store.clear_redis()
        store.close()
    assert cluster_server.sync_client().dbsize() == 0


def test_redis_cluster_client_is_accepted(cluster_server):
    client = cluster_server.async_client()
    store = TensorDictStore(client=client, batch_size=[3])
    store["a"] = torch.arange(3)
    again = TensorDictStore.from_store(td_id=store.td_id, **cluster_server.connection_kwargs())
    assert torch.equal(again["a"], torch.arange(3))
    assert "Redis Cluster node" in repr(store._conn.describe())
    for s in (again, store):
        s.clear_redis()
        s.close()


def test_bad_cluster_settings_are_refused(cluster_server, redis_server, wire):
    before = wire(cluster_server)
    decoding = cluster_server.async_client(decode_responses=True)
    with pytest.raises(ClientConfigError, match="decode_responses=True"):
        TensorDictStore(client=decoding, batch_size=[2])
    with pytest.raises(ClientConfigError, match=r"TensorDictStore\(td_id='t1'\) is on a Redis Cluster, .* db=1"):
        TensorDictStore(db=1, td_id="t1", batch_size=[2], **cluster_server.connection_kwargs())
    with pytest.raises(ClientConfigError, match=r"cluster_nodes of TensorDictStore\(td_id='t2'\) must be a list of"):
        TensorDictStore(cluster_nodes=[("127.0.0.1",)], td_id="t2", batch_size=[2])
    with pytest.raises(ClientConfigError, match="cluster_nodes of .* is empty"):
        TensorDictStore(cluster_nodes=[], batch_size=[2])
    single = [(redis_server.host, redis_server.port)]
    with pytest.raises(ClientConfigError, match="is not a Redis Cluster node"):
        TensorDictStore(cluster_nodes=single, batch_size=[2])
    assert wire(cluster_server) == before


def test_unreachable_startup_node_is_skipped(cluster_server):
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead = sock.getsockname()[1]
    nodes = [("127.0.0.1", dead), *(f"{host}:{port}" for host, port in cluster_server.startup_nodes[1:])]
    store = TensorDictStore(cluster_nodes=nodes, batch_size=[2])
    store["a"] = torch.ones(2)
    assert torch.equal(store["a"], torch.ones(2))
    store.clear_redis()
    store.close()


def test_lazy_stacked_store_on_the_cluster(cluster_server):
    """A lazy stack is one store too (one td_id, one slot): its ragged elements work on a cluster."""
    from tensordict import LazyStackedTensorDict

    from tdstore import LazyStackedTensorDictStore

    local = LazyStackedTensorDict(*[TensorDict({"x": torch.arange(i + 1)}, []) for i in range(4)])
    lazy = LazyStackedTensorDictStore.from_lazy_stack(local, **cluster_server.connection_kwargs())
    lazy[1] = TensorDict({"x": torch.tensor([9, 9])}, [])
    assert torch.equal(lazy[1]["x"], torch.tensor([9, 9])) and torch.equal(lazy[3]["x"], torch.arange(4))
    assert torch.equal(lazy.to_tensordict()[2]["x"], torch.arange(3))
    lazy.clear_redis()
    lazy.close()
    assert cluster_server.sync_client().dbsize() == 0


def _node_ids(cluster):
    ids = []
    for index in range(cluster.masters):
        client = cluster.node_client(index)
        try:
            ids.append(client.execute_command("CLUSTER MYID").decode())
        finally:
            client.close()
    return ids


class _Migration:
    """Moves one slot between masters the way ``redis-cli --cluster reshard`` does."""

    def __init__(self, cluster, key: str, dst: int | None = None) -> None:
        from redis.crc import key_slot

        self.cluster = cluster
        self.slot = key_slot(key.encode())
        self.src = cluster.node_of_key(key)
        self.dst = (self.src + 1) % cluster.masters if dst is None else dst
        self.ids = _node_ids(cluster)
        self.clients = [cluster.node_client(i) for i in range(cluster.masters)]

    def start(self) -> None:
        src, dst = self.clients[self.src], self.clients[self.dst]
        dst.execute_command("CLUSTER SETSLOT", self.slot, "IMPORTING", self.ids[self.src])
        src.execute_command("CLUSTER SETSLOT", self.slot, "MIGRATING", self.ids[self.dst])

    def move_keys(self, limit: int | None = None) -> int:
        src, node = self.clients[self.src], self.cluster.nodes[self.dst]
        keys = src.execute_command("CLUSTER GETKEYSINSLOT", self.slot, 1000 if limit is None else limit)
        if keys:
            src.execute_command("MIGRATE", node.host, node.port, "", 0, 5000, "KEYS", *keys)
        return len(keys)

    def finish(self) -> None:
        while self.move_keys():
            pass
        for client in self.clients:
            client.execute_command("CLUSTER SETSLOT", self.slot, "NODE", self.ids[self.dst])

    def close(self) -> None:
        for client in self.clients:
            client.close()


def test_store_follows_its_slot_when_it_moves(cluster_server):
    """Resharding: the old master answers MOVED before running anything; the store switches."""
    store = TensorDictStore.from_schema({"x": ([2], torch.float32)}, batch_size=[6], **cluster_server.connection_kwargs())
    store["x"] = torch.arange(12.0).reshape(6, 2)
    before = cluster_server.node_of_key(store._conn.keys.meta)
    old_node = store._conn._client_node
    for hop in range(2):  # there and back again
        move = _Migration(cluster_server, store._conn.keys.meta)
        try:
            move.start()
            move.finish()
        finally:
            move.close()
        assert cluster_server.node_of_key(store._conn.keys.meta) == move.dst
        store[hop] = {"x": torch.full((2,), -1.0 - hop)}  # refused with MOVED, re-run on the new master
        assert store._conn._client_node == (cluster_server.nodes[move.dst].host, cluster_server.nodes[move.dst].port)
        expected = torch.arange(12.0).reshape(6, 2)
        expected[: hop + 1] = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])[: hop + 1]
        assert torch.equal(store["x"], expected)
        assert torch.equal(store[[0, 5]]["x"], expected[[0, 5]])
    assert cluster_server.node_of_key(store._conn.keys.meta) != before or old_node != store._conn._client_node
    store.clear_redis()
    store.close()


def test_operations_wait_out_a_slot_migration(cluster_server, request):
    """During a migration (ASK / TRYAGAIN) each operation waits, then runs exactly once."""
    store = TensorDictStore(batch_size=[8], **cluster_server.connection_kwargs())
    for name in ("a", "b", "c", "d"):
        store[name] = torch.zeros(8)
    move = _Migration(cluster_server, store._conn.keys.meta)
    done: list[float] = []
    try:
        move.start()
        move.move_keys(limit=2)  # half the store's keys moved: multi-key steps get TRYAGAIN / ASK

        def write() -> None:
            store[2:5] = {"a": torch.ones(3), "d": torch.ones(3)}  # touches moved and unmoved keys
            done.append(time.monotonic())

        worker = threading.Thread(target=write)
        worker.start()
        time.sleep(0.3)
        finished_early = bool(done)
        move.finish()
        finished_at = time.monotonic()
        worker.join(30)
    finally:
        move.close()
    assert not worker.is_alive() and done
    _record(request, waited_for_migration=not finished_early)
    assert not finished_early and done[0] >= finished_at - 0.05
    expected = torch.zeros(8)
    expected[2:5] = 1
    assert torch.equal(store["a"], expected) and torch.equal(store["d"], expected)
    assert torch.equal(store["b"], torch.zeros(8))
    store.clear_redis()
    store.close()


def test_appends_and_reads_on_a_cluster_take_the_direct_one_packet_path(cluster_server, request):
    """On a cluster, appends go armed in one packet on a blocking client to the slot's master,
    as on one server: no reserve script once armed (the async two-step path cost the master
    3.4x the server CPU per append, benchmarks/bench_sharded.py). After the slot moves, the
    direct client follows it to the new master."""
    store = TensorDictStore.from_schema({"x": ([4], torch.int64)}, batch_size=[64], **cluster_server.connection_kwargs())
    rows = TensorDict({"x": torch.arange(32).reshape(8, 4)}, [8])
    for _ in range(3):
        store.extend(rows)
    node = cluster_server.node_of_store(store.td_id)
    with cluster_server.node_client(node) as client:
        client.config_resetstat()
        for _ in range(10):
            store.extend(rows)
        stats = client.info("commandstats")
    assert store._conn._direct_node == store._conn._client_node
    assert "cmdstat_evalsha" not in stats, stats  # the reserve script: only on the two-step path
    assert stats["cmdstat_exec"]["calls"] == 10, stats
    _record(request, execs=stats["cmdstat_exec"]["calls"])
    assert store.ring_state().total == 13 * 8
    assert torch.equal(store["x"][:8], rows["x"])
    move = _Migration(cluster_server, store._conn.keys.meta)
    try:
        move.start()
        move.finish()
    finally:
        move.close()
    store.extend(rows)  # the old master answers MOVED: nothing ran; the store follows the slot
    assert store._conn._client_node == (cluster_server.nodes[move.dst].host, cluster_server.nodes[move.dst].port)
    store.extend(rows)
    assert store._conn._direct_node == store._conn._client_node  # a new direct client, to the new master
    assert store.ring_state().total == 15 * 8
    assert torch.equal(store["x"][14 * 8 % 64 : 14 * 8 % 64 + 8], rows["x"])
    store.clear_redis()
    store.close()


def test_scripts_are_reloaded_on_each_master(cluster_server):
    stores = [TensorDictStore(batch_size=[64], **cluster_server.connection_kwargs()) for _ in range(6)]
    for store in stores:
        store["v"] = torch.zeros(64, dtype=torch.int32)
    for index in range(cluster_server.masters):
        client = cluster_server.node_client(index)
        try:
            client.script_flush()
        finally:
            client.close()
    rows = list(range(0, 64, 3))  # many small runs: the write_runs script (EVALSHA, NOSCRIPT -> load)
    for i, store in enumerate(stores):
        store[rows] = {"v": torch.full((len(rows),), i, dtype=torch.int32)}
        assert torch.equal(store[rows]["v"], torch.full((len(rows),), i, dtype=torch.int32))
        store.clear_redis()
        store.close()


@pytest.mark.parametrize("listing", ["slot", "scan", "refused"])
def test_clear_redis_lists_the_store_slot_not_the_node(cluster_server, monkeypatch, listing):
    """On a cluster, clear_redis() finds the store's keys with CLUSTER GETKEYSINSLOT in its
    one slot: its cost follows the slot, not every key of the node. A slot fuller than
    SLOT_LIST_MAX, or a user whose ACL refuses those CLUSTER commands, gets the SCAN.
    Either way every key of the store goes, debris included (a data key without a
    registry entry; a store in the same slot under a longer name and the other keys of the
    node stay)."""
    conn = cluster_server.connection_kwargs()
    if listing == "refused":
        for index in range(cluster_server.masters):
            admin = cluster_server.node_client(index)
            admin.acl_setuser("noslots", enabled=True, nopass=True, keys=["*"],
                              commands=["+@all", "-cluster|countkeysinslot", "-cluster|getkeysinslot"])
            admin.close()
        conn = {**conn, "username": "noslots", "password": "any"}
    store = TensorDictStore(batch_size=[4], td_id="wipe-me", **conn)
    store["x"] = torch.ones(4)
    store.extend(TensorDict(x=torch.ones(2), batch_size=[2]))  # the ring's keys too
    neighbour = TensorDictStore(batch_size=[4], td_id="wipe-me", prefix=f"{store.prefix}x", **conn)
    neighbour["y"] = torch.ones(4)
    node = cluster_server.node_of_key(store._conn.keys.meta)
    client = cluster_server.node_client(node)
    kept = [k for k in (f"other:{{k{i}}}" for i in range(300)) if cluster_server.node_of_key(k) == node]
    try:
        client.set(store._conn.keys.data(("gone",)), b"no registry entry")
        for key in kept:
            client.set(key, b"1")
        assert kept
        if listing == "scan":
            monkeypatch.setattr(_lifecycle, "SLOT_LIST_MAX", 0)
        client.config_resetstat()
        store.clear_redis()
        stats = client.info("commandstats")
        assert list(client.scan_iter(match=store._conn.keys.pattern())) == []
        assert all(client.exists(k) for k in kept)
        assert torch.equal(neighbour["y"], torch.ones(4))
        scans = stats.get("cmdstat_scan", {}).get("calls", 0)
        listed = stats.get("cmdstat_cluster|getkeysinslot", stats.get("cmdstat_cluster", {})).get("calls", 0)
        if listing == "slot":
            assert scans == 0 and listed >= 1
        else:
            assert scans >= 1
    finally:
        for key in kept:
            client.delete(key)
        client.close()
        neighbour.clear_redis()
        neighbour.close()
        store.close()
        if listing == "refused":
            for index in range(cluster_server.masters):
                admin = cluster_server.node_client(index)
                admin.acl_deluser("noslots")
                admin.close()


def test_list_stores_scans_every_master(cluster_server):
    conn = cluster_server.connection_kwargs()
    stores = [TensorDictStore(batch_size=[1], prefix="listing", **conn) for _ in range(9)]
    masters = {cluster_server.node_of_key(s._conn.keys.meta) for s in stores}

    async def listing():
        client = cluster_server.async_client()
        try:
            return await _lifecycle.list_stores(client, "listing", count=2)
        finally:
            await client.aclose()

    assert _io.sync(listing(), 30) == sorted(s.td_id for s in stores)
    assert len(masters) >= 2
    for store in stores:
        store.clear_redis()
        store.close()


def _wait_for(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - start


def test_store_survives_failovers(request):
    """A manual failover (MOVED from the demoted master) and a crash (the replica is promoted)."""
    from tdstore.server import start_cluster

    with start_cluster(masters=3, replicas=1, node_timeout_ms=1000) as cluster:
        store = TensorDictStore.from_schema({"x": ([2], torch.int64)}, batch_size=[4], **cluster.connection_kwargs())
        store["x"] = torch.arange(8).reshape(4, 2)
        master = cluster.node_of_store(store.td_id)
        replica = cluster.masters + master  # replica j follows master j % masters
        address = lambda i: (cluster.nodes[i].host, cluster.nodes[i].port)  # noqa: E731
        assert store._conn._client_node == address(master)

        # 1. manual failover: the replica takes over; the old master, now a replica, answers MOVED
        with cluster.node_client(master) as client:
            client.execute_command("WAIT", 1, 5000)
        with cluster.node_client(replica) as client:
            client.execute_command("CLUSTER FAILOVER")
        manual = _wait_for(lambda: cluster.node_of_store(store.td_id) == replica, 20, "the manual failover")
        store[0] = {"x": torch.tensor([10, 11])}
        assert store._conn._client_node == address(replica)

        # 2. crash: the new master is killed; its replica (the first master) is promoted
        with cluster.node_client(replica) as client:
            client.execute_command("WAIT", 1, 5000)
        import os
        import signal

        os.kill(cluster.nodes[replica].pid, signal.SIGKILL)
        started = time.monotonic()
        store[1] = {"x": torch.tensor([20, 21])}  # refused connections: retried, the route re-read
        recovered = time.monotonic() - started
        assert store._conn._client_node == address(master)
        expected = torch.arange(8).reshape(4, 2)
        expected[0], expected[1] = torch.tensor([10, 11]), torch.tensor([20, 21])
        assert torch.equal(store["x"], expected)
        _record(request, manual_failover_s=f"{manual:.2f}", crash_recovered_after_s=f"{recovered:.2f}")
        store.clear_redis()
        store.close()


# ---------------------------------------------------------------------------------------------
# ShardedStore
# ---------------------------------------------------------------------------------------------

_SCHEMA = {"obs": ([3], torch.float32), "act": ([], torch.int64), ("next", "done"): ([], torch.bool)}


def _random_rows(rng: random.Random, n: int):
    kind = rng.choice(["int", "neg", "slice", "step", "list", "tensor", "mask", "empty"])
    if kind == "int":
        return rng.randrange(n)
    if kind == "neg":
        return -rng.randint(1, n)
    if kind == "slice":
        a = rng.randrange(n)
        return slice(a, rng.randint(a, n))
    if kind == "step":
        return slice(rng.randrange(n), None, rng.randint(2, 5))
    if kind == "list":
        return rng.sample(range(n), rng.randint(1, min(n, 9)))
    if kind == "tensor":
        return torch.tensor(rng.sample(range(n), rng.randint(1, min(n, 9))))
    if kind == "mask":
        return torch.tensor([rng.random() < 0.3 for _ in range(n)])
    return []


def _as_index(idx):
    """The same rows as an index of an in-memory TensorDict (a list becomes an int64 tensor)."""
    return torch.tensor(idx, dtype=torch.int64) if isinstance(idx, list) else idx


def _rows_value(rng: random.Random, count: int | None, gen: torch.Generator) -> TensorDict:
    batch = [] if count is None else [count]
    return TensorDict(
        {
            "obs": torch.randn(*batch, 3, generator=gen),
            "act": torch.randint(-50, 50, batch, generator=gen),
            "next": {"done": torch.randint(0, 2, batch, generator=gen).bool()},
        },
        batch,
    )


def _check_equal(buf: ShardedStore, local: TensorDict) -> None:
    remote = buf.to_tensordict()
    for key in local.keys(True, True):
        assert torch.equal(remote[key], local[key]), key
        assert torch.equal(buf[key], local[key]), key


@pytest.mark.parametrize("seed", range(4))
def test_sharded_store_matches_tensordict(cluster_server, seed, request):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n, block_rows = rng.randint(9, 40), rng.randint(2, 7)
    buf = ShardedStore.from_schema(_SCHEMA, batch_size=[n], block_rows=block_rows, **cluster_server.connection_kwargs())
    local = TensorDict({k: torch.zeros(n, *shape, dtype=dtype) for k, (shape, dtype) in _SCHEMA.items()}, [n])
    assert buf.num_blocks == -(-n // block_rows) and len(buf) == n
    masters = {cluster_server.node_of_key(block._conn.keys.meta) for block in buf.blocks}
    assert len(masters) >= 2 or buf.num_blocks < 4, masters
    ops = 0
    for _ in range(25):
        idx = _random_rows(rng, n)
        selected = torch.arange(n)[_as_index(idx)]
        count = None if isinstance(idx, int) else int(selected.numel())
        if rng.random() < 0.5:
            value = _rows_value(rng, count, gen)
            buf[idx] = value
            local[_as_index(idx)] = value
        else:
            got = buf[idx]
            want = local[_as_index(idx)]
            assert got.batch_size == want.batch_size
            for key in want.keys(True, True):
                assert torch.equal(got[key], want[key]), (idx, key)
        ops += 1
    buf["act"] = torch.arange(n) * 7  # a whole entry: one write per block
    local["act"] = torch.arange(n) * 7
    _check_equal(buf, local)
    again = ShardedStore.from_store(td_id=buf.td_id, **cluster_server.connection_kwargs())
    assert again.batch_size == buf.batch_size and again.block_rows == block_rows
    _check_equal(again, local)
    _record(request, ops=ops, rows=n, blocks=buf.num_blocks, masters=len(masters))
    again.close()
    buf.clear_redis()
    buf.close()
    assert cluster_server.sync_client().dbsize() == 0


def test_sharded_store_from_tensordict_and_reconnect(cluster_server):
    conn = cluster_server.connection_kwargs()
    local = TensorDict({"x": torch.arange(50.0).reshape(25, 2), "n": {"y": torch.arange(25)}}, [25])
    buf = ShardedStore.from_tensordict(local, block_rows=4, td_id="big-buffer", **conn)
    assert buf.td_id == "big-buffer" and buf.num_blocks == 7
    assert [b.td_id for b in buf.blocks] == [f"big-buffer.b{i}" for i in range(7)]
    assert len({cluster_server.node_of_key(b._conn.keys.meta) for b in buf.blocks}) >= 2
    again = ShardedStore.from_store(td_id="big-buffer", **conn)
    assert (again.to_tensordict() == local).all()
    assert torch.equal(again[[24, 0, 13]]["n", "y"], torch.tensor([24, 0, 13]))
    with pytest.raises(StoreExistsError):
        ShardedStore.from_tensordict(local, block_rows=4, td_id="big-buffer", **conn)
    assert (ShardedStore.from_store(td_id="big-buffer", **conn).to_tensordict() == local).all()
    with pytest.raises(StoreNotFoundError):
        ShardedStore.from_store(td_id="no-such-buffer", **conn)
    again.close()
    buf.clear_redis()
    buf.close()
    assert cluster_server.sync_client().dbsize() == 0


def test_sharded_store_bad_input_writes_nothing(cluster_server, wire):
    buf = ShardedStore.from_schema(_SCHEMA, batch_size=[10], block_rows=3, **cluster_server.connection_kwargs())
    buf[0:10] = _rows_value(random.Random(0), 10, torch.Generator().manual_seed(0))
    before = wire(cluster_server)
    where = f"ShardedStore\\(td_id='{buf.td_id}', 10 rows\\)"
    cases = [
        (lambda: buf.__setitem__(slice(0, 5), _rows_value(random.Random(1), 4, torch.Generator())), ValueError, "batch size \\[5\\]"),
        (lambda: buf.__setitem__(10, _rows_value(random.Random(1), None, torch.Generator())), IndexError, "row 10 is out of range"),
        (lambda: buf.__setitem__([1, -11], _rows_value(random.Random(1), 2, torch.Generator())), IndexError, "row -11"),
        (lambda: buf.__setitem__(torch.tensor([0.5]), {}), TypeError, "integer tensor"),
        (lambda: buf.__setitem__(torch.ones(3, dtype=torch.bool), {}), IndexError, "shape \\[10\\]"),
        (lambda: buf.__setitem__(slice(0, 2), torch.zeros(2)), TypeError, "TensorDict or a dict"),
        (lambda: buf.__setitem__("act", torch.zeros(9)), ValueError, "must have 10 rows"),
        (lambda: buf.__setitem__(slice(2, 5), {"obs": torch.zeros(3, 4)}), RuntimeError, "obs"),
        (lambda: buf.__getitem__(2.0), TypeError, "takes an entry key"),
    ]
    for call, exc, text in cases:
        with pytest.raises(exc, match=text):
            call()
        assert wire(cluster_server) == before, text
    with pytest.raises(ValueError, match=where):
        buf[0:5] = _rows_value(random.Random(1), 4, torch.Generator())
    with pytest.raises(ValueError, match="block_rows must be a positive int"):
        ShardedStore.from_schema(_SCHEMA, batch_size=[10], block_rows=0, **cluster_server.connection_kwargs())
    assert wire(cluster_server) == before
    buf.clear_redis()
    buf.close()


def test_sharded_store_is_atomic_per_block(cluster_server, request):
    """Writers fill the whole buffer with one value per write; a block never shows two values."""
    conn = cluster_server.connection_kwargs()
    buf = ShardedStore.from_schema({"v": ([16], torch.int64)}, batch_size=[12], block_rows=4, **conn)
    stop = time.monotonic() + 1.0
    writes = [0]

    def writer(tag: int) -> None:
        mine = ShardedStore.from_store(td_id=buf.td_id, **conn)
        for i in range(2000):
            if time.monotonic() > stop:
                break
            value = tag * 100_000 + i
            mine[0:12] = {"v": torch.full((12, 16), value)}
            writes[0] += 1
        mine.close()

    threads = [threading.Thread(target=writer, args=(t,)) for t in (1, 2)]
    for t in threads:
        t.start()
    reads = torn_blocks = mixed_reads = 0
    while time.monotonic() < stop and reads < 5000:
        rows = buf[0:12]["v"]
        reads += 1
        per_block = [torch.unique(rows[i : i + 4]) for i in range(0, 12, 4)]
        torn_blocks += sum(int(u.numel() != 1) for u in per_block)
        mixed_reads += int(len({int(u[0]) for u in per_block}) > 1)
    for t in threads:
        t.join(30)
    _record(request, reads=reads, writes=writes[0], torn_blocks=torn_blocks, cross_block_mixed_reads=mixed_reads)
    assert torn_blocks == 0 and reads > 0 and writes[0] > 0
    buf.clear_redis()
    buf.close()


@pytest.mark.parametrize("server", ["redis", "fakeredis"], indirect=True)
def test_sharded_store_on_a_single_server(server):
    """Without a cluster the blocks share one server: same API, same results."""
    conn = server.connection_kwargs()
    local = TensorDict({"x": torch.arange(20).reshape(10, 2)}, [10])
    buf = ShardedStore.from_tensordict(local, block_rows=3, td_id=f"single-{uuid.uuid4().hex}", **conn)
    assert torch.equal(buf[[9, 2, 3]]["x"], local[[9, 2, 3]]["x"])
    buf[::4] = {"x": torch.zeros(3, 2, dtype=torch.int64)}
    local[::4] = TensorDict({"x": torch.zeros(3, 2, dtype=torch.int64)}, [3])
    assert torch.equal(buf["x"], local["x"])
    buf.clear_redis()
    buf.close()


def test_sharded_store_docstring_examples(redis_server, monkeypatch):
    """The examples of tdstore.sharded run (against a single server, through TDSTORE_URL)."""
    import doctest

    import tdstore.sharded

    monkeypatch.setenv("TDSTORE_URL", redis_server.url)
    result = doctest.testmod(tdstore.sharded, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 5 and result.failed == 0
    assert redis_server.sync_client().dbsize() == 0


def test_sharded_store_describes_itself(cluster_server):
    buf = ShardedStore.from_schema(_SCHEMA, batch_size=[7, 2], block_rows=3, **cluster_server.connection_kwargs())
    assert len(buf) == 7 and buf.batch_size == torch.Size([7, 2]) and buf.block_rows == 3
    assert [b.batch_size[0] for b in buf.blocks] == [3, 3, 1]
    assert set(buf.keys(True, True)) == {"obs", "act", ("next", "done")}
    assert repr(buf) == f"ShardedStore(td_id={buf.td_id!r}, batch_size=[7, 2], block_rows=3, blocks=3)"
    assert buf[6].batch_size == torch.Size([2]) and buf[2:5]["obs"].shape == torch.Size([3, 2, 3])
    with ShardedStore.from_store(td_id=buf.td_id, **cluster_server.connection_kwargs()) as again:
        assert again.batch_size == buf.batch_size
    buf.clear_redis()
    buf.close()


def test_start_cluster_refuses_bad_arguments():
    from tdstore.server import start_cluster

    for kwargs, text in [
        ({"masters": 0}, "masters must be a positive int"),
        ({"masters": True}, "masters must be a positive int"),
        ({"replicas": -1}, "replicas must be an int >= 0"),
        ({"kind": "redis6"}, "kind must be 'redis' or 'valkey'"),
    ]:
        with pytest.raises(ValueError, match=text):
            start_cluster(**kwargs)
