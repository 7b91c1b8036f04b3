"""The conformance suite of TensorDictStore as one class: subclass it once per setting.

Every test of :class:`TensorDictStoreTests` takes a ``server`` fixture (a
:class:`~tdstore.server.ServerHandle`) and checks the wire state with a plain client. A setting is
a subclass that names its server and its options, the way zarr's ``StoreTests`` is subclassed
once per store::

    class TestValkey8(TensorDictStoreTests):
        server_kind = "valkey"

    class TestChunked(TensorDictStoreTests):
        server_kind = "redis"
        chunk_bytes = 64          # every store of the suite keeps its entries in 64-byte chunks
        index_configs = 8         # fewer random stores than on the main settings

The ``server`` fixture comes from the conftest that runs the suite: the repository's
``tests/conftest.py`` starts a private server of ``server_kind``; ``tdstore.testing``'s own
conftest connects to the server given by ``--server-url`` (see docs/deployment.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import pytest

from tdstore.testing.core import ConsistencyTests, ConstructorTests, EntryTests, WholeStoreTests
from tdstore.testing.differential import DifferentialTests
from tdstore.testing.failures import FailureTests
from tdstore.testing.fixtures import StoreFixtures
from tdstore.testing.index_property import IndexTests

__all__ = ["TensorDictStoreTests"]


class TensorDictStoreTests(
    StoreFixtures,
    ConstructorTests,
    EntryTests,
    WholeStoreTests,
    ConsistencyTests,
    FailureTests,
    DifferentialTests,
    IndexTests,
):
    """The documented API of TensorDictStore, checked on one server setting.

    Class attributes of a setting:

    * ``server_kind``: which server the conftest gives ``server`` (``"fakeredis"``, ``"redis"``,
      ``"valkey"``, ``"redis6"``, ``"cluster"``, ``"redis-tls"``, ``"redis-acl"``...);
    * ``chunk_bytes``: a chunk size every store of the suite gets (``TDSTORE_CHUNK_BYTES``), or None;
    * ``index_configs``, ``differential_seeds``, ``nontensor_seeds``: how many random stores the
      property tests draw (100 index cases on each of ``index_configs`` stores).

    A setting hides a test that cannot apply to it by setting the name to ``None``.
    """

    server_kind: ClassVar[str | None] = None
    chunk_bytes: ClassVar[int | None] = None
    index_configs: ClassVar[int] = 50
    differential_seeds: ClassVar[int] = 40
    nontensor_seeds: ClassVar[int] = 12

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        for argname, count in (
            ("index_config", self.index_configs),
            ("diff_seed", self.differential_seeds),
            ("nontensor_seed", self.nontensor_seeds),
        ):
            if argname in metafunc.fixturenames:
                metafunc.parametrize(argname, range(count))

    @pytest.fixture(autouse=True)
    def _setting_chunk_bytes(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        if self.chunk_bytes is not None:
            monkeypatch.setenv("TDSTORE_CHUNK_BYTES", str(self.chunk_bytes))
        yield
