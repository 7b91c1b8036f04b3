"""Exception classes of tdstore, and the table that maps server-side error codes to them.

Every exception derives from :class:`TDStoreError`; each subclass also derives from the
builtin exception a TensorDict user would catch for the same mistake (``KeyError`` for an
unknown key, ``RuntimeError`` for a locked store, ...), so code written against
``TensorDict`` keeps working.

Lua scripts report errors as ``redis.error_reply("TDS_<CODE> message")``. :data:`LUA_ERRORS`
maps each code to the class raised here; ``tests/lua`` checks that the codes declared in
the script headers and this table agree both ways. The one table from server errors to
these classes (script codes, ACL and maxmemory refusals, lost connections, and which of
them are retried) is ``tdstore._backend.translate``; every call site goes through its
``translate()``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import redis.exceptions

__all__ = [
    "TDStoreError",
    "StoreNotFoundError",
    "StoreExistsError",
    "StoreClosedError",
    "StoreLockedError",
    "EntryNotFoundError",
    "EntryTooLargeError",
    "SchemaError",
    "BatchMismatchError",
    "ServerOutOfMemoryError",
    "WouldExceedMaxmemoryError",
    "DataLostError",
    "StaleLayoutError",
    "PartialWriteError",
    "WriteConflictError",
    "CorruptMetadataError",
    "FormatVersionError",
    "UnsupportedOperationError",
    "UnsafePayloadError",
    "ClientConfigError",
    "ServerAuthError",
    "ServerTLSError",
    "ServerPermissionError",
    "EventLoopError",
    "ServerUnavailableError",
    "OutcomeUnknownError",
    "DurabilityError",
    "ShardUnavailableError",
    "RateLimitTimeoutError",
    "KeyTypeError",
    "ServerNotFoundError",
    "CliError",
    "LUA_ERRORS",
    "translate_response_error",
]


class TDStoreError(Exception):
    """Root of every error raised by tdstore."""


class StoreNotFoundError(TDStoreError, KeyError):
    """No store with this ``td_id`` exists under this prefix on this server."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class StoreExistsError(TDStoreError, ValueError):
    """A new store was about to be created under a ``td_id`` that is already in use."""


class StoreClosedError(TDStoreError, RuntimeError):
    """The store was closed with ``close()``; reconnect with ``from_store``."""


class StoreLockedError(TDStoreError, RuntimeError):
    """The store is locked (``lock_()``), on the server, by this or another process."""


class EntryNotFoundError(TDStoreError, KeyError):
    """The key is not an entry of the store."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class EntryTooLargeError(TDStoreError, redis.exceptions.ResponseError):
    """An entry is larger than the server accepts for one string (``proto-max-bulk-len``)."""


class ServerOutOfMemoryError(TDStoreError, redis.exceptions.OutOfMemoryError):
    """The server refused a write because it is at its ``maxmemory`` limit; nothing was applied."""


class DataLostError(TDStoreError, LookupError):
    """An entry is registered but its bytes are gone from the server (evicted, or deleted by hand)."""


class SchemaError(TDStoreError, ValueError):
    """A schema, shape, dtype or batch size is invalid; nothing was written."""


class BatchMismatchError(SchemaError, RuntimeError):
    """A value's leading dims do not match the batch size it is set under; nothing was written.

    Also a ``RuntimeError``, the class TensorDict raises for the same call.
    """


# InplaceWriteError and ElementShapeError derive from tensordict's class for a value that does
# not fit an in-place write, so that code written for TensorDict catches them. They are made on
# first use (module __getattr__ below): importing tensordict (and torch) here would make every
# `import tdstore.errors` pay for them, the command line's included.
_TENSORDICT_ERRORS = ("InplaceWriteError", "ElementShapeError")


def _make_tensordict_errors() -> None:
    from tdstore._core.tdcompat import InplaceWriteErrorBase as td_inplace_write_error

    class InplaceWriteError(TDStoreError, td_inplace_write_error):
        """A value does not fit the entry it is written into in place (``set_``, ``update_``); nothing was written.

        Also an instance of the class TensorDict raises for the same write (so a ``ValueError``
        and a ``RuntimeError``).
        """

    class ElementShapeError(SchemaError, InplaceWriteError):
        """A value written at an index of a lazy store does not fit the element's shape; nothing was written."""

    for cls in (InplaceWriteError, ElementShapeError):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
        globals()[cls.__name__] = cls


