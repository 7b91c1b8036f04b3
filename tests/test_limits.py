"""Entries over the server's proto-max-bulk-len: refused up front, honestly, with nothing left behind.

A bulk argument over ``proto-max-bulk-len`` makes Redis and Valkey reply ``Protocol error`` and
drop the connection (the client sees a BrokenPipe or a reset), and a ``SETRANGE`` past it fails
in the middle of a transaction. tdstore reads the limit once per connection (``CONFIG GET``) and
refuses a larger entry with :class:`tdstore.EntryTooLargeError` (a
``redis.exceptions.ResponseError``) before it sends anything. These tests start their own
servers with the smallest limit the servers accept (1 MiB) and check, for every write path, the
error type, the message, and that the server's keys are byte-for-byte unchanged.
"""

from __future__ import annotations

import re

import pytest
import redis
import torch
from tensordict import NonTensorData, TensorDict

import tdstore
from tdstore import TensorDictStore
from tdstore.server import start_server

LIMIT = 1024 * 1024  # the smallest proto-max-bulk-len Redis and Valkey accept ("1mb")
ROWS = 4
BIG_FEATURES = 2 * LIMIT // (4 * ROWS)  # float32 entry of ROWS rows: 2 MiB in all
BIG_BYTES = ROWS * BIG_FEATURES * 4


@pytest.fixture(scope="module", params=["redis", "valkey", "redis6"])
def limited_server(request):
    """A private server started with ``--proto-max-bulk-len 1mb``."""
    try:
        handle = start_server(request.param, config={"proto-max-bulk-len": "1mb"})
    except Exception as exc:  # noqa: BLE001 - a missing server fails, never skips
        pytest.fail(f"cannot start {request.param} with proto-max-bulk-len 1mb: {exc}", pytrace=False)
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture
def limited(limited_server):
    """The module's private server (``limited_server``), flushed after each test. Tests make
    their stores on it with ``stores(limited, ...)`` (tests/fixtures.py)."""
    yield limited_server
    client = limited_server.sync_client()
    client.flushall()
    client.close()


def _check_message(err: BaseException, key: str, nbytes: int) -> None:
    text = str(err)
    assert isinstance(err, tdstore.EntryTooLargeError)
    assert isinstance(err, redis.exceptions.ResponseError)
    assert not isinstance(err, (BrokenPipeError, ConnectionResetError, redis.exceptions.ConnectionError))
    assert f"{key!r}" in text, text
    assert f"{nbytes} bytes" in text, text
    assert f"proto-max-bulk-len of {LIMIT} bytes" in text, text
    assert "CONFIG SET proto-max-bulk-len" in text, text  # fix 1: raise the limit on the server
    assert "tdstore.ShardedStore(block_rows=...)" in text, text  # fix 2: row blocks, one string each
    assert "Nothing was written" in text, text


def _assert_still_usable(store: TensorDictStore) -> None:
    """The connection survived: nothing was sent that made the server drop it."""
    store["probe"] = torch.arange(float(store.batch_size[0]) if store.batch_size else 1.0)
    assert store["probe"].sum().item() >= 0
    del store["probe"]


def test_limit_is_read_from_the_server(stores, limited):
    store = stores(limited, batch_size=[ROWS])
    store["a"] = torch.zeros(ROWS)
    assert store._conn.max_bulk == LIMIT


def test_limit_read_once_per_connection(stores, limited):
    client = limited.sync_client()

    def config_calls() -> int:
        stats = client.info("commandstats")  # Redis 7 / Valkey: "cmdstat_config|get"
        return sum(int(v["calls"]) for k, v in stats.items() if k.startswith("cmdstat_config"))

    before = config_calls()
    store = stores(limited, batch_size=[ROWS])
    for i in range(5):
        store[f"e{i}"] = torch.zeros(ROWS)
        store[f"e{i}"]
    store.update({"u": torch.ones(ROWS)})
    # proto-max-bulk-len and client-query-buffer-limit, in one round trip
    assert config_calls() - before == 2
    other = stores(limited, batch_size=[ROWS])  # another store, another connection: read once more
    other["a"] = torch.zeros(ROWS)
    assert config_calls() - before == 4
    client.close()


def _bytes_received(handle) -> int:
    client = handle.sync_client()
    try:
        return int(client.info("stats")["total_net_input_bytes"])
    finally:
        client.close()


