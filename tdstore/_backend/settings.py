"""How the connection keywords of a store resolve to a client: the client, pool and
connection classes, the pool's keywords, and the route (a Redis Cluster slot's master, a
Sentinel's master) that ``Connection`` then connects through; and the keyword forms that
``open_connection`` (tdstore/_backend/connect.py) applies first: ``url=``, ``TDSTORE_URL``, the
pickle policy. Nothing here connects or sends anything.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

import redis
import redis.asyncio
import redis.asyncio.cluster

from tdstore._backend import cluster as _cluster
from tdstore._backend import credentials as _credentials
from tdstore._backend import sentinel as _sentinel
from tdstore._core.codec import PicklePolicy
from tdstore.errors import ClientConfigError

__all__ = ["ClientSettings", "client_settings", "connection_defaults", "sentinel_url", "pickle_policy", "check_decode"]


class ClientSettings(NamedTuple):
    """What :func:`client_settings` resolves (``Connection`` keeps each as an attribute)."""

    client_class: type
    pool_class: type
    connection_class: type
    conn_kwargs: _sentinel.Kwargs  #: (the keywords passed through to redis-py's pool)
    #: where the credentials came from (an environment variable), None when none was read
    credentials_from: str | None
    cluster_route: _cluster.ClusterRoute | None
    sentinel_route: _sentinel.SentinelRoute | None


def client_settings(
    *,
    host: str,
    port: int,
    db: int,
    unix_socket_path: str | None,
    client: redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster | None,
    redis_kwargs: _sentinel.Kwargs,
    cluster_nodes: object,
    timeout: float,
    td_id: str,
) -> ClientSettings:
    """The client settings of a store from its connection keywords (``redis_kwargs`` loses the
    Sentinel keywords, in place): Sentinel, a cluster, a ``client=`` given, or a plain server.

    Raises:
        ClientConfigError: keywords that contradict each other, or ``decode_responses=True``.
    """
    sentinel_route: _sentinel.SentinelRoute | None = None
    cluster_route: _cluster.ClusterRoute | None = None
    credentials_from: str | None = None
    client_class: type
    pool_class: type
    connection_class: type
    # Redis Sentinel (see tdstore/_backend/sentinel.py): one plain client to the master the Sentinels name
    sentinels = redis_kwargs.pop("sentinels", None)
    service_name = redis_kwargs.pop("service_name", None)
    sentinel_kwargs = redis_kwargs.pop("sentinel_kwargs", None)
    if sentinels is not None or service_name is not None:
        where = f"TensorDictStore(td_id={td_id!r})"
        if sentinels is None:
            raise ClientConfigError(f"service_name= of {where} needs sentinels=[(host, port), ...] beside it")
        if cluster_nodes is not None or client is not None or unix_socket_path is not None:
            raise ClientConfigError(
                f"{where} got sentinels= beside cluster_nodes=, client= or unix_socket_path=: pass one way "
                "to reach the server (the Sentinels name the master)"
            )
        if (host, port) != ("localhost", 6379):
            raise ClientConfigError(
                f"{where} got sentinels= beside host={host!r}, port={port!r}: the Sentinels name the master; "
                "pass one or the other"
            )
        check_decode(redis_kwargs, "redis_kwargs")
        nodes = _sentinel.check_sentinels(sentinels, service_name, where)
        sentinel_route = _sentinel.SentinelRoute(nodes, service_name, sentinel_kwargs)
        kwargs = dict(redis_kwargs)
        use_tls = bool(kwargs.pop("ssl", False))
        kwargs.setdefault("socket_timeout", timeout)
        kwargs.setdefault("socket_connect_timeout", min(timeout, 10.0))
        kwargs["db"] = db
        client_class = redis.asyncio.Redis
        pool_class = redis.asyncio.ConnectionPool
        connection_class = redis.asyncio.SSLConnection if use_tls else redis.asyncio.Connection
        conn_kwargs = kwargs
        credentials_from = _credentials.fill_from_env(kwargs)
    elif cluster_nodes is not None or _cluster.is_cluster_client(client):
        check_decode(redis_kwargs, "redis_kwargs")
        route, kwargs, node_class = _cluster.connection_settings(
            client, cluster_nodes, redis_kwargs, db=db, timeout=timeout, where=f"TensorDictStore(td_id={td_id!r})"
        )
        check_decode(kwargs, "the cluster client passed to TensorDictStore")
        cluster_route = route
        client_class = redis.asyncio.Redis
        pool_class = redis.asyncio.ConnectionPool
        connection_class = node_class
        conn_kwargs = kwargs
        if client is None:
            credentials_from = _credentials.fill_from_env(kwargs)
    elif client is not None:
        if not isinstance(client, redis.asyncio.Redis):
            raise ClientConfigError(
                f"client must be a redis.asyncio.Redis instance, got {type(client).__name__}"
            )
        pool = client.connection_pool
        kwargs = dict(pool.connection_kwargs)
        check_decode(kwargs, "the client passed to TensorDictStore")
        check_decode(redis_kwargs, "redis_kwargs")  # beside client=, they must not say otherwise
        client_class = type(client)
        pool_class = type(pool)
        connection_class = pool.connection_class
        conn_kwargs = kwargs
    else:
        check_decode(redis_kwargs, "redis_kwargs")
        kwargs = dict(redis_kwargs)
        kwargs.setdefault("socket_timeout", timeout)
        kwargs.setdefault("socket_connect_timeout", min(timeout, 10.0))
        kwargs["db"] = db
        if unix_socket_path is not None:
            kwargs["path"] = unix_socket_path
            connection_class = redis.asyncio.UnixDomainSocketConnection
        else:
            kwargs["host"] = host
            kwargs["port"] = port
            use_tls = bool(kwargs.pop("ssl", False)) or _credentials.tls_from_url(kwargs)
            connection_class = redis.asyncio.SSLConnection if use_tls else redis.asyncio.Connection
        client_class = redis.asyncio.Redis
        pool_class = redis.asyncio.ConnectionPool
        connection_class = connection_class
        conn_kwargs = kwargs
        credentials_from = _credentials.fill_from_env(kwargs)
    return ClientSettings(client_class, pool_class, connection_class, conn_kwargs, credentials_from, cluster_route, sentinel_route)


def check_decode(kwargs: Mapping[str, object], where: str) -> None:
    if kwargs.get("decode_responses"):
        raise ClientConfigError(
            f"{where} has decode_responses=True: tdstore reads raw bytes from the server, "
            "and a client that decodes replies to str would corrupt every tensor. "
            "Pass a client created with decode_responses=False (the default)."
        )


def connection_defaults(host: str, port: int, unix_socket_path: str | None) -> tuple[str, int, str | None]:
    """Applies TDSTORE_URL when the caller kept the documented defaults.

    ``TDSTORE_URL=redis://127.0.0.1:6400/0`` or ``unix:///path/to.sock`` points every
    store created with default connection arguments at another server, so the same code
    (and the docs' examples) runs against a private test server.
    """
    import os
    from urllib.parse import urlparse

    url = os.environ.get("TDSTORE_URL")
    if not url or host != "localhost" or port != 6379 or unix_socket_path is not None:
        return host, port, unix_socket_path
    parsed = urlparse(url)
    if parsed.scheme.lower() == _sentinel.SCHEME:
        return host, port, unix_socket_path  # (see sentinel_url)
    if parsed.scheme == "unix":
        return host, port, parsed.path
    return parsed.hostname or host, parsed.port or port, None


def sentinel_url(
    td_id: str, host: str, port: int, db: int, unix_socket_path: str | None, redis_kwargs: _sentinel.Kwargs
) -> tuple[str, int, int, str | None]:
    """Applies ``url=`` (any form), or a ``redis+sentinel://`` ``TDSTORE_URL`` when the caller kept the
    defaults and named no Sentinels; the Sentinel settings go into ``redis_kwargs`` (in place)."""
    where = f"TensorDictStore(td_id={td_id!r})"
    url = redis_kwargs.pop("url", None)
    defaults = (host, port, unix_socket_path) == ("localhost", 6379, None)
    if url is None:
        env = os.environ.get("TDSTORE_URL", "")
        if not env.lower().startswith(_sentinel.SCHEME + "://") or not defaults:
            return host, port, db, unix_socket_path
        if redis_kwargs.get("sentinels") is not None or redis_kwargs.get("cluster_nodes") is not None:
            return host, port, db, unix_socket_path
        if redis_kwargs.get("client") is not None:
            return host, port, db, unix_socket_path
        given = _sentinel.parse_url(env, f"{where} (from TDSTORE_URL)")
    else:
        given = _sentinel.parse_url(url, where)
        clash = [name for name in ("sentinels", "service_name", "cluster_nodes") if redis_kwargs.get(name) is not None]
        if not defaults or clash:
            raise ClientConfigError(
                f"{where} got url={url!r} beside "
                + (", ".join(f"{n}=" for n in clash) if clash else f"host={host!r}/port={port!r}/unix_socket_path=")
                + ": the URL names the server; pass one or the other"
            )
    for name in ("username", "password", "ssl"):
        if name in given and redis_kwargs.get(name) is None:
            redis_kwargs[name] = given[name]
    if "sentinels" in given:
        redis_kwargs["sentinels"] = given["sentinels"]
        redis_kwargs["service_name"] = given["service_name"]
    return (
        given.get("host", host), given.get("port", port), given.get("db", db), given.get("unix_socket_path", unix_socket_path)
    )


def pickle_policy(allow: bool | None, key: bytes | str | None) -> PicklePolicy:
    """The store's pickle policy: the arguments where given, else the process-wide default."""
    from tdstore._core import codec as _codec

    default = _codec.default_pickle_policy()
    if allow is None and key is None:
        return default
    if isinstance(key, str):
        key = key.encode()
    return _codec.PicklePolicy(default.allow if allow is None else bool(allow), key if key is not None else default.key)
