"""The suite's options, parametrisation and session hooks; the fixtures live in ``tests/fixtures.py``.

Every fixture of ``tests/fixtures.py`` (servers, the store factories ``stores`` and ``make``, the
process ``pool``) is imported here, so test files take them by name. ``docs/contributing.md``
("Writing tests") says which fixture a new test takes and how it is parametrised.

Parametrisation
---------------
``pytest_generate_tests`` parametrises ``server`` (every backend), ``real_server`` (the real
ones), ``race_server`` (redis and valkey) and ``secure_server`` (the secured transports) over
the kinds that ``--backends`` selects, unless the test names the fixture in its own
``@pytest.mark.parametrize(..., indirect=True)``. A session in which no test ran fails.

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

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:  # so `import _wire` (and `fixtures`) works under any --import-mode
    sys.path.insert(0, _TESTS_DIR)

from fixtures import (  # noqa: E402, F401 - the fixtures are found here by name
    _BACKENDS_KEY,
    _EXTERNAL_KEY,
    _HANDLE_FIXTURES,
    ACL_ADMIN_PASSWORD,
    ACL_PASSWORD,
    ACL_RULES,
    ACL_USER,
    ALL_BACKENDS,
    CLUSTER,
    EXTERNAL,
    RACE_BACKENDS,
    REAL_BACKENDS,
    SECURE_KINDS,
    ServerPool,
    _selected_backends,
    acl_server,
    admin_handle,
    cluster_server,
    external_server,
    fake_server,
    make,
    pool,
    race_server,
    real_server,
    redis6_server,
    redis_server,
    secure_server,
    server,
    server_pool,
    stores,
    tls_files,
    tls_server,
    unchunked,
    valkey_server,
    wire,
)

from tdstore.server import ServerHandle  # noqa: E402

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


_RUN_STATE: dict[str, int] = {"ran": 0}  # tests whose call phase ran (not skipped)



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
        ("race_server", RACE_BACKENDS),
    ):
        if argname not in metafunc.fixturenames or _directly_parametrized(metafunc, argname):
            continue
        if argname == "secure_server":
            kinds = secure
        elif argname == "race_server":  # private servers, whatever --server-url says
            kinds = [kind for kind in universe if kind in backends]
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
# Isolation: flush after every test that used a shared server
# --------------------------------------------------------------------------- #


def _flush(handle: ServerHandle, servers: ServerPool | None) -> None:
    handle = admin_handle(handle)
    if handle.kind != EXTERNAL and servers is not None:
        servers.revive(handle)  # a test may have stopped it; the next test needs it
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
    servers: ServerPool | None = (
        request.getfixturevalue("server_pool") if any(h.kind != EXTERNAL for h in handles) else None
    )
    yield
    for handle in handles:
        _flush(handle, servers)


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
