"""Reads of small rows by ``BITFIELD_RO`` (tdstore/_backend/reads.py).

Rows of 1, 2, 4, 8 or 16 bytes that a read would gather with the Lua script go by one
``BITFIELD_RO`` of signed integers on servers that have it (Redis 6.2+, Valkey; fakeredis
has not: the gather stays). The tests check which servers take it, that every bit pattern
comes back exactly (signs, NaN payloads, -0.0) through indexed reads and samples, that the
path is the one taken (commandstats of a real server), and that a string gone or cut short
is refused as before, never read as zeros.
"""

from __future__ import annotations

import pytest
import redis
import torch
from tensordict import TensorDict

import tdstore
from tdstore import TensorDictStore
from tdstore._backend.reads import BITFIELD_ROWS, GATHER_MIN_RUNS

#: an entry per row size BITFIELD_RO reads, and one it does not (3 bytes: the gather)
SHAPES = {
    "b1": ([], torch.bool),
    "i1": ([], torch.int8),
    "h2": ([], torch.float16),
    "f4": ([], torch.float32),
    "i8": ([], torch.int64),
    "c8": ([], torch.complex64),
    "f2x4": ([2], torch.float32),
    "d16": ([2], torch.float64),
    "i2x8": ([2], torch.int64),
    "u3": ([3], torch.uint8),
}


def _random_bits(rows: int, shape: list[int], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Every bit pattern of the dtype, sign bits and NaN payloads included (bools: 0 or 1)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, (rows, *shape), generator=g).bool()
    nbytes = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (rows, *shape, nbytes), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(rows, *shape)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _reference(rows: int, seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    td = TensorDict({k: _random_bits(rows, s, d, g) for k, (s, d) in SHAPES.items()}, batch_size=[rows])
    td["f4"][:4] = torch.tensor([-0.0, float("inf"), float("-inf"), float("nan")])
    td["i8"][:2] = torch.tensor([-(2**63), 2**63 - 1])
    td["id"] = torch.arange(rows)
    return td


def _bitfield_calls(server) -> int:
    stats = server.sync_client().info("commandstats")
    return int(stats.get("cmdstat_bitfield_ro", {}).get("calls", 0))


def test_which_servers_read_by_bitfield_and_take_doubles(server):
    store = TensorDictStore.from_tensordict(_reference(4, 0), **server.connection_kwargs())
    try:
        store[0]  # (the connection is set up by its first operation)
        assert store._conn.runner.bitfield is (server.kind != "fakeredis")
        assert store._conn.lua_has_struct is (server.kind != "fakeredis")  # (the updates' doubles)
    finally:
        store.clear_redis()
        store.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_every_bit_pattern_comes_back(server, seed):
    """Indexed reads (repeats, any order) and samples give the stored bytes exactly."""
    ref = _reference(300, seed)
    schema = {k: (list(v.shape[1:]), v.dtype) for k, v in ref.items()}
    store = TensorDictStore.from_schema(schema, batch_size=[300], **server.connection_kwargs())
    try:
        store.extend(ref)  # (a full ring: sample() draws among its rows)
        g = torch.Generator().manual_seed(seed)
        for n in (GATHER_MIN_RUNS, 64, 300):
            idx = torch.randint(0, 300, (n,), generator=g)
            got = store[idx]
            for key in SHAPES:
                assert _same_bytes(got[key], ref[key][idx]), (key, n)
        batch = store.sample(256, generator=g)
        rows = batch["id"]
        for key in SHAPES:
            assert _same_bytes(batch[key], ref[key][rows]), key
    finally:
        store.clear_redis()
        store.close()


def test_the_read_goes_by_bitfield(real_server):
    """One BITFIELD_RO per entry of a row size it reads; the 3-byte rows go by the gather."""
    ref = _reference(100, 2)
    store = TensorDictStore.from_tensordict(ref, **real_server.connection_kwargs())
    try:
        idx = torch.randint(0, 100, (40,), generator=torch.Generator().manual_seed(3))
        store[idx]  # (the layout is cached)
        before = _bitfield_calls(real_server)
        got = store[idx]
        sizes = {k: torch.empty(s, dtype=d).nbytes for k, (s, d) in SHAPES.items()} | {"id": 8}
        assert _bitfield_calls(real_server) - before == sum(1 for n in sizes.values() if n in BITFIELD_ROWS)
        assert all(_same_bytes(got[k], ref[k][idx]) for k in sizes)
    finally:
        store.clear_redis()
        store.close()


@pytest.mark.parametrize("damage", ["gone", "short"])
def test_a_damaged_string_is_refused_not_read_as_zeros(server, damage):
    """BITFIELD reads past a string's end as zeros: the length checked in the same snapshot
    refuses the read instead, and nothing is changed."""
    ref = _reference(50, 4)
    store = TensorDictStore.from_tensordict(ref, **server.connection_kwargs())
    try:
        key = f"{store.prefix}:{{{store.td_id}}}:d:i8"
        client = server.sync_client()
        if damage == "gone":
            client.delete(key)
        else:
            client.set(key, client.getrange(key, 0, 8 * 40 - 1))
        before = client.get(key)
        idx = torch.arange(49, 9, -1)
        with pytest.raises((tdstore.DataLostError, tdstore.CorruptMetadataError), match="i8"):
            store[idx]
        assert client.get(key) == before
        assert _same_bytes(store["f4"], ref["f4"])  # (the other entries still read)
    finally:
        store.clear_redis()
        store.close()


@pytest.mark.parametrize("reply", [[1, 2], [1, 2, 3, 4], [1, b"2", 3], b"\x00" * 24, None])
def test_a_reply_not_of_the_integers_asked_is_refused(reply):
    """Hostile data: another count, a non-integer, not a list: one clear error naming the store."""
    from tdstore._backend.reads import _bitfield_bytes

    with pytest.raises(tdstore.CorruptMetadataError, match=r"tensordict:\{x\}.*BITFIELD_RO.*3 integers"):
        _bitfield_bytes(reply, 8, 3, "tensordict:{x}")
    assert _bitfield_bytes([1, -1, 2**63 - 1], 8, 3, "tensordict:{x}") == (
        (1).to_bytes(8, "big") + (2**64 - 1).to_bytes(8, "big") + (2**63 - 1).to_bytes(8, "big")
    )


def test_a_server_that_refuses_bitfield_ro_after_setup_is_read_by_the_gather(real_server):
    """The setup found BITFIELD_RO; then an ACL took it from the handle's user (as another
    server behind the same address would). The next read is refused for it, sent again by
    the gather, and gives the same bytes; later reads go by the gather from the start.
    Before, every read raised ServerPermissionError."""
    ref = _reference(100, 5)
    store = TensorDictStore.from_tensordict(ref, **real_server.connection_kwargs())
    client = real_server.sync_client()
    idx = torch.randint(0, 100, (40,), generator=torch.Generator().manual_seed(6))
    try:
        store[idx]  # (the layout is cached, the connection set up)
        assert store._conn.runner.bitfield
        client.execute_command("ACL", "SETUSER", "default", "-bitfield_ro")
        with pytest.raises(redis.exceptions.NoPermissionError):  # (the command is refused now)
            client.execute_command("BITFIELD_RO", "x", "GET", "u8", "0")
        for _ in range(2):
            got = store[idx]
            assert all(_same_bytes(got[k], ref[k][idx]) for k in ref.keys())
        assert not store._conn.runner.bitfield
    finally:
        client.execute_command("ACL", "SETUSER", "default", "+bitfield_ro")
        client.close()
        store.clear_redis()
        store.close()
