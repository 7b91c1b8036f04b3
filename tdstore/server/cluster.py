"""Start a private Redis Cluster (several masters on loopback ports) for tests and demos.

No ``redis-cli --cluster create`` is needed: each node is a ``redis-server`` (or
``valkey-server``) started by :func:`tdstore.server.start_server` with
``cluster-enabled yes``; then every node gets its third of the 16384 slots
(``CLUSTER ADDSLOTSRANGE``), the first node meets the others (``CLUSTER MEET``), and
the launcher waits until every node says ``cluster_state:ok`` and sees every master.

Example:
    >>> from tdstore.server import start_cluster
    >>> with start_cluster(masters=3) as cluster:               # doctest: +SKIP
    ...     store = TensorDictStore(**cluster.connection_kwargs(), batch_size=[4])

Each node binds only ``127.0.0.1``; persistence is off, and every node (and the cluster
handle) is stopped by the same :mod:`atexit` hook as a single server.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from types import TracebackType
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
import redis.exceptions

from tdstore.server.handle import ServerHandle, _register, _unregister

__all__ = ["ClusterHandle", "start_cluster", "SLOTS"]

#: Number of hash slots of a Redis Cluster.
SLOTS = 16384

_PORT_ATTEMPTS = 5


def _free_port_pair() -> tuple[int, int]:
    """Two distinct free loopback ports (client port, cluster bus port)."""
    socks = []
    try:
        for _ in range(2):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return int(socks[0].getsockname()[1]), int(socks[1].getsockname()[1])
    finally:
        for sock in socks:
            sock.close()


def slot_ranges(masters: int) -> list[tuple[int, int]]:
    """The slot range each of ``masters`` nodes serves (0-5460, 5461-10922, 10923-16383 for 3)."""
    bounds = [round(i * SLOTS / masters) for i in range(masters + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(masters)]


class _ClusterSyncClient(redis.cluster.RedisCluster):
    """A sync cluster client whose keyspace-wide reads cover every primary.

    redis-py sends ``KEYS`` and ``DBSIZE`` to one node by default; the tests read the
    whole keyspace (``FLUSHALL`` and ``SCAN`` already go to every primary).
    """

    def keys(self, pattern: Any = "*", **kwargs: Any) -> Any:
        kwargs.setdefault("target_nodes", self.PRIMARIES)
        return super().keys(pattern, **kwargs)

    def dbsize(self, **kwargs: Any) -> Any:
        kwargs.setdefault("target_nodes", self.PRIMARIES)
        reply = super().dbsize(**kwargs)
        return sum(reply.values()) if isinstance(reply, dict) else reply


class ClusterHandle(ServerHandle):
    """A running local Redis Cluster: its master nodes and the ways to connect to it.

    A :class:`~tdstore.server.ServerHandle` (so tests and tools that take one take a
    cluster too) whose connection methods reach the whole cluster.

    Attributes:
        kind: ``"cluster"``.
        nodes: One :class:`~tdstore.server.ServerHandle` per node: the masters first (in
            slot order, as started), then the replicas (replica ``j`` follows master
            ``j % masters``). After a failover, ask :meth:`node_of_key` who serves a slot.
        masters, replicas: Masters, and replicas per master, as started.
        host, port: The first master's address (any master answers cluster commands).
    """

    def __init__(self, nodes: list[ServerHandle], *, node_kind: str, masters: int, node_timeout_ms: int = 5000) -> None:
        first = nodes[0]
        super().__init__(
            kind="cluster", binary=first.binary, version=first.version, host=first.host, port=first.port,
            unix_socket_path=None,
        )  # fmt: skip
        self.nodes = nodes
        self.node_kind = node_kind
        self.masters = masters
        self.replicas = len(nodes) // masters - 1
        self.node_timeout_ms = node_timeout_ms
        self._owner_pid = os.getpid()

    def __repr__(self) -> str:
        ports = ",".join(str(n.port) for n in self.nodes)
        return f"ClusterHandle(masters={self.masters}, ports={ports}, node_kind={self.node_kind!r})"

    # -- connecting ----------------------------------------------------------------
    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        """``[(host, port), ...]`` of every node."""
        return [(str(n.host), int(n.port or 0)) for n in self.nodes]

    def connection_kwargs(self, *, unix: bool = False) -> dict[str, Any]:
        """``{"cluster_nodes": [(host, port), ...]}``, for ``TensorDictStore(**kwargs)``."""
        return {"cluster_nodes": self.startup_nodes}

    def _cluster_nodes(self, module: Any) -> list[Any]:
        return [module.ClusterNode(host, port) for host, port in self.startup_nodes]

    @property
    def url(self) -> str:
        raise ValueError("a Redis Cluster has no single URL; use connection_kwargs() or startup_nodes")

    def sync_client(self, *, unix: bool = False, **kw: Any) -> redis.cluster.RedisCluster:  # type: ignore[override]
        """A synchronous :class:`redis.cluster.RedisCluster` (bytes replies) to inspect the keyspace.

        ``keys()`` and ``dbsize()`` cover every primary; close it when done.
        """
        kw.setdefault("socket_connect_timeout", 10)
        return _ClusterSyncClient(startup_nodes=self._cluster_nodes(redis.cluster), **kw)

    def async_client(self, *, unix: bool = False, **kw: Any) -> redis.asyncio.cluster.RedisCluster:  # type: ignore[override]
        """A new :class:`redis.asyncio.cluster.RedisCluster`; ``aclose()`` it when done."""
        kw.setdefault("socket_connect_timeout", 10)
        return redis.asyncio.cluster.RedisCluster(startup_nodes=self._cluster_nodes(redis.asyncio.cluster), **kw)

    def node_client(self, index: int) -> redis.Redis:
        """A plain client to master ``index`` (close it when done)."""
        host, port = _address(self.nodes[index])
        return redis.Redis(host=host, port=port, socket_connect_timeout=10)

    def node_of_key(self, key: str | bytes) -> int:
        """The index (in :attr:`nodes`) of the master that serves ``key``'s slot now (CLUSTER SLOTS)."""
        from redis.crc import key_slot

        slot = key_slot(key.encode() if isinstance(key, str) else key)
        table = None
        for index, node in enumerate(self.nodes):
            if not node.running:
                continue
            client = self.node_client(index)
            try:
                table = client.execute_command("CLUSTER SLOTS")
                break
            finally:
                client.close()
        ports = [node.port for node in self.nodes]
        for low, high, primary, *_ in table or []:
            if int(low) <= slot <= int(high):
                return ports.index(int(primary[1]))
        raise LookupError(f"slot {slot} is served by no master")

    def node_of_store(self, td_id: str, prefix: str = "tensordict") -> int:
        """The index of the master that holds the store ``td_id`` (all its keys are in one slot)."""
        from tdstore._core.keys import StoreKeys

        return self.node_of_key(StoreKeys(prefix, td_id).meta)

    def flushall(self) -> None:
        """FLUSHALL on every running master (replicas follow)."""
        for index, node in enumerate(self.nodes):
            if not node.running:
                continue
            client = self.node_client(index)
            try:
                if client.execute_command("ROLE")[0] == b"master":
                    client.flushall()
            finally:
                client.close()

    # -- lifecycle -----------------------------------------------------------------
    @property
    def running(self) -> bool:
        return not self._stopped and all(n.running for n in self.nodes)

    def stop(self) -> None:
        """Stops every node (idempotent)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            try:
                for node in self.nodes:
                    with contextlib.suppress(Exception):
                        node.stop()
            finally:
                _unregister(self)

    def restart(self, *, save: bool = False, startup_timeout: float = 20.0) -> None:
        """Starts a fresh cluster (empty, new ports) if any node stopped; no-op otherwise."""
        with self._lock:
            if self.running:
                return
            if self._owner_pid != os.getpid():
                raise RuntimeError("cannot restart a cluster started by another process")
            for node in self.nodes:
                with contextlib.suppress(Exception):
                    node.stop()
            self.nodes = _start_nodes(
                self.node_kind, self.masters, startup_timeout, self.replicas, self.node_timeout_ms
            )
            self.host, self.port = self.nodes[0].host, self.nodes[0].port
            self._stopped = False
            _register(self)

    def __enter__(self) -> ClusterHandle:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()



def _address(node: ServerHandle) -> tuple[str, int]:
    """The TCP address of a cluster node (nodes always listen on a loopback port)."""
    assert node.host is not None and node.port is not None, f"cluster node {node!r} has no TCP address"
    return node.host, node.port


def _start_node(kind: str, startup_timeout: float, node_timeout_ms: int) -> ServerHandle:
    from tdstore.server.start import start_server

    last: Exception | None = None
    for _ in range(_PORT_ATTEMPTS):
        port, bus = _free_port_pair()
        config = {
            "cluster-enabled": "yes",
            "cluster-port": str(bus),
            "cluster-config-file": "nodes.conf",
            "cluster-node-timeout": str(node_timeout_ms),
            # a store's keys may outlive one node: never refuse the whole keyspace for it
            "cluster-require-full-coverage": "no",
            # a replica's first sync starts at once (the default waits 5 s for more replicas)
            "repl-diskless-sync-delay": "0",
        }
        try:
            return start_server(kind, port=port, unix_socket=False, config=config, startup_timeout=startup_timeout)
        except RuntimeError as exc:  # a port taken meanwhile: pick others
            last = exc
    raise RuntimeError(f"could not start a {kind} cluster node: {last}")


def _start_nodes(
    kind: str, masters: int, startup_timeout: float, replicas: int = 0, node_timeout_ms: int = 5000
) -> list[ServerHandle]:
    """Starts ``masters * (1 + replicas)`` nodes: the masters (slot order), then the replicas."""
    nodes: list[ServerHandle] = []
    total = masters * (1 + replicas)
    try:
        for _ in range(total):
            nodes.append(_start_node(kind, startup_timeout, node_timeout_ms))
        clients = [redis.Redis(*_address(n), socket_timeout=10) for n in nodes]
        try:
            for client, (low, high) in zip(clients[:masters], slot_ranges(masters), strict=True):
                client.execute_command("CLUSTER ADDSLOTSRANGE", low, high)
            bus_ports = [int(str(client.config_get("cluster-port")["cluster-port"])) for client in clients]
            for node, bus in zip(nodes[1:], bus_ports[1:], strict=True):
                clients[0].execute_command("CLUSTER MEET", node.host, node.port, bus)
            _wait_ok(clients, total, startup_timeout)
            ids = [client.execute_command("CLUSTER MYID").decode() for client in clients]
            for index in range(masters, total):
                _replicate(clients[index], ids[(index - masters) % masters], startup_timeout)
            _wait_ok(clients, total, startup_timeout)
            _wait_synced(clients[:masters], clients[masters:], replicas, startup_timeout)
        finally:
            for client in clients:
                client.close()
    except BaseException:
        for node in nodes:
            with contextlib.suppress(Exception):
                node.stop()
        raise
    return nodes


def _replicate(client: redis.Redis, master_id: str, timeout: float) -> None:
    """Makes ``client``'s node a replica of ``master_id`` (retried until the node knows that master)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.execute_command("CLUSTER REPLICATE", master_id)
            return
        except redis.exceptions.ResponseError:  # "Unknown node": gossip has not reached it yet
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def _wait_synced(masters: list[redis.Redis], replicas: list[redis.Redis], per_master: int, timeout: float) -> None:
    """Waits until every replica has finished its first sync (a failover needs a synced replica)."""
    deadline = time.monotonic() + timeout
    while True:
        links = [client.info("replication").get("master_link_status") for client in replicas]
        counts = [int(client.info("replication").get("connected_slaves", 0)) for client in masters]
        # and every node knows every replica as one (the masters' votes in a failover need it)
        views = [_replicas_seen(client) for client in [*masters, *replicas]]
        if (
            all(link == "up" for link in links)
            and all(count == per_master for count in counts)
            and all(seen == len(replicas) for seen in views)
        ):
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the replicas did not sync within {timeout} s (links {links}, replicas per master {counts})")
        time.sleep(0.05)


