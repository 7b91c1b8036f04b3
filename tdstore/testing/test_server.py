"""The conformance suite on the server of ``--server-url`` (see :mod:`tdstore.testing`)."""

from __future__ import annotations

from tdstore.testing.suite import TensorDictStoreTests


class TestServer(TensorDictStoreTests):
    """Every conformance test, on the server given by URL (fewer random stores than in CI)."""

    index_configs = 10
    differential_seeds = 10
    nontensor_seeds = 4
    # the URL names one database over one transport: these would use another database (3) of
    # that server, and its unix socket
    test_db_argument = None  # type: ignore[assignment]
    test_unix_socket = None  # type: ignore[assignment]
