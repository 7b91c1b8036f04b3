"""Differential tests: the same operations on an in-memory TensorDict and on the store.

Seeded random batch sizes, shapes, dtypes and nestings; after every operation the store's
``to_tensordict()`` and its per-entry reads must equal the TensorDict element for element.
"""

from __future__ import annotations

import random

import torch
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore.testing.strategies import rand_tensor

DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
]  # fmt: skip



def rand_key(rng: random.Random) -> str:
    return rng.choice(["a", "b", "obs", "x.y", "r%d", "k:1", "{t}", "é"]) + str(rng.randrange(3))


def rand_td(rng: random.Random, batch: tuple[int, ...], depth: int = 0) -> TensorDict:
    td = TensorDict(batch_size=batch)
    for _ in range(rng.randint(1, 4)):
        key = rand_key(rng)
        if depth < 2 and rng.random() < 0.25:
            extra = tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 1)))
            td[key] = rand_td(rng, batch + extra, depth + 1)
        else:
            feat = tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 2)))
            td[key] = rand_tensor(rng, batch + feat, rng.choice(DTYPES))
    return td


def assert_same(store: TensorDictStore, ref: TensorDict) -> None:
    local = store.to_tensordict()
    assert local.batch_size == ref.batch_size
    assert set(local.keys(True)) == set(ref.keys(True)), (sorted(map(str, local.keys(True))), sorted(map(str, ref.keys(True))))
    for key, value in ref.items(True, True):
        got = local[key]
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert torch.equal(got, value), key
        assert torch.equal(store[key], value), key
    for key, value in ref.items(True):
        if isinstance(value, TensorDict):
            assert local[key].batch_size == value.batch_size, key


def leaf_keys(ref: TensorDict) -> list:
    return list(ref.keys(True, True))


def random_op(rng: random.Random, store: TensorDictStore, ref: TensorDict) -> str:
    batch = tuple(ref.batch_size)
    keys = leaf_keys(ref)
    op = rng.choice(["set", "replace", "del", "rename", "update", "update_", "set_", "index_write", "index_read"])
    if op == "set" or not keys:
        key = rand_key(rng)
        value = rand_tensor(rng, batch + (rng.randint(1, 3),), rng.choice(DTYPES))
        store[key] = value
        ref[key] = value
        return f"set {key}"
    key = rng.choice(keys)
    if op == "replace":
        # a new shape and dtype for an existing key
        owner = ref if isinstance(key, str) else ref[key[:-1]]
        value = rand_tensor(rng, tuple(owner.batch_size) + (rng.randint(1, 4),), rng.choice(DTYPES))
        store[key] = value
        ref[key] = value
    elif op == "del":
        store.del_(key)
        ref.del_(key)
    elif op == "rename":
        name = rand_key(rng)
        new: str | tuple[str, ...] = key[:-1] + (name,) if isinstance(key, tuple) else name
        if new in ref.keys(True):
            return "rename skipped"
        store.rename_key_(key, new)
        ref.rename_key_(key, new)
    elif op == "update":
        new = rand_key(rng)
        values = {new: rand_tensor(rng, batch, rng.choice(DTYPES)), "u": rand_tensor(rng, batch + (2,), torch.float32)}
        store.update(values)
        ref.update(values)
    elif op == "update_" or op == "set_":
        current = ref[key]
        value = rand_tensor(rng, tuple(current.shape), rng.choice(DTYPES))
        if op == "set_":
            store.set_(key, value)
            ref.set_(key, value)
        else:
            store.update_({key: value})
            ref.update_({key: value})
    elif op == "index_write":
        idx = rand_index(rng, batch)
        sub = ref[idx]
        new = sub.apply(lambda t: rand_tensor(rng, tuple(t.shape), t.dtype))
        store[idx] = new
        ref[idx] = new
    elif op == "index_read":
        idx = rand_index(rng, batch)
        got, want = store[idx], ref[idx]
        assert got.batch_size == want.batch_size
        for k, v in want.items(True, True):
            assert torch.equal(got[k], v), (k, idx)
    return f"{op} {key}"


def rand_index(rng: random.Random, batch: tuple[int, ...]):
    n = batch[0]
    kind = rng.choice(["int", "slice", "step", "list", "mask", "tensor"])
    if kind == "int":
        return rng.randrange(-n, n)
    if kind == "slice":
        a = rng.randrange(0, n)
        return slice(a, rng.randrange(a, n + 1))
    if kind == "step":
        return slice(rng.randrange(0, n), None, rng.randint(1, 3))
    # distinct rows: with repeated rows torch leaves the winning write unspecified
    # (tests/test_store_index.py checks that the store's last write wins)
    if kind == "list":
        return rng.sample(range(n), rng.randint(1, n))
    if kind == "mask":
        return torch.tensor([rng.random() < 0.5 for _ in range(n)])
    return torch.tensor(rng.sample(range(n), rng.randint(1, n)))


def _same_server(server, store):
    kw = store._conn.pool_kwargs
    if "server" in kw:
        import fakeredis.aioredis

        return {"client": fakeredis.aioredis.FakeRedis(server=kw["server"])}
    return server.connection_kwargs()


class DifferentialTests:
    """Random whole-entry operations on a store and on a TensorDict, compared after every step."""

    def test_differential_whole_entries(self, server, diff_seed):
        seed = diff_seed  # parametrised by the suite: range(differential_seeds)
        rng = random.Random(seed)
        batch = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        ref = rand_td(rng, batch)
        if seed % 2:
            store = TensorDictStore.from_tensordict(ref, **server.connection_kwargs())
        else:
            store = TensorDictStore(batch_size=batch, **server.connection_kwargs())
            for key, value in ref.items():
                store[key] = value
        try:
            assert_same(store, ref)
            log = []
            for _ in range(8):
                log.append(random_op(rng, store, ref))
                assert_same(store, ref)
            again = TensorDictStore.from_store(td_id=store.td_id, **_same_server(server, store))
            assert_same(again, ref)
            again.close()
        finally:
            store.close()
