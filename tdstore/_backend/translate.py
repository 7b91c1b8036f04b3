"""The one table from server and connection errors to tdstore's exceptions and retry classes.

Two declarative tables, read top to bottom, the first matching row wins:

- :data:`RULES`: which tdstore exception a redis-py error becomes (:func:`translate`). A row
  matches an error of one of its classes (and none of ``unless``) whose message matches its
  ``pattern``. Rows whose message needs the store (``needs_store``: it names the store, the
  server, the user) apply only where the connection is given, in ``Connection.run``; the
  script rows (``TDS_*`` codes, :data:`tdstore.errors.LUA_ERRORS`) apply everywhere a script
  reply is read. ``stage="setup"`` rows apply only to the first command of a new client
  (the one that authenticates and makes the TLS handshake).
- :data:`RETRY_RULES`: which failures a store's retry policy may try again
  (:func:`retry_class`): ``"unsent"`` (nothing of the operation reached the server),
  ``"unknown"`` (the connection broke with the operation in flight) or ``None`` (never
  retried). See :mod:`tdstore._backend.retry` for what the store does with each.

``tests/test_translate.py`` walks both tables: each row's example error maps to what the row
documents.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis.exceptions

from tdstore._backend import credentials as _credentials
from tdstore._backend import loop as _io
from tdstore._backend.protocols import AsyncClient, SyncClient
from tdstore.errors import (
    LUA_ERRORS,
    CorruptMetadataError,
    ServerAuthError,
    ServerOutOfMemoryError,
    ServerPermissionError,
    ServerTLSError,
    TDStoreError,
    WouldExceedMaxmemoryError,
    translate_response_error,
)

if TYPE_CHECKING:
    from tdstore._backend.connection import Connection

__all__ = ["Rule", "RetryRule", "RULES", "RETRY_RULES", "translate", "retry_class", "rule_for", "is_tls_failure"]


@dataclass(frozen=True)
class Context:
    """What a message needs: the store's connection, the client the call ran on, the call's timeout."""

    conn: Any  # (the rules that read it apply only where it is given)
    client: Any = None
    limit: float | None = None


# -- the messages (they need the store) ---------------------------------------------------
def _timeout(err: BaseException, ctx: Context) -> BaseException:
    # the socket timeout fired first: report it like the call timeout
    return TimeoutError(f"the server did not answer within {ctx.limit} s (set timeout= on the store to wait longer)")


def _permission(err: BaseException, ctx: Context) -> BaseException:
    conn = ctx.conn
    prefix = conn.keys.prefix
    return ServerPermissionError(
        f"the server {conn.describe()} refused a command of TensorDictStore(td_id={conn.keys.td_id!r}, "
        f"prefix={prefix!r}) to {_credentials.who(conn._conn_kwargs)}: {str(err).rstrip('.')}. The user's ACL "
        f"must cover the store's keys (~{prefix}:*) and the commands tdstore uses (+@all -@dangerous is "
        "enough; +info +config|get help)."
    )


def _out_of_memory(err: BaseException, ctx: Context) -> BaseException:
    """The error for a refused write; drops the pool's connections first.

    redis-py may leave a refused transaction's EXEC reply unread on its connection, so
    the next call must start on a fresh one.
    """
    conn = ctx.conn
    try:
        _io.sync(ctx.client.connection_pool.disconnect(), 5.0)
    except Exception:  # noqa: BLE001 - best effort; the error is what matters
        pass
    return ServerOutOfMemoryError(
        f"the server refused a write to TensorDictStore(td_id={conn.keys.td_id!r}, "
        f"prefix={conn.keys.prefix!r}) on {conn.describe()}: it is at its maxmemory limit "
        f"({_maxmemory(conn)}). Nothing of this operation was applied. Free memory, raise "
        "maxmemory, or delete stores you no longer need (clear_redis())."
    )


def _maxmemory(conn: Connection) -> str:
    async def read(client: AsyncClient) -> Any:
        return await client.config_get("maxmemory")

    try:
        reply = _io.sync(read(conn._client), 5.0)
        value = reply.get("maxmemory") or reply.get(b"maxmemory")
        return f"maxmemory {int(value):,} bytes"
    except Exception:  # noqa: BLE001 - CONFIG may be disabled; the message still stands
        return "maxmemory"


def _over_maxmemory(err: BaseException, ctx: Context) -> bool:
    """Whether the server is at its maxmemory (why it refused to queue a MULTI's commands)."""

    async def read(c: AsyncClient) -> Any:
        return await c.info("memory")

    try:
        info = _io.sync(read(ctx.client), 5.0)
        limit = int(info.get("maxmemory", 0))
        return bool(limit) and int(info.get("used_memory", 0)) >= limit
    except Exception:  # noqa: BLE001 - INFO may be disabled
        return False


def _auth(err: BaseException, ctx: Context) -> BaseException:
    conn = ctx.conn
    kw = conn._conn_kwargs
    reason = str(err).rstrip(".")  # the server's text names no secret ("WRONGPASS invalid ...")
    if kw.get("password") is None and kw.get("credential_provider") is None:
        problem = f"refused {_credentials.who(kw)}: no password was given ({reason})"
        hint = _credentials.missing_hint(conn._secrets_dropped)
    else:
        given = f", taken from {conn._credentials_from}" if conn._credentials_from else ""
        problem = f"refused the credentials of {_credentials.who(kw)}{given} ({reason})"
        hint = "Check the user name and password (or the credential provider), and that the user is enabled."
    exc = ServerAuthError(
        f"the server {conn.describe()} {problem} for TensorDictStore(td_id={conn.keys.td_id!r}, "
        f"prefix={conn.keys.prefix!r}). {hint}"
    )
    exc.__cause__ = None  # no chained frames holding the client's kwargs
    return exc


def _tls(err: BaseException, ctx: Context) -> BaseException:
    conn = ctx.conn
    ca = conn._conn_kwargs.get("ssl_ca_certs") or conn._conn_kwargs.get("ssl_ca_path") or "the system CAs"
    return ServerTLSError(
        f"TLS handshake with {conn.describe()} failed for TensorDictStore(td_id={conn.keys.td_id!r}): {str(err).rstrip('.')}. "
        f"The server's certificate must be signed by the CA given (ssl_ca_certs={ca!r}) and name the "
        "host connected to; a server that requires client certificates needs ssl_certfile= and ssl_keyfile=."
    )


def is_tls_failure(err: BaseException, ctx: Context | None = None) -> bool:
    """Whether ``err`` or an error it was raised from is an SSL error."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, ssl.SSLError) or "SSL" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _wrong_type(err: BaseException, ctx: Context) -> BaseException:
    keys = ctx.conn.keys
    return CorruptMetadataError(
        f"a key of TensorDictStore(td_id={keys.td_id!r}, prefix={keys.prefix!r}) holds another type of value "
        f"than tdstore writes there (damaged, or written by hand): {str(err).rstrip('.')}. clear_redis() deletes "
        "the store"
    )


def _script(err: BaseException, ctx: Context | None) -> BaseException:
    return translate_response_error(err)  # type: ignore[arg-type]


# -- the tables ----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Row:
    """A row of either table: errors of class ``error`` (and not ``unless``) whose message matches ``pattern``."""

    name: str
    error: tuple[type[BaseException], ...]
    pattern: str = ""
    unless: tuple[type[BaseException], ...] = ()
    #: a message the row matches (tests/test_translate.py builds ``error[0](example)``)
    example: str = ""
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_regex", re.compile(self.pattern, re.S))

    def matches(self, err: BaseException) -> bool:
        return (
            isinstance(err, self.error)
            and not isinstance(err, self.unless)
            and (not self.pattern or self._regex.search(str(err)) is not None)
        )


@dataclass(frozen=True, kw_only=True)
class Rule(_Row):
    """One row of :data:`RULES`: a matching error becomes ``raises`` (None: it is raised as it is).

    ``make`` builds it, ``when`` (if given) must also hold; ``needs_store``: the message
    names the store, so the row applies only where the connection is given; ``stage``:
    ``"run"``, or ``"setup"`` for the first command of a new client.
    """

    raises: type[BaseException] | None
    make: Callable[[BaseException, Any], BaseException] | None = None
    when: Callable[[BaseException, Any], bool] | None = None
    needs_store: bool = True
    stage: str = "run"


#: Server and connection errors -> tdstore exceptions; the first matching row wins.
RULES: tuple[Rule, ...] = (
    # first contact (Connection._setup): the command that authenticates and makes the TLS handshake
    Rule("credentials refused", (redis.exceptions.AuthenticationError,), raises=ServerAuthError, make=_auth,
         stage="setup", example="WRONGPASS invalid username-password pair or user is disabled."),
    Rule("TLS handshake failed", (redis.exceptions.ConnectionError,), raises=ServerTLSError, make=_tls, when=is_tls_failure,
         stage="setup", example="Error 1 connecting to localhost:6380. [SSL: CERTIFICATE_VERIFY_FAILED] certificate "
         "verify failed."),
    # refused before anything was sent by tdstore's own memory guard: its message says why
    Rule("refused by the memory guard", (WouldExceedMaxmemoryError,), raises=None, needs_store=False,
         example="TensorDictStore(td_id='x') refused a write: it would take the server past its maxmemory"),
    # a MULTI whose commands the server refused to queue; over maxmemory, Redis 7 and Valkey
    # refuse every queued command. Nothing of it ran.
    Rule("MULTI refused over maxmemory", (redis.exceptions.ExecAbortError,), raises=ServerOutOfMemoryError,
         make=_out_of_memory, when=_over_maxmemory,
         example="EXECABORT Transaction discarded because of previous errors."),
    Rule("write refused over maxmemory", (redis.exceptions.OutOfMemoryError,), raises=ServerOutOfMemoryError,
         make=_out_of_memory, example="OOM command not allowed when used memory > 'maxmemory'."),
    Rule("ACL refused", (redis.exceptions.NoPermissionError,), raises=ServerPermissionError, make=_permission,
         example="NOPERM this user has no permissions to access one of the keys used as arguments"),
    # Redis 6 and KeyDB (no script flags) refuse a script at its first write when over
    # maxmemory; the scripts validate before writing, so nothing was applied
    Rule("script write refused over maxmemory", (redis.exceptions.ResponseError,), raises=ServerOutOfMemoryError,
         pattern="OOM command not allowed", unless=(redis.exceptions.ExecAbortError,), make=_out_of_memory,
         example="Error running script (call to f_0123): @user_script:9: @user_script: 9: -OOM command not "
         "allowed when used memory > 'maxmemory'."),
    Rule("socket timeout", (redis.exceptions.TimeoutError,), raises=TimeoutError, make=_timeout,
         example="Timeout reading from socket"),
    # a key of the store edited by hand to another type (a list where a string belongs)
    Rule("key of another type", (redis.exceptions.ResponseError,), raises=CorruptMetadataError, pattern=r"WRONGTYPE",
         unless=(redis.exceptions.ExecAbortError,), make=_wrong_type,
         example="WRONGTYPE Operation against a key holding the wrong kind of value"),
    # the scripts' own errors: ``TDS_<CODE> message`` (Redis 6 and KeyDB wrap it)
    *(
        Rule(f"script error {code}", (redis.exceptions.ResponseError,), raises=cls, pattern=rf"{code}\b",
             make=_script, needs_store=False, example=f"{code} an example message")
        for code, cls in LUA_ERRORS.items()
    ),
)


def rule_for(err: BaseException, ctx: Context | None = None, *, stage: str = "run") -> Rule | None:
    """The first row of :data:`RULES` that applies to ``err`` (``ctx``: None where no store is at hand)."""
    for rule in RULES:
        if rule.stage != stage or (rule.needs_store and ctx is None) or not rule.matches(err):
            continue
        if rule.when is not None and not rule.when(err, ctx):
            continue
        return rule
    return None


def translate(
    err: BaseException, conn: Connection | None = None, *, client: AsyncClient | SyncClient | None = None, limit: float | None = None, stage: str = "run"
) -> BaseException:
    """The exception to raise for ``err``: ``err`` itself when no row of :data:`RULES` applies.

    ``conn``: the store's connection (its messages name the store and the server), None
    where only a script reply is at hand; ``client``: the client the call ran on; ``limit``:
    the call's timeout. The new exception's ``__cause__`` is ``err`` (None for refused
    credentials: no chained frames hold the client's settings), so ``raise`` it as it is.
    """
    ctx = Context(conn, client if client is not None else getattr(conn, "_client", None), limit) if conn is not None else None
    rule = rule_for(err, ctx, stage=stage)
    if rule is None or rule.make is None:
        return err
    exc = rule.make(err, ctx)
    if exc is not err and exc.__cause__ is None and not exc.__suppress_context__:
        exc.__cause__ = err
    return exc


@dataclass(frozen=True, kw_only=True)
class RetryRule(_Row):
    """One row of :data:`RETRY_RULES`: a matching failure is retried as ``retry``."""

    retry: str | None


_LOST = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


class ReserveReplyLost(redis.exceptions.ConnectionError):
    """The connection broke while an append's reserve step (tdstore/_backend/append.py) was in
    flight, before any of its rows was written. Sending the append again is safe: a reserve
    that did run leaves its rows unflagged, as an appender that died between its two steps
    does (never sampled, taken over when the ring comes round, counted by
    ``ring_state().total``), and the append writes its rows once, in the rows it reserves next."""

#: Failures -> retry class; the first matching row wins, no row: ``None`` (never retried).
RETRY_RULES: tuple[RetryRule, ...] = (
    RetryRule("server loading its data", (redis.exceptions.BusyLoadingError,), retry="unsent",
              example="Redis is loading the dataset in memory"),
    # another client's script runs past busy-reply-threshold (lua-time-limit): the server
    # refuses every command but SCRIPT KILL until it ends, and a MULTI it refused a
    # command of is discarded whole (EXECABORT), so nothing of this operation was applied
    RetryRule("server busy running a script", (redis.exceptions.ResponseError,), retry="unsent",
              pattern="(?=.*BUSY )(?=.*busy running a script)",
              example="BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSCRIPT."),
    # an append's reserve step: sent again (its rows, if it ran, are left as a dead appender's)
    RetryRule("connection lost during an append's reserve step", (ReserveReplyLost,), retry="unsent",
              example="the connection broke during the reserve step of an append: Connection closed by server."),
    # redis-py's report of a connection lost during WATCH, before MULTI: nothing was written
    RetryRule("connection lost while watching", (redis.exceptions.WatchError,), retry="unsent",
              pattern="occurred while watching",
              example="A ConnectionError occurred while watching one or more keys"),
    # wrong credentials or certificates, already diagnosed: retrying cannot help
    RetryRule("credentials refused", (redis.exceptions.AuthenticationError, TDStoreError), retry=None,
              example="invalid username-password pair"),
    # a TLS configuration problem, not a lost server
    RetryRule("TLS misconfigured", _LOST, retry=None, pattern="(?i)certificate|wrong version number|tlsv1 alert",
              example="Error 1 connecting to h:1. [SSL: WRONG_VERSION_NUMBER] wrong version number."),
    RetryRule("could not connect", _LOST, retry="unsent", pattern="connecting to|Timeout connecting",
              example="Error 111 connecting to 127.0.0.1:6379. Connection refused."),
    # a slow server, not a lost one: reported as the call's timeout
    RetryRule("slow server", (redis.exceptions.TimeoutError,), retry=None, example="Timeout reading from socket"),
    RetryRule("connection lost in flight", (redis.exceptions.ConnectionError,), retry="unknown",
              example="Connection closed by server."),
    RetryRule("socket reset in flight", (ConnectionResetError, BrokenPipeError, ConnectionAbortedError), retry="unknown",
              example="Connection reset by peer"),
)


def retry_class(err: BaseException) -> str | None:
    """``"unsent"``, ``"unknown"`` or ``None`` (not a connection failure: never retried), by :data:`RETRY_RULES`."""
    for rule in RETRY_RULES:
        if rule.matches(err):
            return rule.retry
    return None