def test_without_the_check_the_server_drops_the_connection(limited):
    """The failure the check prevents: the server refuses the bulk as a protocol error and hangs up.

    The client sees "Protocol error" (or, when the payload outruns the socket buffers, a broken
    pipe / reset), and the connection is gone either way.
    """
    client = limited.sync_client(socket_timeout=10, retry=None)
    try:
        with pytest.raises((redis.exceptions.ConnectionError, redis.exceptions.ResponseError)) as info:
            client.set("raw", bytes(BIG_BYTES))
        assert isinstance(info.value, redis.exceptions.ConnectionError) or "Protocol error" in str(info.value)
        assert not client.exists("raw")
    finally:
        client.close()


def test_whole_entry_set(stores, limited, wire):
    store = stores(limited, batch_size=[ROWS])
    store["small"] = torch.ones(ROWS)
    before = wire(limited)
    received = _bytes_received(limited)
    with pytest.raises(tdstore.EntryTooLargeError) as info:
        store["big"] = torch.zeros(ROWS, BIG_FEATURES)
    assert _bytes_received(limited) - received < 4096  # refused before sending: not one payload byte
    _check_message(info.value, "big", BIG_BYTES)
    assert store.td_id in str(info.value)
    assert wire(limited) == before
    assert "big" not in store.keys()
    _assert_still_usable(store)


def test_replacing_an_entry_with_a_larger_one(stores, limited, wire):
    store = stores(limited, batch_size=[ROWS])
    store["x"] = torch.ones(ROWS, 4)
    before = wire(limited)
    with pytest.raises(tdstore.EntryTooLargeError) as info:
        store["x"] = torch.zeros(ROWS, BIG_FEATURES)
    _check_message(info.value, "x", BIG_BYTES)
    assert wire(limited) == before
    assert torch.equal(store["x"], torch.ones(ROWS, 4))


def test_nested_entry(stores, limited, wire):
    store = stores(limited, batch_size=[ROWS])
    store["n", "a"] = torch.ones(ROWS)
    before = wire(limited)
    with pytest.raises(tdstore.EntryTooLargeError) as info:
        store["n", "big"] = torch.zeros(ROWS, BIG_FEATURES)
    _check_message(info.value, ("n", "big"), BIG_BYTES)
    assert wire(limited) == before


def test_non_tensor_entry(stores, limited, wire):
    store = stores(limited, batch_size=[ROWS])
    before = wire(limited)
    with pytest.raises(tdstore.EntryTooLargeError) as info:
        store["text"] = NonTensorData("x" * (2 * LIMIT))
    assert "'text'" in str(info.value) and "ShardedStore" in str(info.value)
    assert wire(limited) == before
    _assert_still_usable(store)