def __getattr__(name: str) -> Any:
    if name in _TENSORDICT_ERRORS:
        _make_tensordict_errors()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class StaleLayoutError(TDStoreError, RuntimeError):
    """The layout changed on the server since this client read it.

    Raised inside tdstore only: operations refresh their metadata and retry. It reaches
    the caller only when the layout keeps changing through every retry.
    """


class WriteConflictError(TDStoreError, RuntimeError):
    """Another process wrote the store between a read-modify-write's read and its write.

    Raised inside tdstore only: the read-modify-write methods read again and retry.
    """


class PartialWriteError(TDStoreError, RuntimeError):
    """Part of a batched write was refused by the server; nothing of it was applied."""


class CorruptMetadataError(TDStoreError, ValueError):
    """Metadata read from the server is malformed or inconsistent with the stored bytes."""


class FormatVersionError(TDStoreError, RuntimeError):
    """The store was written with an on-server format this version cannot read."""


class UnsafePayloadError(TDStoreError, ValueError):
    """A pickled value was refused: pickle is switched off, or its signature does not verify."""


class UnsupportedOperationError(TDStoreError, NotImplementedError):
    """The method cannot work on data that lives on a server; the message names the alternative.

    Also a :class:`NotImplementedError` (itself a :class:`RuntimeError`), as TensorDict raises for
    methods a class does not implement.
    """


class ClientConfigError(TDStoreError, ValueError):
    """The redis client passed in is configured in a way tdstore cannot use."""


class ServerAuthError(TDStoreError, redis.exceptions.AuthenticationError):
    """The server refused the credentials (or needs some); the message names the user, never the password."""


class ServerTLSError(TDStoreError, redis.exceptions.AuthenticationError):
    """The TLS handshake failed, e.g. the server's certificate does not verify against the CA given.

    An ``AuthenticationError`` (so a ``ConnectionError``) because the server failed to prove who
    it is: retrying cannot help, so it is never retried.
    """


class ServerPermissionError(TDStoreError, redis.exceptions.NoPermissionError):
    """The server's ACL refused a command or key to this user; the message names the user and the prefix."""


class EventLoopError(TDStoreError, RuntimeError):
    """A blocking store method was called from inside tdstore's own event loop."""


class ServerUnavailableError(TDStoreError, redis.exceptions.ConnectionError):
    """The server could not be reached within the store's retry policy.

    Also a ``redis.exceptions.ConnectionError``, so code that catches redis-py's error keeps
    working.
    """


class OutcomeUnknownError(ServerUnavailableError):
    """The connection broke while a non-idempotent write was in flight.

    The server applied all of it or none of it (scripts and MULTI/EXEC are atomic), but the
    client cannot tell which, so it did not send it again. Read the store to find out.
    """


class DurabilityError(TDStoreError, RuntimeError):
    """A write of a store created with ``durability=`` was applied on the master, but fewer
    replicas than it requires acknowledged it (``WAIT``), or the master did not fsync it
    (``WAITAOF``), within ``durability_timeout=``. The data is written, not yet safe: a
    failover now may lose it. ``spec`` is the setting (``"replicas:1"``), ``detail`` the
    shortfall (for example "only 0 of the 1 replica it requires acknowledged it within 1 s").

    ``store``: where the write that fell short created a store (a constructor such as
    ``from_schema``, or a copy made on the server), the open handle of that store, which is
    on the master: use it, or ``store.clear_redis()``; None for every other write (and after
    pickling)."""

    def __init__(self, message: str, *, spec: str = "", detail: str = "") -> None:
        super().__init__(message)
        self.spec = spec
        self.detail = detail
        self.store: object = None  # (a TensorDictStore: errors.py imports no store module)

    def __reduce__(self) -> tuple[Callable[[str, str, str], DurabilityError], tuple[str, str, str]]:
        return (_durability_error, (str(self), self.spec, self.detail))


