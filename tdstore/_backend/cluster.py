"""Redis Cluster routing for one store: every key of a store is in one slot, so one node.

All keys of a store share the hash tag ``{td_id}`` (see :mod:`tdstore._core.keys`), hence one
cluster slot, hence one master at a time. A store on a cluster therefore talks to that
master with a plain ``redis.asyncio.Redis`` client, and every script, MULTI/EXEC and WATCH
of the single-server code path stays legal and unchanged (no cross-slot command exists).
Different stores hash to different slots and spread over the masters.

The node is found with ``CLUSTER SLOTS`` from the startup nodes (the first time, and after
a connection failure, e.g. a failover). When the slot has moved (resharding), the server
answers ``MOVED slot host:port`` before running anything: the client switches to that node
and runs the operation again. ``ASK``/``TRYAGAIN`` (the slot is being migrated) and
``CLUSTERDOWN`` refuse the command before it runs too: the operation waits and runs again
until the migration is over, within the store's timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio
import redis.asyncio.cluster
import redis.exceptions
from redis.crc import key_slot

from tdstore._backend.protocols import AsyncClient
from tdstore.errors import ClientConfigError

__all__ = ["ClusterRoute", "cluster_settings", "is_cluster_client", "REDIRECTS"]

T = TypeVar("T")

#: Replies by which a cluster node refuses a command before running it.
REDIRECTS = (
    redis.exceptions.MovedError,  # subclass of AskError; listed for clarity
    redis.exceptions.AskError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
)

#: Connection settings copied from a RedisCluster client to the per-node client.
_COPIED = (
    "username", "password", "credential_provider", "client_name", "socket_timeout",
    "socket_connect_timeout", "socket_keepalive", "socket_keepalive_options", "health_check_interval",
    "encoding", "encoding_errors", "decode_responses", "protocol", "ssl_keyfile", "ssl_certfile",
    "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_data", "ssl_ca_path", "ssl_check_hostname",
    "ssl_min_version", "ssl_ciphers", "ssl_password",
)  # fmt: skip

_MAX_REDIRECTS = 100


def is_cluster_client(client: object) -> bool:
    return isinstance(client, redis.asyncio.cluster.RedisCluster)


def cluster_settings(client: redis.asyncio.cluster.RedisCluster) -> tuple[list[tuple[str, int]], dict[str, Any], type]:
    """The startup nodes, node connection kwargs and connection class of a RedisCluster client.

    tdstore does not use the given client object itself (it belongs to the caller's event
    loop, and a store needs one per IO loop): it connects with the same settings.
    """
    manager = client.nodes_manager
    nodes = [(str(node.host), int(node.port)) for node in manager.startup_nodes.values()]
    for node in manager.nodes_cache.values():  # the nodes it has already discovered
        if (str(node.host), int(node.port)) not in nodes:
            nodes.append((str(node.host), int(node.port)))
    source = manager.connection_kwargs
    kwargs = {name: source[name] for name in _COPIED if name in source}
    connection_class = source.get("connection_class", redis.asyncio.Connection)
    return nodes, kwargs, connection_class


def check_nodes(nodes: Any, where: str = "TensorDictStore") -> list[tuple[str, int]]:
    """Validates ``cluster_nodes=[(host, port), ...]`` (also accepts ``"host:port"`` strings)."""
    if isinstance(nodes, (str, bytes)) or not hasattr(nodes, "__iter__"):
        nodes = [nodes]
    out: list[tuple[str, int]] = []
    for node in nodes:
        if isinstance(node, str) and ":" in node:
            host, _, port = node.rpartition(":")
            node = (host.strip("[]"), port)
        try:
            host, port = node
            out.append((str(host), int(port)))
        except (TypeError, ValueError):
            raise ClientConfigError(
                f"cluster_nodes of {where} must be a list of (host, port) pairs or 'host:port' strings, "
                f"got {node!r} in {nodes!r}"
            ) from None
    if not out:
        raise ClientConfigError(f"cluster_nodes of {where} is empty: give at least one (host, port) of the cluster")
    return out


def connection_settings(
    client: Any, nodes: Any, redis_kwargs: dict[str, Any], *, db: int, timeout: float, where: str = "TensorDictStore"
) -> tuple[ClusterRoute, dict[str, Any], type]:
    """The route, per-node connection kwargs and connection class of a store on a cluster.

    From a ``redis.asyncio.cluster.RedisCluster`` client (its startup nodes and settings),
    or from ``cluster_nodes=[(host, port), ...]`` plus the store's other redis kwargs.
    """
    if client is not None:
        nodes, kwargs, connection_class = cluster_settings(client)
    else:
        nodes = check_nodes(nodes, where)
        kwargs = dict(redis_kwargs)
        ssl = kwargs.pop("ssl", False)
        connection_class = redis.asyncio.SSLConnection if ssl else redis.asyncio.Connection
        kwargs.setdefault("socket_timeout", timeout)
        kwargs.setdefault("socket_connect_timeout", min(timeout, 10.0))
    if db:
        raise ClientConfigError(f"{where} is on a Redis Cluster, which has only database 0; got db={db}")
    return ClusterRoute(nodes), kwargs, connection_class


class ClusterRoute:
    """Which master serves one store's slot, and how to reach it again when that changes."""

    def __init__(self, nodes: list[tuple[str, int]]) -> None:
        self.nodes = list(nodes)  # startup nodes, then the masters learnt from CLUSTER SLOTS
        self.startup = list(nodes)
        self.node: tuple[str, int] | None = None  # the master of the store's slot, once known
        self.stale = True  # locate() before the next use (first use, connection failure)

    async def locate(self, key: str, conn_kwargs: dict[str, Any], connection_class: type) -> tuple[str, int]:
        """Asks the known nodes, in turn, which master serves ``key``'s slot (CLUSTER SLOTS)."""
        slot = key_slot(key.encode())
        problems = []
        for host, port in list(self.nodes):
            pool = redis.asyncio.ConnectionPool(connection_class=connection_class, host=host, port=port, **conn_kwargs)
            client: AsyncClient = redis.asyncio.Redis(connection_pool=pool)
            try:
                reply = await client.execute_command("CLUSTER SLOTS")
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as err:
                problems.append(f"{host}:{port}: {err}")
                continue
            except redis.exceptions.ResponseError as err:
                raise ClientConfigError(
                    f"{host}:{port}, given in cluster_nodes for the store at {key!r}, is not a Redis Cluster "
                    f"node ({err}); pass cluster_nodes only for servers started with cluster-enabled yes, and "
                    "host=/port= for a single server"
                ) from err
            finally:
                await client.aclose()
            found = None
            for (low, high), info in _slot_table(reply):
                primary = (info[0] or host, info[1])
                if primary not in self.nodes:
                    self.nodes.append(primary)
                if low <= slot <= high:
                    found = primary
            if found is not None:
                self.node, self.stale = found, False
                return found
            problems.append(f"{host}:{port}: slot {slot} is served by no node (cluster not ready?)")
        # "connecting to": nothing of the operation was sent (the retry policy may try again)
        raise redis.exceptions.ConnectionError(
            f"Error connecting to the Redis Cluster: no node told which master serves slot {slot} "
            f"(key {key!r}): " + "; ".join(problems)
        )

    def moved(self, err: redis.exceptions.ResponseError) -> None:
        """Follows a MOVED reply to the slot's new master."""
        if isinstance(err, redis.exceptions.MovedError):
            self.node = (str(err.host), int(err.port))
            if self.node not in self.nodes:
                self.nodes.append(self.node)
        else:
            self.stale = True


