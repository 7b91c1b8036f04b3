"""Direct calls: a blocking redis-py client per connection, for calls sent from the calling thread.

A one-command read or a small write costs more in the hop to the process's IO loop and
back (two thread switches, a task) than on the wire. :func:`direct_client` makes a blocking
``redis.Redis`` on the same server, once the IO-loop client of the process has set the
connection up; :func:`direct_call` runs a call on it, or says (:data:`NOT_DIRECT`) that the
call is to go through :meth:`Connection.run <tdstore._backend.connection.Connection.run>`.
The connection keeps the state (``_direct``, ``_direct_generation``, ``_direct_node``,
``_direct_retired``, set up in ``Connection._start_live``); this module holds the logic.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import redis
import redis.asyncio
import redis.exceptions
import redis.retry
from redis.backoff import NoBackoff

from tdstore._backend import durability as _durability
from tdstore._backend import loop as _io
from tdstore._backend import translate as _translate
from tdstore._backend import wire as _wire
from tdstore._backend.translate import retry_class
from tdstore.errors import TDStoreError

if TYPE_CHECKING:
    from tdstore._backend.cluster import ClusterRoute
    from tdstore._backend.connection import Connection

__all__ = ["NOT_DIRECT", "INHERITED_CLIENTS", "direct_client", "direct_call"]

T = TypeVar("T")

#: What :func:`direct_call` returns when the call is to go through the IO loop.
NOT_DIRECT = object()

#: Clients inherited through fork() (direct and IO-loop ones): kept referenced, never closed
#: (their sockets are the parent's).
INHERITED_CLIENTS: list[object] = []

#: Held while a direct client is made: threads sharing a handle must get the same one (two
#: made at once left a connection of the loser's pool armed and out of every pool).
_DIRECT_LOCK = threading.Lock()


def _new_direct_lock() -> None:
    global _DIRECT_LOCK
    _DIRECT_LOCK = threading.Lock()  # a child forked while another thread held it


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_direct_lock)

#: Connection settings a direct (synchronous) client takes over from the store's own.
_DIRECT_KWARGS = (
    "host", "port", "path", "db", "username", "password", "socket_timeout", "socket_connect_timeout",
    "socket_keepalive", "socket_read_size", "client_name", "protocol",
)
_DIRECT_CLASSES = {
    redis.asyncio.Connection: redis.Connection,
    redis.asyncio.UnixDomainSocketConnection: redis.UnixDomainSocketConnection,
}


def direct_client(conn: Connection) -> redis.Redis | None:
    """A synchronous client for reads sent from the calling thread, or None.

    A one-command read costs more in the hop to the IO loop and back (two thread
    switches, a task) than on the wire; a blocking ``redis.Redis`` on the same server
    avoids both. Only for plain TCP and unix-socket connections (not TLS, fakeredis,
    custom connection classes or Sentinel), and only once the IO-loop client of this
    process has set the connection up (scripts loaded, first contact made). After a
    fork the parent's direct client is left untouched, like the asyncio one.

    On a cluster it is a client to the master of the store's slot, the one the IO-loop
    client was set up on; none while the route is being found again (after a connection
    failure), and a new one once the slot has a new master (MOVED, failover): a reply
    that redirects or a failed connection makes the direct call give up before anything
    ran (see :func:`direct_call`), and :meth:`Connection.run` follows the cluster from there.
    """
    generation = _io.loop_generation()
    direct = conn._direct
    route = conn.cluster_route
    node = None if route is None else _cluster_direct_node(conn, route)
    if direct is not None and conn._direct_generation == generation and conn._direct_node == node:
        return None if conn.closed else direct
    with _DIRECT_LOCK:
        return _make_direct(conn, generation, node)

def _cluster_direct_node(conn: Connection, route: ClusterRoute) -> tuple[str, int] | None:
    """The master a direct client may talk to: the slot's, when the IO-loop client is set up on it."""
    node = route.node
    if route.stale or node is None or node != conn._client_node or conn._runner is None:
        return None
    return node

def _make_direct(conn: Connection, generation: int, node: tuple[str, int] | None = None) -> redis.Redis | None:
    """:func:`direct_client`'s slow path, under ``_DIRECT_LOCK``; ``node``: on a cluster,
    the slot's master (None: no direct client for now)."""
    direct = conn._direct
    if direct is not None and conn._direct_generation == generation:
        if conn._direct_node == node:
            return None if conn.closed else direct  # another thread made it meanwhile
        # the slot's master changed: another thread may still be in a call on the old client,
        # whose pool is disconnected at close()
        conn._direct_retired.append(direct)
        conn._direct = None
    elif direct is not None:
        INHERITED_CLIENTS.append(direct)  # inherited through fork(): never close the parent's sockets
        conn._direct = None
    if conn.closed or conn._runner is None or conn._generation != generation or conn.sentinel_route is not None:
        return None
    if conn.cluster_route is not None and node is None:
        return None
    if not _wire.direct_ok():  # a redis-py without the parts the blocking drivers use
        return None
    sync_class = _DIRECT_CLASSES.get(conn._connection_class)
    kw = conn._conn_kwargs
    if sync_class is None or kw.get("redis_connect_func") is not None or kw.get("credential_provider") is not None:
        return None
    kwargs = {name: kw[name] for name in _DIRECT_KWARGS if name in kw}
    if node is not None:
        kwargs.update(host=node[0], port=node[1])
    if kwargs.get("socket_timeout") is None:
        kwargs["socket_timeout"] = conn.timeout
    if conn.durability is not None:
        sync_class = _durability.durable_class(sync_class)
        kwargs["tdstore_durability"] = conn.durability
    try:
        pool = redis.ConnectionPool(
            connection_class=sync_class, retry=redis.retry.Retry(NoBackoff(), 0), retry_on_error=[], **kwargs
        )
        direct = redis.Redis(connection_pool=pool)
    except (TypeError, ValueError):  # settings the blocking client does not take: stay on the IO loop
        return None
    conn._direct, conn._direct_generation, conn._direct_node = direct, generation, node
    return direct

def direct_call(conn: Connection, call: Callable[[redis.Redis], T]) -> T | object:
    """``call(client)`` on :func:`direct_client` from the calling thread, or :data:`NOT_DIRECT`.

    :data:`NOT_DIRECT` when there is no direct client, on the IO loop's own thread
    (where a blocking call would stall every store of the process; run() raises
    EventLoopError there), or when the call failed for a reason other than a read
    timeout (a lost connection, a script the server forgot, a server refusing a MULTI
    over its maxmemory...): the caller then runs it through :meth:`Connection.run`, which applies
    the retry policy and names the problem.
    """
    client = conn.direct_client()
    if client is None or threading.current_thread() is _io._thread:
        return NOT_DIRECT
    durability = conn.durability
    if durability is not None:
        outcome, token = _durability.begin()
    try:
        result = call(client)
    except TDStoreError:
        raise
    except redis.exceptions.TimeoutError as err:
        if retry_class(err) is None:  # the server did not answer in time (not: could not connect)
            raise _translate.translate(err, conn, client=client, limit=conn.timeout) from err
        return NOT_DIRECT
    except (redis.exceptions.RedisError, OSError):
        return NOT_DIRECT
    finally:
        if durability is not None:
            _durability.end(token)
    conn._reached = True
    if durability is not None:
        _durability.finish(outcome, durability, conn.what())
    return result
