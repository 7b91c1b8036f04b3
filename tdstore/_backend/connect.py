"""Where and how a store handle connects: one :class:`ConnectSpec` for every constructor.

The store constructors (``TensorDictStore(...)``, ``from_dict``, ``from_tensordict``,
``from_schema``, ``from_store`` and the lazy class's) all take the same connection keywords.
Each public constructor gathers those it was given into a :class:`ConnectSpec` once and hands
that on (as the private ``_connect=`` keyword), so a connection keyword is added, checked and
forwarded in one place: here. :meth:`ConnectSpec.open` opens the handle's connection
(:func:`open_connection`, below; nothing is sent until the first call).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import redis.asyncio
import redis.asyncio.cluster

from tdstore._backend import loop as _io
from tdstore._backend import settings as _settings
from tdstore._backend.connection import Connection
from tdstore._backend.retry import RetryPolicy
from tdstore._backend.sentinel import Kwargs as _Kwargs

__all__ = ["ConnectSpec", "open_connection"]


@dataclass(frozen=True)
class ConnectSpec:
    """The connection keywords of the store constructors (their meaning: ``TensorDictStore``)."""

    host: str = "localhost"
    port: int = 6379
    db: int = 0
    unix_socket_path: str | None = None
    prefix: str = "tensordict"
    client: object = None
    timeout: float = _io.DEFAULT_TIMEOUT
    allow_pickle: bool | None = None
    pickle_key: bytes | str | None = None
    retry: object = None
    progress: bool | None = None
    #: what the constructors do not know: passed on to the redis-py client
    redis_kwargs: Mapping[str, Any] = field(default_factory=dict)

    #: the keyword that carries a spec from one constructor to the next
    KEYWORD: ClassVar[str] = "_connect"
    #: the fields given as keywords of their own (all but ``redis_kwargs``)
    NAMES: ClassVar[tuple[str, ...]] = (
        "host", "port", "db", "unix_socket_path", "prefix", "client", "timeout", "allow_pickle", "pickle_key",
        "retry", "progress",
    )  # fmt: skip

    # -- Redis Sentinel (tdstore/_backend/sentinel.py) --------------------------------
    #: ``redis+sentinel://h1:p1,h2:p2/service_name`` (or ``redis://host:port/db``, ``unix:///path``)
    url: str | None = None
    #: ``[(host, port), ...]`` of the Sentinels, with ``service_name``: the master they name
    sentinels: object = None
    service_name: str | None = None
    SENTINEL_NAMES: ClassVar[tuple[str, ...]] = ("url", "sentinels", "service_name")
    NAMES = NAMES + SENTINEL_NAMES
    # -- end of Redis Sentinel ---------------------------------------------------------

    # -- durability (tdstore/_backend/durability.py) -----------------------------------
    #: ``"replicas:N"`` (WAIT for N replicas after each write) or ``"fsync"`` (WAITAOF); None: no wait
    durability: str | None = None
    #: the seconds a write waits for them (default 1.0; below ``timeout``)
    durability_timeout: float | None = None
    DURABILITY_NAMES: ClassVar[tuple[str, ...]] = ("durability", "durability_timeout")
    NAMES = NAMES + DURABILITY_NAMES
    # -- end of durability -------------------------------------------------------------

    @classmethod
    def take(cls, kwargs: dict[str, Any], **given: Any) -> ConnectSpec:
        """The spec of a constructor call: the one handed on in ``kwargs`` (``_connect=``), or
        one made of ``given`` (the constructor's own connection parameters) and of the
        connection keywords in ``kwargs``. Either way those are popped from ``kwargs``, which
        keeps the store's own keywords (and unknown ones, for the redis-py client)."""
        handed = kwargs.pop(cls.KEYWORD, None)
        found = {name: kwargs.pop(name) for name in cls.NAMES if name in kwargs}
        if handed is not None:
            if not isinstance(handed, ConnectSpec):
                raise TypeError(f"{cls.KEYWORD}= takes a ConnectSpec, got {type(handed).__name__}")
            return dataclasses.replace(handed, **found) if found else handed
        return cls(**given, **found)

    def with_redis_kwargs(self, extra: Mapping[str, object]) -> ConnectSpec:
        """This spec with ``extra`` added to the keywords passed on to the redis-py client."""
        # (keywords of the spec itself given among them, e.g. sentinels= to TensorDictStore(): its fields)
        own: _Kwargs = {name: extra[name] for name in self.NAMES if name in extra}
        spec = dataclasses.replace(self, **own) if own else self
        rest = {name: value for name, value in extra.items() if name not in own}
        return dataclasses.replace(spec, redis_kwargs={**spec.redis_kwargs, **rest}) if rest else spec

    def open(self, td_id: str) -> Connection:
        """The connection of a handle of store ``td_id`` (checked; nothing sent yet)."""
        return open_connection(
            td_id=td_id, **{name: getattr(self, name) for name in self.NAMES}, **dict(self.redis_kwargs)
        )


def open_connection(
    *,
    td_id: str,
    host: str = "localhost",
    port: int = 6379,
    db: int = 0,
    unix_socket_path: str | None = None,
    client: redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster | None = None,
    prefix: str = "tensordict",
    timeout: float = _io.DEFAULT_TIMEOUT,
    allow_pickle: bool | None = None,
    pickle_key: bytes | str | None = None,
    retry: RetryPolicy | int | bool | None = None,
    progress: bool | None = None,
    **redis_kwargs: Any,
) -> Connection:
    """The connection of a store handle, from the connection keywords of ``TensorDictStore``.

    Both store classes open theirs here (the dense class in ``__init__``, the lazy one in
    its constructors). Nothing is sent: the client connects on the first call.
    """
    host, port, db, unix_socket_path = _settings.sentinel_url(td_id, host, port, db, unix_socket_path, redis_kwargs)
    host, port, unix_socket_path = _settings.connection_defaults(host, port, unix_socket_path)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    conn = Connection(
        host=host, port=port, db=db, unix_socket_path=unix_socket_path, client=client, prefix=prefix, td_id=td_id,
        timeout=timeout, redis_kwargs=redis_kwargs, pickle_policy=_settings.pickle_policy(allow_pickle, pickle_key), retry=retry,
    )
    conn.progress = progress  # progress=: None (auto), True or False; shared by sub-handles
    return conn