def _replicas_seen(client: redis.Redis) -> int:
    """How many nodes ``client``'s node knows as replicas (CLUSTER NODES)."""
    text = client.execute_command("CLUSTER NODES")
    if isinstance(text, dict):  # redis-py parses it into {address: {"flags": ...}}
        return sum("slave" in str(info.get("flags", "")) for info in text.values())
    text = text.decode() if isinstance(text, bytes) else str(text)
    return sum("slave" in line.split()[2].split(",") for line in text.splitlines() if line.strip())


def _wait_ok(clients: list[redis.Redis], known_nodes: int, timeout: float) -> None:
    """Waits until every node reports ``cluster_state:ok``, knows every node and sees every slot served."""
    deadline = time.monotonic() + timeout
    problem = "not checked yet"
    while time.monotonic() < deadline:
        problem = ""
        for index, client in enumerate(clients):
            info = client.cluster("INFO")
            state = info.get("cluster_state") if isinstance(info, dict) else None
            known = int(info.get("cluster_known_nodes", 0)) if isinstance(info, dict) else 0
            slots_ok = int(info.get("cluster_slots_ok", 0)) if isinstance(info, dict) else 0
            if state != "ok" or known != known_nodes or slots_ok != SLOTS:
                problem = f"node {index}: state={state} known_nodes={known} slots_ok={slots_ok}"
                break
        if not problem:
            return
        time.sleep(0.05)
    raise RuntimeError(f"the cluster did not become ready within {timeout} s ({problem})")