def _durability_error(message: str, spec: str, detail: str) -> DurabilityError:
    return DurabilityError(message, spec=spec, detail=detail)


class ShardUnavailableError(ServerUnavailableError):
    """A shard of a :class:`~tdstore.ShardedStore` could not be reached (its master is down);
    the message names the shard, its td_id and the node. ``sample(n, skip_unavailable=True)``
    draws from the reachable shards instead."""


class RateLimitTimeoutError(TDStoreError, TimeoutError):
    """The ring's rate limiter held an ``extend()`` or a ``sample()`` back for longer than its
    timeout (``store.set_rate_limit(timeout=...)``). Nothing of the call was applied: no row
    was written, and a sample was not counted."""


class KeyTypeError(TDStoreError, TypeError, KeyError):
    """A key that is neither a str nor a non-empty tuple of str.

    Also a ``KeyError``: that is what an in-memory TensorDict raises for such keys.
    """

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ServerNotFoundError(TDStoreError, RuntimeError):
    """No usable server of the requested kind could be found (:mod:`tdstore.server`).

    The message names the kind, every place that was searched (and why each
    candidate was rejected), and the command that installs the server.
    """


class CliError(TDStoreError):
    """A failure of the ``tdstore`` command, reported in one line on stderr (exit status ``code``)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


#: Error codes raised by the Lua scripts (``redis.error_reply("TDS_CODE ...")``).
LUA_ERRORS: dict[str, type[TDStoreError]] = {
    "TDS_STALE": StaleLayoutError,
    "TDS_CONFLICT": WriteConflictError,
    "TDS_LOCKED": StoreLockedError,
    "TDS_EXISTS": StoreExistsError,
    "TDS_NOSTORE": StoreNotFoundError,
    "TDS_NOENTRY": DataLostError,
    "TDS_PARTIAL": PartialWriteError,
    "TDS_BADARG": SchemaError,
    "TDS_RANGE": SchemaError,
    "TDS_BUSY": StaleLayoutError,  # a reader's lease holds the layout still (lua/lease.lua); writers wait
    "TDS_CORRUPT": CorruptMetadataError,  # a key of the store holds a value no tdstore write makes
}

_CODE_RE = re.compile(r"(TDS_[A-Z]+) ?(.*)", re.S)


def translate_response_error(err: redis.exceptions.ResponseError) -> Exception:
    """Returns the tdstore exception for a script error, or ``err`` itself if it is not one.

    Servers differ in how they wrap a script error: Redis 7 and Valkey pass the message
    through, Redis 6 and KeyDB prefix it with ``Error running script (call to f_...)``.
    The code is searched anywhere in the message so that both forms map the same way.
    """
    text = str(err)
    idx = text.find("TDS_")
    if idx < 0:
        return err
    match = _CODE_RE.match(text[idx:])
    if match is None or match.group(1) not in LUA_ERRORS:
        return err
    message = match.group(2).strip()
    # Redis 6 appends the script location after the message
    message = re.sub(r"\s*script: \w+, on @user_script:\d+\.?$", "", message)
    exc = LUA_ERRORS[match.group(1)](message)
    exc.__cause__ = err
    return exc


class WouldExceedMaxmemoryError(ServerOutOfMemoryError):
    """tdstore refused, before sending anything, a write that would take the server past its ``maxmemory``.

    A :class:`ServerOutOfMemoryError` (so a ``redis.exceptions.OutOfMemoryError``): code that
    catches the server's own refusal catches this one too. The message names the limit, the
    size asked for and the fix; see ``tdstore/_backend/memory.py`` and docs/deployment.md.
    """


def clause(err: BaseException | str) -> str:
    """``err``'s message without its closing period, to embed in a sentence of our own.

    redis-py's messages end in a period (``Error 111 connecting to localhost:6501. Connection
    refused.``); joined as ``f"{err}. Gave up ..."`` they would end in ``..``.
    """
    return str(err).rstrip().rstrip(".")