def _slot_table(reply: Any) -> list[tuple[tuple[int, int], tuple[str, int]]]:
    """``[((low, high), (host, port)), ...]`` from a CLUSTER SLOTS reply (raw or parsed by redis-py)."""
    out = []
    if isinstance(reply, dict):
        for (low, high), info in reply.items():
            host, port = info["primary"][:2]
            out.append(((int(low), int(high)), (_text(host), int(port))))
        return out
    for entry in reply:
        low, high, primary = entry[0], entry[1], entry[2]
        out.append(((int(low), int(high)), (_text(primary[0]), int(primary[1]))))
    return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def call_routed(conn: Any, fn: Callable[[AsyncClient], Awaitable[T]], limit: float) -> T:
    """Runs ``fn(client)`` on the master of ``conn``'s slot, following MOVED/ASK/TRYAGAIN.

    Every reply in :data:`REDIRECTS` comes before the command runs (inside a MULTI, the
    whole transaction is refused), so running ``fn`` again applies it exactly once.
    A connection failure marks the route stale (the next call asks the cluster again,
    which finds a promoted replica after a failover) and goes on to the caller's retry policy.
    """
    route: ClusterRoute = conn.cluster_route
    deadline = time.monotonic() + limit
    for attempt in range(_MAX_REDIRECTS):
        if route.stale:
            await route.locate(conn.keys.meta, conn._conn_kwargs, conn._connection_class)
        client = conn.node_client(route.node)
        try:
            if conn._runner is None:
                await conn._setup(client)
            return await fn(client)
        except REDIRECTS as err:
            route.moved(err)
            if attempt + 1 >= _MAX_REDIRECTS or time.monotonic() >= deadline:
                raise
            if not isinstance(err, redis.exceptions.MovedError):
                await asyncio.sleep(min(0.01 * (attempt + 1), 0.2))  # a migration is under way
        except (redis.exceptions.ConnectionError, OSError):
            route.stale = True
            raise
    raise AssertionError("unreachable")  # pragma: no cover