def start_cluster(
    masters: int = 3,
    *,
    replicas: int = 0,
    kind: str = "redis",
    node_timeout_ms: int = 5000,
    startup_timeout: float = 20.0,
) -> ClusterHandle:
    """Starts a private Redis Cluster of ``masters`` master nodes on loopback ports.

    Args:
        masters: Number of master nodes; the 16384 slots are split evenly among them.
        replicas: Replicas per master (they take over when their master fails).
        kind: The server of each node: ``"redis"`` (Redis 7+) or ``"valkey"``; both
            support ``cluster-port`` and ``CLUSTER ADDSLOTSRANGE``.
        node_timeout_ms: ``cluster-node-timeout``: how long a master may be unreachable
            before its replica is promoted.
        startup_timeout: Seconds to wait for each node, and then for the cluster to be ready.

    Returns:
        A :class:`ClusterHandle` that owns the nodes; use it as a context manager or call
        :meth:`ClusterHandle.stop`. Clusters still running at exit are stopped.

    Raises:
        ServerNotFoundError: The server binary is not installed.
        RuntimeError: A node did not start, or the cluster did not become ready in time.
        ValueError: ``masters`` is below 1, ``replicas`` below 0, or ``kind`` is not a
            cluster-capable server.
    """
    if isinstance(masters, bool) or not isinstance(masters, int) or masters < 1:
        raise ValueError(f"masters must be a positive int, got {masters!r}")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ValueError(f"replicas must be an int >= 0, got {replicas!r}")
    if kind not in ("redis", "valkey"):
        raise ValueError(f"kind must be 'redis' or 'valkey' (Redis 7+ cluster nodes), got {kind!r}")
    nodes = _start_nodes(kind, masters, startup_timeout, replicas, node_timeout_ms)
    handle = ClusterHandle(nodes, node_kind=kind, masters=masters, node_timeout_ms=node_timeout_ms)
    _register(handle)
    return handle
