"""Fixtures of the conformance suite that every setting shares (methods of the suite class)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from tdstore import TensorDictStore
from tdstore.server import ServerHandle
from tdstore.testing.wire import WireSnapshot, wire_snapshot


class StoreFixtures:
    """``make``, ``wire`` and ``unchunked``: what the suite's tests take besides ``server``."""

    @pytest.fixture
    def make(self, server: ServerHandle) -> Iterator[Callable[..., Any]]:
        """Creates stores on the test's server and closes them at the end."""
        created: list[TensorDictStore] = []

        def factory(*, cls_method: str | None = None, **kwargs: Any) -> Any:
            conn = server.connection_kwargs()
            conn.update(kwargs.pop("conn", {}))
            if cls_method is None:
                store = TensorDictStore(**conn, **kwargs)
            else:
                store = getattr(TensorDictStore, cls_method)(**conn, **kwargs)
            created.append(store)
            return store

        yield factory
        for store in created:
            store.close()

    @pytest.fixture
    def wire(self) -> Callable[[ServerHandle | redis.Redis], WireSnapshot]:
        """``wire(handle)``: every key with its type and full value, read with a plain client."""
        return wire_snapshot

    @pytest.fixture
    def unchunked(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Stores created by the test keep one string per entry, whatever the setting's chunking."""
        monkeypatch.delenv("TDSTORE_CHUNK_BYTES", raising=False)
