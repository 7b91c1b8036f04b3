"""The connection a store and its nested sub-stores share: client, keys, scripts, metadata cache.

The redis client belongs to the process's IO loop (:mod:`tdstore._backend.loop`). After a ``fork()``
the loop is replaced, and the connection builds a new client from the same settings on
first use, so a store inherited by a forked DataLoader worker keeps working.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import redis
import redis.asyncio
import redis.asyncio.retry
import redis.exceptions
import redis.retry
from redis.backoff import NoBackoff

from tdstore._backend import append as _append
from tdstore._backend import blocking as _blocking
from tdstore._backend import cluster as _cluster
from tdstore._backend import credentials as _credentials
from tdstore._backend import direct as _direct
from tdstore._backend import durability as _durability
from tdstore._backend import loop as _io
from tdstore._backend import memory as _memory
from tdstore._backend import ops as _backend
from tdstore._backend import row_writes as _row_writes
from tdstore._backend import sentinel as _sentinel
from tdstore._backend import settings as _settings
from tdstore._backend import step as _step
from tdstore._backend import translate as _translate
from tdstore._backend.armed_write import ArmedSlot, write_runs_armed, write_runs_direct
from tdstore._backend.protocols import AsyncClient
from tdstore._backend.retry import (
    OutcomeUnknownError,
    RetryPolicy,
    ServerUnavailableError,
    resolve_policy,
    sleep_before_retry,
)
from tdstore._backend.scripts import ScriptRunner, probe_shebang
from tdstore._backend.translate import retry_class
from tdstore._core import chunks as _chunks
from tdstore._core.keys import StoreKeys
from tdstore._core.layout import Arg
from tdstore.errors import (
    ClientConfigError,
    EntryTooLargeError,
    StoreClosedError,
    clause,
)

if TYPE_CHECKING:
    from tdstore._core.codec import PicklePolicy

__all__ = ["Connection", "DEFAULT_MAX_BULK"]

T = TypeVar("T")

#: Redis's default proto-max-bulk-len, assumed when the server does not tell (CONFIG off).
DEFAULT_MAX_BULK = 512 * 1024 * 1024
#: The server's default client-query-buffer-limit (1 GiB): one command must fit in it.
DEFAULT_MAX_QUERY = 1024 * 1024 * 1024
#: Room left in the query buffer for a command's other arguments.
QUERY_MARGIN = 64 * 1024


def _config_int(reply: Any, name: str, default: int) -> int:
    """A CONFIG GET value as an int; ``default`` when refused (ACL, a managed service) or absent."""
    if not isinstance(reply, dict):
        return default
    value = reply.get(name.encode()) or reply.get(name)
    try:
        return int(value) if value is not None else default
    except (TypeError, ValueError):
        return default

#: a script that answers 1 where the server's Lua has the struct library (an error or 0
#: elsewhere: reading a global it lacks is an error under Redis's sandbox). It calls no
#: command, so a store with ``durability=`` sends no WAIT after it (durability.writes), and
#: it goes with the no-writes flag where the server takes flags (allowed past maxmemory)
_STRUCT_PROBE = "return type(struct) == 'table' and 1 or 0"

#: guards the layout cache of every Connection (threads sharing a handle update it)
_LAYOUT_LOCK = threading.Lock()


class Connection:
    """Settings and live client of one store (shared by its nested sub-stores)."""

    #: where the credentials of an unpickled connection came from (None: nowhere)
    _credentials_from: str | None
    #: progress= of the store: None (automatic), True or False; shared by sub-handles
    progress: bool | None = None
    #: chunk_bytes= of the handle that creates the store (the server's meta field "cb" rules after)
    chunk_bytes: int | None = None

    @property
    def layout(self) -> _backend.Layout | None:
        """The layout last read from the server (shared by every handle of this store)."""
        return self._layout

    @layout.setter
    def layout(self, layout: _backend.Layout | None) -> None:
        """None drops the cached layout (and starts a new cache epoch, see :meth:`cache_layout`);
        a layout replaces it unless it is older than the one cached."""
        with _LAYOUT_LOCK:
            if layout is None:
                self.layout_epoch += 1
                self._layout = None
            elif self._layout is None or layout.lv >= self._layout.lv:
                self._put_layout(layout)

    _layout: _backend.Layout | None = None
    #: bumped each time the cached layout is dropped (a write changed it, the store went away)
    layout_epoch: int = 0

    def cache_layout(self, layout: _backend.Layout, epoch: int) -> bool:
        """Caches ``layout``, read from the server when the cache epoch was ``epoch``, unless
        the cache was dropped since (a write of another thread may have come after the read:
        the layout could be older than that thread's own write) or holds a newer layout.
        Threads sharing one handle so never see the cache go back to an older layout."""
        with _LAYOUT_LOCK:
            if epoch != self.layout_epoch or (self._layout is not None and layout.lv < self._layout.lv):
                return False
            self._put_layout(layout)
            return True

    def _put_layout(self, layout: _backend.Layout) -> None:
        # the chunking of the entries goes with it: key names are planned from one layout
        chunks = layout.memo.get("chunks")
        if chunks is None:
            chunks = layout.memo["chunks"] = _chunks.chunk_map(layout.entries)
        self.keys.chunks = chunks
        self._layout = layout

    def _start_live(self) -> None:
        """The state of a connection not yet used: no client, nothing cached, nothing armed
        (a new connection's, and an unpickled one's)."""
        self.closed = False
        self.layout: _backend.Layout | None = None
        self._client: Any = None
        self._generation = -1
        self._runner: ScriptRunner | None = None
        self._client_node: tuple[str, int] | None = None  # on a cluster: the master the IO-loop client is to
        self._retired: list[tuple[int, AsyncClient]] = []  # (loop generation, client) replaced by node_client()
        self._direct: redis.Redis | None = None  # see direct_client()
        self._direct_generation = -1
        self._direct_node: tuple[str, int] | None = None  # on a cluster: the master the direct client is to
        self._direct_retired: list[redis.Redis] = []  # direct clients to a slot's former master
        self.armed_slot = ArmedSlot()  # see tdstore/_backend/armed_write.py: the IO-loop client's
        self.direct_slot = ArmedSlot()  # ... and the direct client's
        self.append_slot = ArmedSlot()  # the direct client's armed appends (tdstore/_backend/append.py)
        #: the last read of the ring showed it full and without a rate limiter: sample() draws
        #: its rows before reading their flags (tdstore/store/ring.py)
        self.ring_full = False
        #: reads left before an indexed read goes between two MULTIs again, after one whose
        #: bracket showed a write (tdstore/_backend/reads.py, unwritten_bracket)
        self.split_cool = 0
        self.max_bulk = DEFAULT_MAX_BULK
        self.max_query = DEFAULT_MAX_QUERY

    def __init__(
        self,
        *,
        host: str,
        port: int,
        db: int,
        unix_socket_path: str | None,
        client: redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster | None,
        prefix: str,
        td_id: str,
        timeout: float,
        redis_kwargs: dict[str, Any],
        pickle_policy: PicklePolicy | None = None,
        retry: RetryPolicy | int | bool | None = None,
    ) -> None:
        from tdstore._core.codec import default_pickle_policy

        self.retry_policy = resolve_policy(retry)

        self.pickle_policy = pickle_policy if pickle_policy is not None else default_pickle_policy()
        self.keys = StoreKeys(prefix, td_id)
        self.timeout = timeout
        self._start_live()
        redis_kwargs = dict(redis_kwargs)
        # opt-in: pickles of this store carry its password (in clear); see _credentials
        self.pickle_secrets = bool(redis_kwargs.pop("pickle_secrets", False))
        self._secrets_dropped: list[str] = []
        cluster_nodes = redis_kwargs.pop("cluster_nodes", None)
        # durability= (see tdstore/_backend/durability.py): WAIT/WAITAOF at the end of each writing packet
        self.durability = _durability.parse(
            redis_kwargs.pop("durability", None), redis_kwargs.pop("durability_timeout", None), timeout,
            f"TensorDictStore(td_id={td_id!r})",
        )
        # how the keywords reach the server: the classes, the pool's keywords, a cluster or Sentinel route
        how = _settings.client_settings(
            host=host, port=port, db=db, unix_socket_path=unix_socket_path, client=client, redis_kwargs=redis_kwargs,
            cluster_nodes=cluster_nodes, timeout=timeout, td_id=td_id,
        )
        self.cluster_route, self.sentinel_route = how.cluster_route, how.sentinel_route
        self._client_class, self._pool_class, self._connection_class = how.client_class, how.pool_class, how.connection_class
        self._conn_kwargs = how.conn_kwargs
        self._credentials_from = how.credentials_from
        # Replies parsed from a socket are fresh bytes objects that only tdstore holds;
        # an in-process server (fakeredis) may hand out its own stored objects.
        self.owned_replies = self._connection_class.__module__.startswith("redis.")

    @property
    def routed(self) -> bool:
        """Whether the node is found per call (a cluster slot's master, a Sentinel's master): no
        connection of the IO loop kept armed across calls (on a cluster the direct client may
        be, see :meth:`direct_client`; under Sentinel there is none)."""
        return self.cluster_route is not None or self.sentinel_route is not None

    # -- description -------------------------------------------------------------------
    @property
    def pool_kwargs(self) -> dict[str, Any]:
        """A copy of the keywords this connection's pool is built with (``host`` and ``port``,
        or ``path``; ``db``...; ``server`` for an in-process fakeredis server)."""
        return dict(self._conn_kwargs)

    def describe(self) -> str:
        kw = self._conn_kwargs
        if self.sentinel_route is not None:
            return f"{self.sentinel_route.describe()} db={kw.get('db', 0)}"
        if self.cluster_route is not None:
            node = self._client_node or self.cluster_route.node or self.cluster_route.startup[0]
            return f"Redis Cluster node {node[0]}:{node[1]} (of {len(self.cluster_route.nodes)} known)"
        if "path" in kw:
            where = f"unix://{kw['path']}"
        elif "host" in kw:
            where = f"{kw['host']}:{kw['port']}"
        else:
            where = self._connection_class.__name__
        return f"{where} db={kw.get('db', 0)}"

    def pickle_state(self) -> dict[str, Any]:
        kwargs = dict(self._conn_kwargs)
        if kwargs.get("server") is not None or not self.owned_replies:
            raise TypeError(
                "a TensorDictStore on an in-process server (fakeredis) cannot be pickled: "
                "another process cannot reach that server"
            )
        # secrets stay in this process unless the store opted in (pickle_secrets=True)
        dropped = [] if self.pickle_secrets else _credentials.strip_secrets(kwargs)
        return {
            "pickle_secrets": self.pickle_secrets,
            "secrets_dropped": dropped,
            "client_class": self._client_class,
            "pool_class": self._pool_class,
            "connection_class": self._connection_class,
            "conn_kwargs": kwargs,
            "prefix": self.keys.prefix,
            "td_id": self.keys.td_id,
            "timeout": self.timeout,
            # the signing key is a secret: a process that unpickles the store takes it from
            # its own default (set_pickle_policy / TDSTORE_PICKLE_KEY)
            "allow_pickle": self.pickle_policy.allow,
            "retry": self.retry_policy,
            "cluster_nodes": self.cluster_route.nodes if self.cluster_route is not None else None,
            **_sentinel_state(self.sentinel_route),
            "durability": self.durability,
        }

    @classmethod
    def from_pickle_state(cls, state: dict[str, Any]) -> Connection:
        from tdstore._core.codec import PicklePolicy, default_pickle_policy

        self = cls.__new__(cls)
        default = default_pickle_policy()
        self.pickle_policy = PicklePolicy(bool(state.get("allow_pickle", True)) and default.allow, default.key)
        self.keys = StoreKeys(state["prefix"], state["td_id"])
        self.timeout = state["timeout"]
        self.retry_policy = state.get("retry") or RetryPolicy.from_env()
        nodes = state.get("cluster_nodes")
        self.cluster_route = _cluster.ClusterRoute(nodes) if nodes else None
        sentinels = state.get("sentinels")
        self.sentinel_route = (
            _sentinel.SentinelRoute(sentinels, state["service_name"], state.get("sentinel_kwargs")) if sentinels else None
        )
        self.durability = state.get("durability")
        self._start_live()
        self._client_class = state["client_class"]
        self._pool_class = state["pool_class"]
        self._connection_class = state["connection_class"]
        self._conn_kwargs = state["conn_kwargs"]
        self.owned_replies = self._connection_class.__module__.startswith("redis.")
        self.pickle_secrets = bool(state.get("pickle_secrets", False))
        self._secrets_dropped = list(state.get("secrets_dropped", ()))
        self._credentials_from = state.get("credentials_from")
        if self._secrets_dropped:
            self._conn_kwargs = dict(self._conn_kwargs)
            self._credentials_from = _credentials.fill_from_env(self._conn_kwargs)
        return self

    def sibling(self, td_id: str) -> Connection:
        """A connection with the same settings to another store of the same server."""
        state = {
            "client_class": self._client_class,
            "pool_class": self._pool_class,
            "connection_class": self._connection_class,
            "conn_kwargs": self._conn_kwargs,
            "prefix": self.keys.prefix,
            "td_id": td_id,
            "timeout": self.timeout,
            "retry": self.retry_policy,
            "cluster_nodes": self.cluster_route.nodes if self.cluster_route is not None else None,
            **_sentinel_state(self.sentinel_route),
            "durability": self.durability,
            "pickle_secrets": self.pickle_secrets,
            "credentials_from": getattr(self, "_credentials_from", None),
        }
        sibling = Connection.from_pickle_state(state)
        sibling.pickle_policy = self.pickle_policy
        return sibling

    # -- running -----------------------------------------------------------------------
    def _build_client(self, node: tuple[str, int] | None = None) -> AsyncClient:
        # tdstore retries by its own policy (run()); redis-py's default Retry would re-send a
        # command whose connection broke mid-flight, and re-sending extend() double-applies it
        kwargs = {**self._conn_kwargs, "retry": redis.asyncio.retry.Retry(NoBackoff(), 0), "retry_on_error": []}
        route = self.cluster_route or self.sentinel_route
        if route is not None:
            self._client_node = node = node or route.node or route.startup[0]
            kwargs.update(host=node[0], port=node[1])
        connection_class = self._connection_class
        if self.durability is not None:
            connection_class = _durability.durable_class(connection_class)
            kwargs["tdstore_durability"] = self.durability
        pool = self._pool_class(connection_class=connection_class, **kwargs)
        return _io.track(self._client_class(connection_pool=pool))  # disconnected at exit

    def node_client(self, node: tuple[str, int] | None) -> Any:
        """The client to cluster master ``node`` (on the IO loop); replaces the one to another node."""
        if node != self._client_node:
            if self._client is not None:
                # it may still serve another thread's call: closed in close(), if this process made it
                self._retired.append((self._generation, self._client))
            self._client = self._build_client(node)
            self._runner = None
        return self._client

    def closed_error(self) -> StoreClosedError:
        return StoreClosedError(
            f"TensorDictStore(td_id={self.keys.td_id!r}, prefix={self.keys.prefix!r}) is closed; "
            f"its data is still on the server: reconnect with "
            f"TensorDictStore.from_store(td_id={self.keys.td_id!r}, ...)"
        )

    def run(self, fn: Callable[..., Awaitable[T]], timeout: float | None = None, *, idempotent: bool = True) -> T:
        """Runs ``fn(client)`` on the IO loop and returns its result.

        ``fn`` takes the client as its one positional argument; it is typed ``Callable[..., ...]``
        because the retry loops pass lambdas that bind their loop variables as defaults.

        A connection failure is retried by the store's :class:`~tdstore._backend.retry.RetryPolicy`
        when nothing was sent, or when ``fn`` is idempotent (running it twice leaves the same
        state as once). A non-idempotent ``fn`` whose connection broke mid-flight raises
        :class:`~tdstore._backend.retry.OutcomeUnknownError` instead; see docs/guarantees.md.
        """
        policy = self.retry_policy
        started = 0.0
        attempt = 0
        while True:
            attempt += 1
            sent = [False]  # whether fn started: a failure before it (connecting, setup) sent nothing of it
            try:
                result = self._run_once(fn, timeout, sent)
                self._reached = True
                return result
            except Exception as err:  # noqa: BLE001 - classified, re-raised unless retried
                kind = retry_class(err)
                if kind is None:
                    raise
                if kind == "unknown" and not sent[0]:
                    if not getattr(self, "_reached", False):
                        # a live socket that failed on first contact: a configuration problem
                        # (e.g. plain text to a TLS port), not a restart; retrying cannot help
                        raise
                    kind = "unsent"
                if kind == "unknown" and not idempotent:
                    raise OutcomeUnknownError(
                        f"the connection to {self.describe()} broke while a write to TensorDictStore("
                        f"td_id={self.keys.td_id!r}, prefix={self.keys.prefix!r}) was in flight ({err}); "
                        "the server applied all of it or none of it, but which is unknown, and this write "
                        "is not safe to send twice. Read the store to find out before writing again."
                    ) from err
                if attempt == 1:
                    started = time.monotonic()
                if not sleep_before_retry(policy, attempt, started):
                    raise ServerUnavailableError(
                        f"could not reach the server at {self.describe()} for TensorDictStore("
                        f"td_id={self.keys.td_id!r}, prefix={self.keys.prefix!r}): {clause(err)}. Gave up after "
                        f"{attempt} tries in {time.monotonic() - started:.1f} s ({policy.describe()}; "
                        "pass retry= to the store or set TDSTORE_RETRY to wait longer)."
                        + _nothing_applied(kind, err)
                    ) from err

    # -- direct calls (tdstore/_backend/direct.py) ------------------------------------
    def direct_client(self) -> redis.Redis | None:
        """A synchronous client for calls sent from the calling thread, or None
        (:func:`tdstore._backend.direct.direct_client`)."""
        return _direct.direct_client(self)

    def _direct_call(self, call: Callable[[redis.Redis], T]) -> T | object:
        """``call(client)`` on :meth:`direct_client` from the calling thread, or
        :data:`~tdstore._backend.direct.NOT_DIRECT` (:func:`tdstore._backend.direct.direct_call`)."""
        return _direct.direct_call(self, call)

    def what(self) -> str:
        """The store and its server, for messages."""
        return f"TensorDictStore(td_id={self.keys.td_id!r}, prefix={self.keys.prefix!r}) on {self.describe()}"

    def read(self, direct: Callable[..., T], fn: Callable[..., Awaitable[T]]) -> T:
        """Runs a read-only operation: ``direct(client, runner)`` on :meth:`direct_client`, else ``run(fn)``.

        Both must send the same read; a read changes nothing on the server, so running it
        again through :meth:`run` after a failed direct try is safe (see :meth:`_direct_call`).
        """
        result = self._direct_call(lambda client: direct(client, self._runner))
        # (``is _direct.NOT_DIRECT`` does not narrow ``T | object`` to T)
        return self.run(fn) if result is _direct.NOT_DIRECT else result  # type: ignore[return-value]

    def read_step(self, build: Callable[[ScriptRunner], _step.ReadStep[T]]) -> T:
        """Runs the read ``build(runner)`` (a :class:`~tdstore._backend.step.ReadStep`): on
        :meth:`direct_client` from the calling thread (the blocking driver), else, or when that
        try fails, on the IO loop (the asyncio driver, through :meth:`run`). Both send the same
        commands; a read changes nothing, so sending it again is safe.

        A read refused for its ``BITFIELD_RO`` (the setup found the command, and the server
        lost it since: an ACL changed, another server came up behind the address) is sent
        again without it, through the gather script, as where the setup's probe was refused."""
        try:
            return self._read_step_once(build)
        except redis.exceptions.ResponseError as err:
            runner = self._runner
            if runner is None or not runner.bitfield or "bitfield_ro" not in str(err).lower():
                raise
            runner.bitfield = False
            return self._read_step_once(build)

    def _read_step_once(self, build: Callable[[ScriptRunner], _step.ReadStep[T]]) -> T:
        result = self._direct_call(lambda client: _step.run_blocking(client, self._runner, build(self._runner)))  # type: ignore[arg-type]
        if result is not _direct.NOT_DIRECT:
            return result  # type: ignore[return-value]
        return self.run(lambda c: _step.run_async(c, self.keys, self.runner, build(self.runner)))

    def script(self, name: str, keys: Sequence[str], args: Sequence[Arg]) -> object:
        """One EVALSHA of script ``name`` that may be sent twice: a read, or a write whose
        second run leaves what the first did (the same bytes, the same priorities). From the
        calling thread on :meth:`direct_client` (one round trip, no hop to the IO loop: for a
        one-row write, the hop cost 3x the round trip), else, or when that try fails (NOSCRIPT,
        a lost connection, a redirection), through :meth:`run`. A script's TDS_* error raises
        its class either way.
        """

        def direct(client: redis.Redis) -> object:
            assert self._runner is not None  # (a direct client exists once the IO-loop client is set up)
            return _blocking.call_script(client, self._runner.sha(name), keys, args)

        result = self._direct_call(direct)
        if result is not _direct.NOT_DIRECT:
            return result
        return self.run(lambda c: self.runner.call(c, name, keys, args))

    def write_rows(
        self, groups: Sequence[tuple[tuple[str, ...], Sequence[tuple[int, int]], Any]], expected: str, *,
        check_lock: bool = False, whole: bool = False,
    ) -> None:
        """Writes large row runs: SETRANGEs in one MULTI, only if the layout is still version ``expected``.
        (``check_lock``, ``whole``: see :func:`~tdstore._backend.armed_write.write_runs_armed`; whole
        entries written in place go this way too.)

        One round trip on an armed connection (see tdstore/_backend/armed_write.py): the direct
        client's, from the calling thread, else the IO loop's; the plain WATCHed MULTI where
        no connection may be kept armed (cluster, in-process servers) or after contention. A
        direct write whose connection fails goes again through :meth:`run` (its retry
        policy, its errors): an indexed write of given values lands the same bytes twice as once.

        Raises:
            StaleLayoutError: the layout changed; re-plan the write.
        """
        keys = self.keys
        done = self._direct_call(
            lambda c: write_runs_direct(c, keys, self.direct_slot, groups, expected=expected, check_lock=check_lock, whole=whole)
        )
        if done is True:
            return
        if done is False or not self.owned_replies or self.routed:
            self.run(
                lambda c: _row_writes.write_runs_watched(
                    c, keys, self.runner, groups, expected=expected, check_lock=check_lock, small_via_script=not whole
                )
            )
        else:
            self.run(
                lambda c: write_runs_armed(
                    c, keys, self.runner, self.armed_slot, groups, expected=expected, check_lock=check_lock, whole=whole
                )
            )

    def append(self, plan: _append.AppendPlan) -> int:
        """One try of the ring append ``plan`` (rows reserved and written in one atomic step);
        returns the first row's index. On the direct client from the calling thread, else on
        the IO loop (not idempotent: a re-sent append would be refused, its reservation gone,
        or take rows twice; see tdstore/_backend/append.py)."""
        done = self._direct_call(lambda c: _append.append_direct(c, self.runner, plan, self.append_slot))
        if isinstance(done, int):
            return done
        return int(self.run(lambda c: _append.append_watched(c, self.runner, plan), idempotent=False))

    def _run_once(self, fn: Callable[[AsyncClient], Awaitable[T]], timeout: float | None, sent: list[bool]) -> T:
        if self.closed:
            raise self.closed_error()
        generation = _io.loop_generation()
        if self._client is None or self._generation != generation:
            if self._client is not None:
                # A client inherited through fork() shares its sockets with the parent:
                # closing it here (even by garbage collection) would cut the parent's
                # connections. Keep it referenced, unused, for the life of the process.
                _direct.INHERITED_CLIENTS.append(self._client)
            self._client = self._build_client()
            self._generation = generation
            self._runner = None
        client = self._client

        async def tracked(c: AsyncClient) -> T:
            sent[0] = True
            return await fn(c)

        async def routed() -> T:
            if self.cluster_route is not None:
                return await _cluster.call_routed(self, tracked, limit)
            if self.sentinel_route is not None:
                return await _sentinel.call_sentinel(self, tracked, limit)
            if self._runner is None:
                await self._setup(client)
            return await tracked(client)

        async def call() -> T:
            durability = self.durability
            if durability is None:
                return await routed()
            # (a task of its own on the IO loop: the outcome is this operation's; see durability.py)
            outcome, _ = _durability.begin()
            result = await routed()
            _durability.finish(outcome, durability, self.what())
            return result

        limit = self.timeout if timeout is None else timeout
        try:
            return _io.sync(call(), limit)
        except Exception as err:  # noqa: BLE001 - translated by the one table, re-raised
            exc = _translate.translate(err, self, client=client, limit=limit)
            if exc is err:
                raise
            raise exc  # noqa: B904 - its __cause__ is set by translate()

    # -- limits ------------------------------------------------------------------------
    def check_entry_size(
        self, path: tuple[str, ...], nbytes: int, where: str, what: str = "entry", chunk: int | None = None,
        sent: bool = True,
    ) -> None:
        """Refuses, before any byte is sent, a string larger than the server's proto-max-bulk-len.

        A bulk argument over the limit makes the server drop the connection (a BrokenPipe or
        reset on the client) and a SETRANGE beyond it fails half-way through a transaction, so
        the size is checked against the limit read when the connection was set up.
        ``chunk``: the chunk size of a chunked entry (its largest string). ``sent``: the
        bytes travel in one command (not a zero-fill on the server), which must also fit the
        server's client-query-buffer-limit, or the server closes the connection.
        """
        limit = self.max_bulk
        size = nbytes if chunk is None else min(chunk, nbytes)
        if size <= limit and sent and size + QUERY_MARGIN > self.max_query:
            raise EntryTooLargeError(
                f"{what} {path!r} of {where} is written as one command of {size} bytes, more than the server's "
                f"client-query-buffer-limit of {self.max_query} bytes allows (the server would close the "
                f"connection). Nothing was written ({_memory.mib(size)} on {self.describe()}). Raise the limit on the server "
                f"(CONFIG SET client-query-buffer-limit {_memory.suggest_limit(size + QUERY_MARGIN)}), or create the store "
                "with a smaller chunk_bytes (see docs/chunked.md)."
            )
        if size <= limit:
            return
        if chunk is not None:
            raise EntryTooLargeError(
                f"{what} {path!r} of {where} is kept in chunks of {chunk} bytes, more than the server's "
                f"proto-max-bulk-len of {limit} bytes for one string. Nothing was written. Create the store "
                f"with a smaller chunk_bytes (at most {limit}), or raise the limit on the server."
            )
        raise EntryTooLargeError(
            f"{what} {path!r} of {where} needs {nbytes} bytes, more than the server's "
            f"proto-max-bulk-len of {limit} bytes for one string. Nothing was written ({_memory.mib(nbytes)} > "
            f"{_memory.mib(limit)} on {self.describe()}). Either raise the limit on the server (CONFIG SET proto-max-bulk-len "
            f"{_memory.suggest_limit(nbytes)}, or proto-max-bulk-len in its config file), or split it into row-block "
            "strings that each fit: create the store with chunk_bytes=... (one slot, same atomicity; see "
            "docs/chunked.md) or spread it over shards with tdstore.ShardedStore(block_rows=...) (see docs/deployment.md)."
        )

    @property
    def lua_has_struct(self) -> bool:
        """Whether the server's Lua has the struct library (False until the first operation
        has set the connection up)."""
        return self._runner is not None and self._runner.struct

    @property
    def runner(self) -> ScriptRunner:
        assert self._runner is not None, "runner is set up by run()"
        return self._runner

    async def _setup(self, client: AsyncClient) -> None:
        try:
            shebang = await probe_shebang(client)  # the first command: it authenticates
        except redis.exceptions.ConnectionError as err:
            exc = _translate.translate(err, self, client=client, stage="setup")  # credentials, TLS
            if exc is err:
                raise
            raise exc  # noqa: B904 - its __cause__ is set by translate()
        # the two limits of one command's size, whether INFO answers (the memory guard) and which
        # scripts the server holds already, in one round trip; then only the missing ones are
        # loaded (a server's Lua compiles each script once, not once per handle)
        runner = ScriptRunner(shebang)
        async with client.pipeline(transaction=False) as pipe:
            pipe.config_get("proto-max-bulk-len")
            pipe.config_get("client-query-buffer-limit")
            pipe.info("memory")
            pipe.execute_command(*runner.exists_command())
            # (a read of the ring flags' first byte, a string or missing: a list when the server
            # has the command; an error when it lacks it or an ACL refuses it)
            pipe.execute_command("BITFIELD_RO", self.keys.flags, "GET", "u8", "0")
            # (whether the server's Lua has struct: reading a global it lacks is an error there)
            pipe.execute_command("EVAL", ("#!lua flags=no-writes\n" if shebang else "") + _STRUCT_PROBE, 0)
            replies = await pipe.execute(raise_on_error=False)
        runner.bitfield = isinstance(replies[4], list)
        runner.struct = replies[5] == 1
        self.max_bulk = _config_int(replies[0], "proto-max-bulk-len", DEFAULT_MAX_BULK)
        self.max_query = _config_int(replies[1], "client-query-buffer-limit", DEFAULT_MAX_QUERY)
        _memory.note_setup(client, replies[2])
        if self.durability is not None:
            await self._check_durability(client)
        await runner.load_missing(client, replies[3])
        self._runner = runner

    async def _check_durability(self, client: AsyncClient) -> None:
        """Refuses, at first contact, a server that lacks the wait ``durability=`` sends."""
        durability = self.durability
        assert durability is not None
        try:
            await client.execute_command(*durability.probe())
        except redis.exceptions.ResponseError as err:
            raise ClientConfigError(
                f"{self.what()} was created with durability={durability.spec!r}, but the server refused "
                f"{durability.probe()[0]}: {err}. {durability.needs()}. Nothing was written."
            ) from err

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        client, self._client = self._client, None
        direct, self._direct = self._direct, None
        if direct is not None and self._direct_generation == _io.loop_generation():
            self.direct_slot.take(direct)  # (its connection is one of the pool's, disconnected next)
            self.append_slot.take(direct)
            for one in [direct, *self._direct_retired]:
                try:
                    one.connection_pool.disconnect()
                except Exception:  # noqa: BLE001 - closing is best effort
                    pass
        self._direct_retired = []
        if client is not None and self._generation == _io.loop_generation() and not _io.exiting():
            # (at exit the IO loop disconnected every client; a loop started now would not own them)
            armed = self.armed_slot.take(client)
            if armed is not None:
                try:
                    _io.sync(self.armed_slot.drop(armed), 5.0)
                except (Exception, asyncio.CancelledError):  # noqa: BLE001 - closing is best effort
                    pass
            mine = [old for generation, old in self._retired if generation == self._generation]
            for old in [client, *mine]:
                try:
                    _io.sync(_io.aclose(old), 5.0)  # its pool too, on the IO loop that owns it
                except (Exception, asyncio.CancelledError):  # noqa: BLE001 - closing is best effort
                    pass
        self._retired = []


def _sentinel_state(route: _sentinel.SentinelRoute | None) -> _sentinel.Kwargs:
    """The Sentinel route's part of a pickle state (the master is asked again after unpickling)."""
    if route is None:
        return {}
    return {"sentinels": route.sentinels, "service_name": route.service_name, "sentinel_kwargs": route.sentinel_kwargs}


def _nothing_applied(kind: str | None, err: BaseException) -> str:
    """What a retry that gave up says of the operation's effect (its failure's retry class)."""
    if kind != "unsent":
        return ""
    if isinstance(err, _translate.ReserveReplyLost):
        return (
            " None of its rows was written; a reserve step that did run left its rows as a dead"
            " appender's (unflagged, never sampled, counted by ring_state().total)."
        )
    return " Nothing of this operation was applied."