def test_entry_exactly_at_the_limit_is_written(stores, limited, wire):
    """The check is not off by one: an entry of exactly proto-max-bulk-len bytes goes through."""
    store = stores(limited, batch_size=[ROWS])
    value = torch.arange(LIMIT // 4, dtype=torch.float32).reshape(ROWS, -1)
    store["edge"] = value
    assert torch.equal(store["edge"], value)
    with pytest.raises(tdstore.EntryTooLargeError) as info:
        store["over"] = torch.zeros(ROWS, LIMIT // (4 * ROWS) + 1)
    _check_message(info.value, "over", ROWS * (LIMIT // (4 * ROWS) + 1) * 4)


@pytest.mark.parametrize("method", ["from_tensordict", "from_dict"])
def test_from_tensordict_and_from_dict_leave_nothing(stores, limited, wire, method):
    before = wire(limited)
    data = {"ok": torch.ones(ROWS), "big": torch.zeros(ROWS, BIG_FEATURES)}
    source = TensorDict(data, [ROWS]) if method == "from_tensordict" else data
    kwargs = {} if method == "from_tensordict" else {"batch_size": [ROWS]}
    with pytest.raises(tdstore.EntryTooLargeError) as info:
        stores(limited, method, source, **kwargs)
    _check_message(info.value, "big", BIG_BYTES)
    assert wire(limited) == before == {}


def test_update_applies_nothing(stores, limited, wire):
    store = stores(limited, batch_size=[ROWS])
    store["keep"] = torch.ones(ROWS)
    before = wire(limited)
    with pytest.raises(tdstore.EntryTooLargeError) as info:
        store.update({"keep": torch.full((ROWS,), 7.0), "new": torch.ones(ROWS), "big": torch.zeros(ROWS, BIG_FEATURES)})
    _check_message(info.value, "big", BIG_BYTES)
    assert wire(limited) == before
    assert torch.equal(store["keep"], torch.ones(ROWS))
    with pytest.raises(tdstore.EntryTooLargeError):
        store.update(TensorDict({"big": torch.zeros(ROWS, BIG_FEATURES)}, [ROWS]))
    assert wire(limited) == before


def test_indexed_write_that_creates_an_entry(stores, limited, wire):
    """A new key written at an index is created zero-filled in full: its full size counts."""
    rows = 64
    features = LIMIT // (4 * rows) + 16  # the full entry is just over 1 MiB; one row is tiny
    store = stores(limited, batch_size=[rows])
    store["a"] = torch.zeros(rows)
    before = wire(limited)
    with pytest.raises(tdstore.EntryTooLargeError) as info:
        store[0:2] = TensorDict({"a": torch.ones(2), "wide": torch.ones(2, features)}, [2])
    _check_message(info.value, "wide", rows * features * 4)
    assert wire(limited) == before  # "a" was not written either: one step, refused whole
    with pytest.raises(tdstore.EntryTooLargeError):  # one row, a new key: the same
        store[3] = TensorDict({"wide": torch.ones(features)}, [])
    assert wire(limited) == before
    store[0:2] = TensorDict({"a": torch.ones(2), "fits": torch.ones(2, 8)}, [2])  # still usable
    assert store["fits"].sum().item() == 16


def test_from_schema_and_extend(stores, limited, wire):
    before = wire(limited)
    with pytest.raises(tdstore.EntryTooLargeError) as info:
        stores(limited, "from_schema", {"obs": ([BIG_FEATURES], torch.float32), "r": ([], torch.float32)}, batch_size=[ROWS])
    assert "schema entry ('obs',)" in str(info.value)
    _check_message(info.value, ("obs",), BIG_BYTES)
    assert wire(limited) == before == {}
    # a buffer whose entries fit exactly: extend() writes rows into them, never past the limit
    capacity = 256
    features = LIMIT // (4 * capacity)
    buf = stores(limited, "from_schema", {"obs": ([features], torch.float32)}, batch_size=[capacity])
    for step in range(3):
        rows = torch.full((200, features), float(step))
        buf.extend(TensorDict({"obs": rows}, [200]))
    assert buf["obs"].shape == (capacity, features)
    assert (buf["obs"][: 600 - 2 * capacity] == 2.0).all()


def test_config_refused_falls_back_to_512_mib(acl_server):
    """An ACL user without CONFIG: the limit is Redis' default, 512 MiB."""
    store = TensorDictStore(batch_size=[2], **acl_server.connection_kwargs())
    try:
        store["a"] = torch.zeros(2)
        client = redis.Redis(**acl_server.connection_kwargs())  # as the user (sync_client is the admin)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.config_get("proto-max-bulk-len")
        client.close()
        assert store._conn.max_bulk == 512 * 1024 * 1024
        with pytest.raises(tdstore.EntryTooLargeError, match=re.escape(f"{2 * 300 * 1024 * 1024} bytes")):
            store._conn.check_entry_size(("x",), 2 * 300 * 1024 * 1024, store._where())
    finally:
        store.clear_redis()
        store.close()


@pytest.mark.parametrize("kind", ["redis", "valkey"])
def test_query_buffer_limit_is_checked_too(kind, wire):
    """A command larger than client-query-buffer-limit (though under proto-max-bulk-len) would make the
    server close the connection: refused up front, naming that limit; zero-fills still work."""
    handle = start_server(kind, config={"proto-max-bulk-len": "8mb", "client-query-buffer-limit": "1mb"})
    try:
        conn = handle.connection_kwargs()
        store = TensorDictStore(batch_size=[ROWS], **conn)
        store["small"] = torch.zeros(ROWS)
        assert (store._conn.max_bulk, store._conn.max_query) == (8 * LIMIT, LIMIT)
        before = wire(handle)
        with pytest.raises(tdstore.EntryTooLargeError, match=r"'big'.*client-query-buffer-limit of 1048576 bytes") as info:
            store["big"] = torch.zeros(ROWS, BIG_FEATURES)
        assert "CONFIG SET client-query-buffer-limit 4mb" in str(info.value) and "chunk_bytes" in str(info.value)
        assert wire(handle) == before
        _assert_still_usable(store)
        zeros = TensorDictStore.from_schema({"x": ([BIG_FEATURES], torch.float32)}, batch_size=[ROWS], **conn)
        assert zeros["x"].shape == (ROWS, BIG_FEATURES)  # zero-filled on the server: no large command
        for s in (store, zeros):
            s.clear_redis()
            s.close()
    finally:
        handle.stop()
