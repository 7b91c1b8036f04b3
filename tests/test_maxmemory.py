"""The memory guard (tdstore/_backend/memory.py): a write that would take the server past its
``maxmemory`` is refused before anything is sent, names the limit, the size and the fix, and
leaves nothing behind; a write that fits still goes through near the limit.

Each real server kind (Redis 7, Valkey 8, Redis 6.2) is started once per module with
``maxmemory`` set; each test leaves a chosen amount free with a filler key grown on the server
(``SETRANGE``: a ``SET`` of that size would itself be refused, its bytes counting in the
query buffer). fakeredis has no ``INFO`` and no memory limit: there the guard stays off, and
``test_fakeredis_has_no_memory_limit_and_the_guard_stays_off`` says so.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import torch
from tensordict import TensorDict, lazy_stack

import tdstore
from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore._backend import memory as _memory
from tdstore.errors import WouldExceedMaxmemoryError
from tdstore.server import ServerHandle, start_server

MIB = 1024 * 1024
LIMIT = 24 * MIB
PREFIX = "mm"
KINDS = ["redis", "valkey", "redis6"]


def _selected(config: pytest.Config, kind: str) -> bool:
    raw = str(config.getoption("--backends", default="") or "")
    return not raw or kind in {name.strip() for name in raw.split(",")}


@pytest.fixture(scope="module", params=KINDS)
def limited(request: pytest.FixtureRequest) -> Iterator[ServerHandle]:
    """A server of each kind started with maxmemory 24 MiB and noeviction."""
    if not _selected(request.config, request.param):
        pytest.skip(f"{request.param} backend excluded by --backends")
    with start_server(request.param, config={"maxmemory": str(LIMIT), "maxmemory-policy": "noeviction"}) as srv:
        yield srv


@pytest.fixture
def client(limited: ServerHandle) -> Iterator[redis.Redis]:
    plain = limited.sync_client()
    yield plain
    plain.flushall()
    plain.close()


def _leave_free(client: redis.Redis, free: int) -> None:
    """Grows a filler key on the server until ``free`` bytes are left under maxmemory."""
    info = client.info("memory")
    assert int(info["maxmemory"]) == LIMIT
    grow = LIMIT - int(info["used_memory"]) - free
    assert grow > 0, "the server already uses more than the test leaves free"
    # strings of 256 KiB (one allocator class, no rounding), then one for the rest
    piece = 256 * 1024
    with client.pipeline(transaction=False) as pipe:
        for i in range(grow // (piece + 256)):
            pipe.setrange(f"filler:{i}", piece - 64, b"x")
        pipe.execute()
    rest = LIMIT - int(client.info("memory")["used_memory"]) - free
    if rest > 1024:
        client.setrange("filler:rest", rest - 512, b"x")
    left = LIMIT - int(client.info("memory")["used_memory"])
    assert free - MIB // 2 < left <= free + MIB // 2, left


def _store_keys(client: redis.Redis) -> list[bytes]:
    return sorted(client.scan_iter(match=f"{PREFIX}:*"))


def _check_memory(client: redis.Redis) -> None:
    info = client.info("memory")
    assert int(info["used_memory"]) < LIMIT
    assert int(info["used_memory_peak"]) < LIMIT  # never went over, not even for a moment


def _existing(kw: dict[str, Any]) -> TensorDictStore:
    store = TensorDictStore(batch_size=[4], prefix=PREFIX, **kw)
    store["a"] = torch.arange(4.0)
    return store


# (name, write): each asks for 16 MiB, with 1 MiB free
WRITES: list[tuple[str, Callable[[dict[str, Any], Any], Any]]] = [
    ("from_schema", lambda kw, _: TensorDictStore.from_schema(
        {"x": ([4 * MIB], torch.float32)}, batch_size=[1], prefix=PREFIX, **kw)),
    ("from_schema_chunked", lambda kw, _: TensorDictStore.from_schema(
        {"x": ([4 * MIB], torch.float32)}, batch_size=[1], chunk_bytes=2 * MIB, prefix=PREFIX, **kw)),
    ("from_tensordict", lambda kw, _: TensorDictStore.from_tensordict(
        TensorDict(x=torch.ones(4, MIB), batch_size=[4]), prefix=PREFIX, **kw)),
    ("from_tensordict_chunked", lambda kw, _: TensorDictStore.from_tensordict(
        TensorDict(x=torch.ones(4, MIB), batch_size=[4]), chunk_bytes=MIB, prefix=PREFIX, **kw)),
    ("update", lambda kw, store: store.update({"x": torch.ones(4, MIB), "y": torch.ones(4)})),
    ("whole_entry", lambda kw, store: store.__setitem__("x", torch.ones(4, MIB))),
    ("replace_entry", lambda kw, store: store.__setitem__("a", torch.ones(4, MIB))),
    ("index_creates_entry", lambda kw, store: store.__setitem__(
        slice(0, 2), TensorDict(a=torch.zeros(2), x=torch.ones(2, MIB), batch_size=[2]))),
    ("lazy_stack", lambda kw, _: LazyStackedTensorDictStore.from_lazy_stack(
        lazy_stack([TensorDict(x=torch.ones(MIB), batch_size=[]) for _ in range(4)]), prefix=PREFIX, **kw)),
]


@pytest.mark.parametrize("name,write", WRITES, ids=[name for name, _ in WRITES])
def test_a_write_past_maxmemory_is_refused_and_leaves_nothing(limited, client, name, write):
    kw = limited.connection_kwargs()
    store = _existing(kw)
    before = {key: client.dump(key) for key in _store_keys(client)}
    _leave_free(client, MIB)
    with pytest.raises(WouldExceedMaxmemoryError) as info:
        write(kw, store)
    text = str(info.value)
    assert f"maxmemory of {LIMIT:,} bytes" in text  # the limit
    assert re.search(r"writes 16,777,\d{3} bytes \(16\.0 MiB; about \d+\.\d MiB of server memory", text)  # the size
    assert "CONFIG SET maxmemory" in text and "clear_redis()" in text  # the fix
    assert "Nothing of this operation was applied" in text
    assert isinstance(info.value, tdstore.ServerOutOfMemoryError)  # caught as the server's own refusal
    # nothing left behind: the store as it was, no new store, no tmp key
    assert {key: client.dump(key) for key in _store_keys(client)} == before
    _check_memory(client)
    assert torch.equal(store["a"], torch.arange(4.0))
    store.close()


def test_an_overwrite_in_place_is_checked_for_its_bytes_in_flight(limited, client):
    """Same shape and dtype: written in place (no new string), but its 16 MiB travel."""
    kw = limited.connection_kwargs()
    store = TensorDictStore.from_schema({"x": ([MIB], torch.float32)}, batch_size=[4], prefix=PREFIX, **kw)
    before = {key: client.dump(key) for key in _store_keys(client)}
    _leave_free(client, MIB)
    with pytest.raises(WouldExceedMaxmemoryError, match=r"writing 'x' to TensorDictStore.*writes 16,777,216 bytes"):
        store["x"] = torch.ones(4, MIB)
    assert {key: client.dump(key) for key in _store_keys(client)} == before
    _check_memory(client)
    store.close()


def test_the_message_names_the_store_and_the_entries(limited, client):
    kw = limited.connection_kwargs()
    store = _existing(kw)
    _leave_free(client, MIB)
    with pytest.raises(WouldExceedMaxmemoryError, match=r"writing entries 'x', 'y' to TensorDictStore\(td_id=") as info:
        store.update({"x": torch.ones(4, MIB), "y": torch.ones(4, MIB)})
    assert store.td_id in str(info.value) and f"prefix={PREFIX!r}" in str(info.value)
    store.close()


def test_a_write_that_fits_still_works_near_the_limit(limited, client):
    kw = limited.connection_kwargs()
    small = _existing(kw)
    _leave_free(client, 4 * MIB + MIB // 2)
    # 2 MiB, checked by the guard (about 3.5 MiB at the peak), in 4.5 MiB
    made = TensorDictStore.from_schema({"x": ([256], torch.float32)}, batch_size=[2048], prefix=PREFIX, **kw)
    made[0:4] = TensorDict(x=torch.ones(4, 256), batch_size=[4])  # a small row write: no check
    left = LIMIT - int(client.info("memory")["used_memory"])
    assert left < 3 * MIB  # it really was near the limit
    _check_memory(client)
    # (reads are not checked: a whole read of a large entry briefly holds its bytes in the
    # server's output buffer, which counts in used_memory too)
    assert made.shape == (2048,) and made[0:8]["x"].sum() == 1024
    made.clear_redis()
    made.close()
    # 1 MiB sent (the value and its bytes in the query buffer: about 3.8 MiB at the peak)
    small.update({"y": torch.full((4, MIB // 16), 3.0)})
    _check_memory(client)
    assert bool((small[1:2]["y"] == 3.0).all()) and torch.equal(small["a"], torch.arange(4.0))
    small.close()


def test_small_writes_and_reads_send_no_info(limited, client):
    """Writes under GUARD_MIN, row writes, extend and reads pay no extra round trip."""
    kw = limited.connection_kwargs()
    store = TensorDictStore.from_schema({"obs": ([64], torch.float32)}, batch_size=[256], prefix=PREFIX, **kw)
    store[0] = TensorDict(obs=torch.ones(64), batch_size=[])
    client.config_resetstat()
    for i in range(20):
        store[i] = TensorDict(obs=torch.full((64,), float(i)), batch_size=[])
        store["obs"] = torch.zeros(256, 64)  # 64 KiB whole-entry write
        store[torch.tensor([i, i + 1])]
        store["obs"]
    stats = client.info("commandstats")
    assert "cmdstat_info" not in stats, stats.get("cmdstat_info")
    client.config_resetstat()
    store.update({"big": torch.zeros(256, 1024)})  # 1 MiB: checked, one INFO
    assert client.info("commandstats")["cmdstat_info"]["calls"] == 1  # (this INFO counts after it answers)
    store.close()


def test_an_evicting_server_makes_room_and_only_an_impossible_write_is_refused(request):
    if not _selected(request.config, "redis"):
        pytest.skip("redis backend excluded by --backends")
    with start_server("redis", config={"maxmemory": str(LIMIT), "maxmemory-policy": "allkeys-lru"}) as srv:
        kw = srv.connection_kwargs()
        plain = srv.sync_client()
        _leave_free(plain, MIB)
        # 8 MiB fits once the server evicts other keys: the guard lets the policy decide
        store = TensorDictStore.from_schema({"x": ([MIB], torch.float32)}, batch_size=[2], prefix=PREFIX, **kw)
        try:
            assert store["x"].shape == (2, MIB)
        except (tdstore.StoreNotFoundError, tdstore.DataLostError):
            pass  # the server may evict the new store's own keys too: lost data, reported
        assert plain.info("stats")["evicted_keys"] > 0
        with pytest.raises(WouldExceedMaxmemoryError, match=r"even after evicting every key, policy allkeys-lru"):
            TensorDictStore.from_schema({"x": ([8 * MIB], torch.float32)}, batch_size=[1], prefix=PREFIX, **kw)
        store.close()
        plain.close()


def test_fakeredis_has_no_memory_limit_and_the_guard_stays_off():
    """fakeredis has no INFO and no maxmemory: large writes go through unchecked."""
    with start_server("fakeredis") as srv:
        store = TensorDictStore.from_schema({"x": ([MIB], torch.float32)}, batch_size=[2], **srv.connection_kwargs())
        store.update({"y": torch.ones(2, MIB)})
        assert store["y"].sum() == 2 * MIB
        assert store._conn._client in _memory._NO_INFO  # found out at setup: INFO is never sent again
        store.close()


def test_estimate_counts_allocator_classes_and_bytes_in_flight():
    from tdstore._backend.ops import Op
    from tdstore._core.layout import Entry

    assert _memory.alloc_size(16 * MIB) == 16 * MIB
    assert _memory.alloc_size(16 * MIB + 1) == 20 * MIB  # jemalloc: 4 classes per power of two
    assert _memory.alloc_size(100) == 112
    payload = bytes(16 * MIB)
    written, needed = _memory.estimate([Op("put", ("x",), Entry("t"), payload=payload)])
    assert written == 16 * MIB and needed == 20 * MIB + 20 * MIB  # the value, and its bytes in the query buffer
    written, needed = _memory.estimate([Op("put", ("x",), Entry("t"), payload=payload)], staged=True)
    assert needed == 20 * MIB + _memory.alloc_size(16 * MIB + _memory.KEY_OVERHEAD)  # one step in flight
    written, needed = _memory.estimate([Op("zero", ("x",), Entry("t"), nbytes=16 * MIB), Op("del", ("y",))])
    assert (written, needed) == (16 * MIB, 20 * MIB)


def test_a_user_without_info_writes_unguarded(request):
    """An ACL user without +info (as on managed services): the guard finds out at setup and stays
    out of the way; large writes go through, and the server's own refusal is what is left."""
    if not _selected(request.config, "redis"):
        pytest.skip("redis backend excluded by --backends")
    rules = ["on", ">job-pass", f"~{PREFIX}:*", "+@all", "-@dangerous"]  # no INFO, no CONFIG
    with start_server(
        "redis", config={"maxmemory": str(LIMIT), "maxmemory-policy": "noeviction"}, acl_users={"job": rules}
    ) as srv:
        kw = srv.as_user("job", "job-pass").connection_kwargs()
        store = TensorDictStore.from_schema({"x": ([MIB // 4], torch.float32)}, batch_size=[4], prefix=PREFIX, **kw)
        store.update({"y": torch.ones(4, MIB // 4)})
        assert store[1:3]["y"].sum() == 2 * (MIB // 4)
        assert store._conn._client in _memory._NO_INFO
        admin = srv.sync_client()
        admin.config_resetstat()
        store.update({"z": torch.ones(4, MIB // 4)})
        assert "cmdstat_info" not in admin.info("commandstats")  # not asked again
        store.clear_redis()
        store.close()
        admin.close()
