"""Redis Sentinel routing for one store: ask the Sentinels for the master, talk to it directly.

A store behind Sentinel (``sentinels=[(host, port), ...]`` with ``service_name=``, or
``url="redis+sentinel://h1:p1,h2:p2/service_name"``, or the same URL in ``TDSTORE_URL``)
talks to the master with a plain ``redis.asyncio.Redis`` client, so every script, MULTI/EXEC
and WATCH of the single-server code path stays unchanged. The route has the shape of the
cluster's (:mod:`tdstore._backend.cluster`):

- the master is found with ``SENTINEL get-master-addr-by-name`` from the Sentinels, in turn
  (the first time, and whenever the route is stale), and checked with ``ROLE`` (a Sentinel may
  still name a master that has just been demoted);
- a refused or broken connection marks the route stale and goes on to the store's retry policy
  (:mod:`tdstore._backend.retry`): nothing sent is retried at once, an operation in flight has
  an unknown outcome (retried if idempotent, :class:`~tdstore.errors.OutcomeUnknownError` if not);
- a ``READONLY`` reply (the node was demoted to a replica: it applied nothing) marks the route
  stale and runs the operation again on the master the Sentinels name now, within the
  store's timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import unquote, urlparse

import redis.asyncio
import redis.exceptions

from tdstore._backend.protocols import AsyncClient
from tdstore.errors import ClientConfigError

__all__ = ["SCHEME", "SentinelRoute", "call_sentinel", "check_sentinels", "parse_url", "is_readonly"]

T = TypeVar("T")

if TYPE_CHECKING:
    from tdstore._backend.connection import Connection

Kwargs = dict[str, Any]

#: The URL scheme of a store behind Sentinel.
SCHEME = "redis+sentinel"

#: The redis-py error of a write sent to a replica (older redis-py: a plain ResponseError).
_READONLY_TEXT = "READONLY"

_SENTINEL_KWARGS = ("socket_timeout", "socket_connect_timeout", "socket_keepalive", "socket_keepalive_options")


def check_sentinels(sentinels: object, service_name: object, where: str = "TensorDictStore") -> list[tuple[str, int]]:
    """Validates ``sentinels=[(host, port), ...]`` (or ``"host:port"`` strings) and ``service_name=``."""
    if not isinstance(service_name, str) or not service_name:
        raise ClientConfigError(
            f"sentinels= of {where} needs service_name= (the name the Sentinels monitor the master under, "
            f"as in 'sentinel monitor <name> ...'), got service_name={service_name!r}"
        )
    if isinstance(sentinels, (str, bytes)) or not hasattr(sentinels, "__iter__"):
        sentinels = [sentinels]
    out: list[tuple[str, int]] = []
    for node in sentinels:
        if isinstance(node, str) and ":" in node:
            host, _, port = node.rpartition(":")
            node = (host.strip("[]"), port)
        try:
            host, port = node
            out.append((str(host), int(port)))
        except (TypeError, ValueError):
            raise ClientConfigError(
                f"sentinels= of {where} must be a list of (host, port) pairs or 'host:port' strings, "
                f"got {node!r} in {sentinels!r}"
            ) from None
    if not out:
        raise ClientConfigError(f"sentinels= of {where} is empty: give at least one (host, port) of a Sentinel")
    return out


def parse_url(url: object, where: str = "TensorDictStore") -> Kwargs:
    """The connection keywords a ``url=`` (or ``TDSTORE_URL``) names.

    ``redis+sentinel://[[user]:password@]h1:p1[,h2:p2...]/service_name[/db]`` gives
    ``sentinels``, ``service_name`` (and ``db``, ``username``, ``password`` of the master);
    ``redis://[[user]:password@]host[:port][/db]`` gives ``host``, ``port``, ``db`` (and the
    credentials); ``unix:///path/to.sock`` gives ``unix_socket_path``.
    """
    if not isinstance(url, str):
        raise ClientConfigError(f"url= of {where} takes a str, got {type(url).__name__}")
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    out: Kwargs = {}
    if parsed.password is not None:
        out["password"] = unquote(parsed.password)
    if parsed.username:
        out["username"] = unquote(parsed.username)
    if scheme == "unix":
        if not parsed.path:
            raise ClientConfigError(f"url={url!r} of {where}: a unix:// URL names a socket path, unix:///path/to.sock")
        out["unix_socket_path"] = parsed.path
        return out
    hosts = parsed.netloc.rpartition("@")[2]
    parts = [p for p in parsed.path.split("/") if p]
    if scheme == SCHEME:
        form = f"{SCHEME}://host:port[,host:port...]/service_name[/db]"
        if not hosts or not parts or len(parts) > 2:
            raise ClientConfigError(f"url={url!r} of {where} is not of the form {form}")
        sentinels = []
        for item in hosts.split(","):
            host, sep, port = item.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ClientConfigError(
                    f"url={url!r} of {where}: each Sentinel is host:port (the port is required), got {item!r}; "
                    f"expected {form}"
                )
            sentinels.append((host.strip("[]"), int(port)))
        out.update(sentinels=sentinels, service_name=unquote(parts[0]))
        if len(parts) == 2:
            out["db"] = _db(parts[1], url, where)
        return out
    if scheme in ("redis", "rediss"):
        try:
            name, number = parsed.hostname, parsed.port
        except ValueError:
            raise ClientConfigError(f"url={url!r} of {where} has a bad port; expected redis://host:port/db") from None
        if "," in hosts:
            raise ClientConfigError(
                f"url={url!r} of {where} names several hosts: for Sentinels use {SCHEME}://h1:p1,h2:p2/service_name"
            )
        if scheme == "rediss":
            out["ssl"] = True
        out.update(host=name or "localhost", port=number or 6379)
        if parts:
            out["db"] = _db(parts[0], url, where)
        return out
    raise ClientConfigError(
        f"url={url!r} of {where} has an unknown scheme {parsed.scheme!r}: use redis://host:port/db, rediss://, "
        f"unix:///path/to.sock or {SCHEME}://host:port[,host:port...]/service_name"
    )


def _db(text: str, url: str, where: str) -> int:
    if not text.isdigit():
        raise ClientConfigError(f"url={url!r} of {where}: the database must be a number, got {text!r}")
    return int(text)


def sentinel_client_kwargs(conn_kwargs: Kwargs, given: Kwargs | None) -> Kwargs:
    """The keywords of the clients to the Sentinels: the store's socket settings, then ``sentinel_kwargs=``
    (a Sentinel has its own password, if any: the master's is not sent to it)."""
    out = {name: conn_kwargs[name] for name in _SENTINEL_KWARGS if name in conn_kwargs}
    out.update(given or {})
    return out


def is_readonly(err: BaseException | None) -> bool:
    """Whether ``err`` (or what caused it) is a server's ``READONLY`` refusal: a replica applied nothing."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, redis.exceptions.ReadOnlyError) or str(err).startswith(_READONLY_TEXT):
            return True
        if isinstance(err, redis.exceptions.ResponseError) and f" {_READONLY_TEXT} You can't write" in str(err):
            return True  # wrapped by a script error (Redis 6: "Error running script ...")
        err = err.__cause__ or err.__context__
        seen += 1
    return False


class SentinelRoute:
    """Which node is the master of ``service_name`` now, and how to find it again after a failover."""

    def __init__(
        self, sentinels: list[tuple[str, int]], service_name: str, sentinel_kwargs: Kwargs | None = None
    ) -> None:
        self.sentinels = list(sentinels)
        self.service_name = service_name
        self.sentinel_kwargs = dict(sentinel_kwargs or {})
        self.node: tuple[str, int] | None = None  # the master, once known
        self.startup = list(sentinels)  # (where a client is built before the first locate(); never sent to)
        self.stale = True  # locate() before the next use (first use, connection failure, READONLY)
        self.failovers = 0  # how often the master changed (for describe() and the tests)

    def describe(self) -> str:
        node = f"{self.node[0]}:{self.node[1]}" if self.node else "not located yet"
        return f"Sentinel master {self.service_name!r} at {node} (of {len(self.sentinels)} Sentinels)"

    async def locate(self, conn_kwargs: Kwargs, connection_class: type) -> tuple[str, int]:
        """Asks the Sentinels, in turn, for the master of the service, and checks it with ROLE."""
        problems = []
        answered = False
        skw = sentinel_client_kwargs(conn_kwargs, self.sentinel_kwargs)
        for host, port in list(self.sentinels):
            client: AsyncClient = redis.asyncio.Redis(host=host, port=port, **skw)
            try:
                reply = await client.execute_command("SENTINEL", "get-master-addr-by-name", self.service_name)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as err:
                problems.append(f"Sentinel {host}:{port}: {err}")
                continue
            except redis.exceptions.ResponseError as err:
                raise ClientConfigError(
                    f"{host}:{port}, given as a Sentinel of service {self.service_name!r}, refused SENTINEL "
                    f"get-master-addr-by-name ({err}): is it a Sentinel (redis-server --sentinel)? For a plain "
                    "server pass host=/port= instead of sentinels="
                ) from err
            finally:
                await client.aclose()
            answered = True
            if not reply:
                problems.append(f"Sentinel {host}:{port} does not monitor a master named {self.service_name!r}")
                continue
            master = (_text(reply[0]), int(reply[1]))
            role = await _role(master, conn_kwargs, connection_class)
            if role != "master":
                problems.append(f"Sentinel {host}:{port} names {master[0]}:{master[1]}, which is {role}")
                continue
            if self.node is not None and master != self.node:
                self.failovers += 1
            self.node, self.stale = master, False
            if (host, port) != self.sentinels[0]:  # ask the one that answered first next time
                self.sentinels.remove((host, port))
                self.sentinels.insert(0, (host, port))
            return master
        if answered and all("does not monitor" in p for p in problems):
            raise ClientConfigError(
                f"no Sentinel monitors a master named {self.service_name!r}: "
                + "; ".join(problems)
                + ". Check service_name= (the name of 'sentinel monitor <name> ...')"
            )
        # "connecting to": nothing of the operation was sent (the retry policy may try again)
        raise redis.exceptions.ConnectionError(
            f"Error connecting to the master of {self.service_name!r}: no Sentinel named a reachable master: "
            + "; ".join(problems)
        )


async def _role(node: tuple[str, int], conn_kwargs: Kwargs, connection_class: type) -> str:
    """``"master"``, ``"slave"``..., or what kept the node from answering."""
    kwargs = {**conn_kwargs, "host": node[0], "port": node[1]}
    kwargs.pop("path", None)
    pool = redis.asyncio.ConnectionPool(connection_class=connection_class, **kwargs)
    client: AsyncClient = redis.asyncio.Redis(connection_pool=pool)
    try:
        reply = await client.execute_command("ROLE")
        return _text(reply[0])
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as err:
        return f"unreachable ({err})"
    finally:
        await client.aclose()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def call_sentinel(conn: Connection, fn: Callable[[AsyncClient], Awaitable[T]], limit: float) -> T:
    """Runs ``fn(client)`` on the master the Sentinels name, following a demotion (``READONLY``).

    A ``READONLY`` reply comes from a replica, which applied nothing (inside a MULTI the whole
    transaction is refused), so running ``fn`` again on the new master applies it exactly once.
    A connection failure marks the route stale (the next call asks the Sentinels again) and goes
    on to the caller's retry policy, which knows whether the operation may be sent again.
    """
    route = conn.sentinel_route
    assert route is not None
    deadline = time.monotonic() + limit
    attempt = 0
    while True:
        attempt += 1
        if route.stale:
            await route.locate(conn._conn_kwargs, conn._connection_class)
        client = conn.node_client(route.node)
        try:
            if conn._runner is None:
                await conn._setup(client)
            return await fn(client)
        except (redis.exceptions.ConnectionError, OSError):
            route.stale = True
            raise
        except Exception as err:
            if not is_readonly(err):
                raise
            route.stale = True
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(min(0.02 * attempt, 0.25))  # the Sentinels are reconfiguring
