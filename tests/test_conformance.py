"""The conformance suite (:class:`tdstore.testing.TensorDictStoreTests`), one subclass per setting.

``tests/conftest.py`` gives each class's ``server`` a private server of its ``server_kind`` (and
``--backends`` selects which kinds run). The cluster setting lives in ``tests/test_cluster.py``.
"""

from __future__ import annotations

import redis

import tdstore
from tdstore.testing import TensorDictStoreTests

#: Tests that take ``real_server``: they need a server out of this process (CONFIG SET, a unix
#: socket, a second client on its own connection), so fakeredis settings hide them.
_OUT_OF_PROCESS = (
    "test_redis_kwargs_pass_through",
    "test_db_argument",
    "test_unix_socket",
    "test_oversize_value_is_refused_before_sending",
    "test_failed_from_tensordict_leaves_nothing",
)


class TestFakeredis(TensorDictStoreTests):
    server_kind = "fakeredis"
    locals().update(dict.fromkeys(_OUT_OF_PROCESS))


class TestRedis7(TensorDictStoreTests):
    server_kind = "redis"


class TestValkey8(TensorDictStoreTests):
    server_kind = "valkey"


class TestRedis62(TensorDictStoreTests):
    server_kind = "redis6"


class TestChunkedFakeredis(TensorDictStoreTests):
    """Every store in 64-byte chunks: almost every entry is several strings (docs/chunked.md)."""

    server_kind = "fakeredis"
    chunk_bytes = 64
    index_configs = 8
    differential_seeds = 12
    locals().update(dict.fromkeys(_OUT_OF_PROCESS))


class TestChunkedRedis7(TensorDictStoreTests):
    server_kind = "redis"
    chunk_bytes = 64
    index_configs = 8
    differential_seeds = 12


class TestTLS(TensorDictStoreTests):
    """Over TLS only (the session's CA)."""

    server_kind = "redis-tls"
    index_configs = 8
    differential_seeds = 6
    nontensor_seeds = 2


class TestACL(TensorDictStoreTests):
    """As an ACL user with a password and no @dangerous commands (no CONFIG)."""

    server_kind = "redis-acl"
    index_configs = 8
    differential_seeds = 6
    nontensor_seeds = 2
    # the user cannot read proto-max-bulk-len (CONFIG is @dangerous): the store assumes 512 MiB, so
    # its refusal of an oversize value before sending is not there to test (docs/deployment.md)
    test_oversize_value_is_refused_before_sending = None
    test_failed_from_tensordict_leaves_nothing = None
    # a pickle carries no password unless the store opted in (docs/security.md): tests/test_secure.py
    test_pickle_reconnects = None


def test_version_and_exports():
    assert tdstore.__version__
    for name in ("TensorDictStore", "TDStoreError", "StoreNotFoundError", "StoreClosedError"):
        assert hasattr(tdstore, name)
    assert issubclass(tdstore.StoreNotFoundError, KeyError)
    assert issubclass(tdstore.EntryTooLargeError, redis.exceptions.ResponseError)
