"""The pytest plugin of tdstore (entry point ``pytest11``): ``--server-url`` and the suite's ``server``.

``pytest --pyargs tdstore.testing --server-url URL`` runs the conformance suite on that server:
``server`` (and ``real_server``) is it; its database must be empty when the run starts (the suite
runs ``FLUSHDB`` after every test). A host other than loopback needs ``--allow-remote-server``.
A conftest that defines its own ``server`` fixture (the repository's ``tests/conftest.py``)
overrides these fixtures and reads the same option.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tdstore.server import ServerHandle

_HANDLE = pytest.StashKey[ServerHandle]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tdstore.testing", "tdstore's conformance suite")
    group.addoption("--server-url", default=None, metavar="URL",
                    help="the server to check: redis://HOST:PORT/DB, rediss://... or unix:///path?db=N")
    group.addoption("--allow-remote-server", action="store_true", default=False,
                    help="accept a host other than loopback (the suite writes and flushes that database)")


def pytest_configure(config: pytest.Config) -> None:
    url = config.getoption("--server-url")
    if url is None:
        return  # the suite's `server` fixture says what is missing, if a test asks for it
    try:
        handle = ServerHandle.from_url(str(url), allow_remote=bool(config.getoption("--allow-remote-server")))
    except Exception as exc:  # noqa: BLE001 - any problem with the URL or the server stops the run here
        raise pytest.UsageError(f"--server-url {url!r}: {type(exc).__name__}: {exc}") from None
    with handle.sync_client(socket_timeout=30) as client:
        size = client.dbsize()
    if size:
        raise pytest.UsageError(
            f"--server-url {url!r}: the database holds {size} keys; the suite flushes its database after "
            "every test, so give it an empty one (another db number, e.g. .../15)"
        )
    config.stash[_HANDLE] = handle


@pytest.fixture
def server(pytestconfig: pytest.Config) -> Iterator[ServerHandle]:
    """The server of ``--server-url``; its database is flushed after the test."""
    handle = pytestconfig.stash.get(_HANDLE, None)
    if handle is None:
        pytest.fail(
            "tdstore.testing needs the server to check: pytest --pyargs tdstore.testing --server-url "
            "redis://127.0.0.1:6379/15 (an empty database: the suite flushes it after every test)",
            pytrace=False,
        )
    try:
        yield handle
    finally:
        with handle.sync_client(socket_timeout=30) as client:
            client.flushdb()


@pytest.fixture
def real_server(server: ServerHandle) -> ServerHandle:
    """The same server: it runs out of this process."""
    return server
