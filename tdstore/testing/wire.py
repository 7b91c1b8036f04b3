"""Read a server's whole keyspace, for "the wire state is unchanged" assertions.

``wire_snapshot(server)`` returns ``{key: (type, value)}`` for every key in the
connected database, read with a plain synchronous client (bytes replies):

==========  ==========================================================
type        value
==========  ==========================================================
``string``  ``bytes`` (GET)
``hash``    ``dict[bytes, bytes]`` (HGETALL)
``list``    ``tuple[bytes, ...]`` (LRANGE 0 -1)
``set``     ``frozenset[bytes]`` (SMEMBERS)
``zset``    ``tuple[tuple[bytes, float], ...]`` (ZRANGE 0 -1 WITHSCORES)
``stream``  ``tuple[tuple[bytes, dict[bytes, bytes]], ...]`` (XRANGE - +)
other       ``bytes`` from DUMP (module types), compared as opaque blobs
==========  ==========================================================

TTLs are not part of the snapshot (they tick down between snapshots).
Snapshots are meant for a quiescent server: a key deleted between SCAN and
its read is left out.
"""

from __future__ import annotations

from typing import Any

import redis

from tdstore.server import ServerHandle

__all__ = ["WireSnapshot", "wire_snapshot"]

WireSnapshot = dict[bytes, tuple[bytes, object]]


def _read_value(client: Any, key: bytes, kind: bytes) -> Any:
    # `client` is a redis.Redis; typed Any because redis-py's reply types are
    # unions of sync/async and str/bytes that bytes-mode clients never return.
    if kind == b"string":
        return client.get(key)
    if kind == b"hash":
        return dict(client.hgetall(key))
    if kind == b"list":
        return tuple(client.lrange(key, 0, -1))
    if kind == b"set":
        return frozenset(client.smembers(key))
    if kind == b"zset":
        return tuple((member, float(score)) for member, score in client.zrange(key, 0, -1, withscores=True))
    if kind == b"stream":
        return tuple((entry_id, dict(fields)) for entry_id, fields in client.xrange(key, "-", "+"))
    return client.dump(key)


def wire_snapshot(server: ServerHandle | redis.Redis) -> WireSnapshot:
    """Every key on the server with its TYPE and full value.

    Args:
        server: A server handle (its :meth:`ServerHandle.sync_client` is used)
            or an already-connected synchronous client that returns bytes.

    Returns:
        ``{key: (type, value)}``; see the module docstring for value shapes.
        Two snapshots compare equal exactly when every key, type and value is
        byte-for-byte the same.
    """
    own_client = isinstance(server, ServerHandle)
    client: Any = server.sync_client() if isinstance(server, ServerHandle) else server
    try:
        snapshot: WireSnapshot = {}
        for key in client.scan_iter(count=1000):
            kind = client.type(key)
            if isinstance(kind, str):  # a client made with decode_responses
                raise TypeError("wire_snapshot needs a client that returns bytes (no decode_responses)")
            if kind == b"none":  # vanished since SCAN returned it
                continue
            value = _read_value(client, key, kind)
            if value is None:  # vanished between TYPE and the read
                continue
            snapshot[key] = (kind, value)
        return snapshot
    finally:
        if own_client:
            client.close()
