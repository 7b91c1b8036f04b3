"""Differential property suite of indexed reads and writes, on every backend.

Each case does the same ``store[idx]`` read or ``store[idx] = value`` write on an in-memory
``TensorDict`` and on the store, and compares the results element for element: the
batch sizes, every entry's shape, dtype and values, and, for writes, the whole store
afterwards. Indices cover ints (negative too), slices with steps, lists, LongTensors of
any shape, 1-D and N-D bool masks, ``...``, ``None`` and broadcast integer arrays.
Malformed indices must raise the same exception type as TensorDict and change nothing.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from tdstore import TensorDictStore
from tdstore.testing.counts import add_cases
from tdstore.testing.strategies import rand_tensor as _rand_tensor

DTYPES = [
    torch.bool, torch.uint8, torch.int16, torch.int64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64, torch.complex64,
]  # fmt: skip
#: Cases per store of the index property test; the suite's ``index_configs`` says how many stores
#: (50 on the main settings: 5,000 cases per server).
CASES_PER_CONFIG = 100



def rand_tensor(rng: random.Random, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return _rand_tensor(rng, shape, dtype, int_range=(0, 100))


def rand_component(rng: random.Random, size: int, *, unique: bool) -> Any:
    kind = rng.choice(["int", "neg", "slice", "step", "list", "long", "long2d", "mask", "full"])
    if kind == "int":
        return rng.randrange(size)
    if kind == "neg":
        return -rng.randint(1, size)
    if kind == "slice":
        a = rng.randrange(-size, size + 1)
        return slice(a, rng.randrange(-size, size + 2))
    if kind == "step":
        return slice(rng.choice([None, rng.randrange(size)]), rng.choice([None, rng.randrange(size + 1)]), rng.randint(1, 3))
    if kind == "full":
        return slice(None)
    count = rng.randint(1, size) if unique else rng.randint(1, size + 2)
    rows = rng.sample(range(size), min(count, size)) if unique else [rng.randrange(size) for _ in range(count)]
    if kind == "list":
        return rows
    if kind == "long":
        return torch.tensor(rows)
    if kind == "long2d" and len(rows) >= 2 and len(rows) % 2 == 0:
        return torch.tensor(rows).reshape(2, -1)
    if kind == "mask":
        return torch.tensor([rng.random() < 0.5 for _ in range(size)])
    return torch.tensor(rows)


def rand_index(rng: random.Random, batch: tuple[int, ...], *, unique: bool) -> Any:
    gen = torch.Generator().manual_seed(rng.randrange(2**31))  # seeded: every backend sees the same cases
    form = rng.random()
    if form < 0.35:
        return rand_component(rng, batch[0], unique=unique)
    if form < 0.45 and len(batch) >= 2:
        return torch.rand(batch[:2], generator=gen) < 0.5  # N-D mask over the leading dims
    if form < 0.55:
        return (Ellipsis, rand_component(rng, batch[-1], unique=unique))
    if form < 0.62:
        return (None, rand_component(rng, batch[0], unique=unique))
    if form < 0.72 and len(batch) >= 2 and not unique:
        # advanced indices broadcast together (their placement follows torch's rules)
        a = torch.randint(0, batch[0], (rng.randint(1, 3), 1), generator=gen)
        b = torch.randint(0, batch[1], (rng.randint(1, 3),), generator=gen)
        return (a, b) if rng.random() < 0.5 else (a, slice(None), b)[: len(batch)]
    parts: list[Any] = []
    for dim in batch[: rng.randint(1, len(batch))]:
        comp = rand_component(rng, dim, unique=unique)
        if isinstance(comp, (list, torch.Tensor)) and any(isinstance(p, (list, torch.Tensor)) for p in parts):
            comp = slice(None)  # one advanced index at most in writes: no broadcast duplicates
        parts.append(comp)
    return tuple(parts)


def same(got: TensorDict, want: TensorDict, where: str) -> None:
    assert got.batch_size == want.batch_size, (where, got.batch_size, want.batch_size)
    for key, value in want.items(True, True):
        other = got[key]
        assert other.dtype == value.dtype and other.shape == value.shape, (where, key, other.shape, value.shape)
        assert torch.equal(other, value), (where, key)


def _index_for_torch(idx: Any) -> Any:
    if isinstance(idx, list):
        return torch.tensor(idx)
    if isinstance(idx, tuple):
        return tuple(torch.tensor(i) if isinstance(i, list) else i for i in idx)
    return idx


class IndexTests:
    """Indexed reads and writes of every index form, compared with a TensorDict element for element."""

    def test_index_reads_and_writes_match_tensordict(self, server, index_config, request):
        config = index_config  # parametrised by the suite: range(index_configs)
        rng = random.Random(1000 + config)
        batch = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
        entries = {}
        for name in ("a", "b"):
            feat = tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 2)))
            entries[name] = rand_tensor(rng, batch + feat, rng.choice(DTYPES))
        ref = TensorDict(entries, batch_size=batch)
        ref["n", "c"] = rand_tensor(rng, batch, rng.choice(DTYPES))
        store = TensorDictStore.from_tensordict(ref, **server.connection_kwargs())
        cases = CASES_PER_CONFIG
        reads = writes = errors = 0
        try:
            for case in range(cases):
                where = f"config {config} case {case} batch {batch}"
                write = rng.random() < 0.4
                idx = rand_index(rng, batch, unique=write)
                try:
                    want = ref[_index_for_torch(idx)]
                except (IndexError, RuntimeError, ValueError, TypeError) as err:
                    with pytest.raises(type(err)):
                        store[idx]
                    errors += 1
                    continue
                if not write:
                    same(store[idx], want, f"{where} read {idx!r}")
                    reads += 1
                    continue
                value = want.apply(lambda t: rand_tensor(rng, tuple(t.shape), t.dtype))
                if rng.random() < 0.2:
                    value = TensorDict({"a": value["a"]}, batch_size=value.batch_size)  # a subset of the keys
                store[idx] = value
                ref[_index_for_torch(idx)] = value
                writes += 1
                if case % 10 == 0:
                    same(store.to_tensordict(), ref, f"{where} after write {idx!r}")
            same(store.to_tensordict(), ref, f"config {config} final")
        finally:
            store.close()
        add_cases(request, f"index property cases on {server.kind}", reads=reads, writes=writes, errors=errors)
        assert reads + writes + errors == cases

    def test_duplicate_indices_last_write_wins(self, server):
        ref = TensorDict(a=torch.zeros(5, 3), b=torch.zeros(5, 5000), batch_size=[5])  # small and large rows
        store = TensorDictStore.from_tensordict(ref, **server.connection_kwargs())
        idx = torch.tensor([1, 3, 1, 1, 0])
        value = TensorDict(a=torch.arange(15.0).reshape(5, 3), b=torch.arange(5.0)[:, None].expand(5, 5000).clone(), batch_size=[5])
        store[idx] = value
        got = store.to_tensordict()
        assert torch.equal(got["a"][1], value["a"][3]) and torch.equal(got["b"][1], value["b"][3])
        assert torch.equal(got["a"][0], value["a"][4]) and torch.equal(got["a"][3], value["a"][1])
        store.close()

    def test_scalars_broadcast_and_cast(self, server):
        ref = TensorDict(a=torch.zeros(4, 2, dtype=torch.int16), f=torch.zeros(4), batch_size=[4])
        store = TensorDictStore.from_tensordict(ref, **server.connection_kwargs())
        store[1:3] = 7.9
        ref[1:3] = 7.9
        same(store.to_tensordict(), ref, "scalar")
        store[torch.tensor([True, False, False, True])] = torch.tensor(2)
        ref[torch.tensor([True, False, False, True])] = torch.tensor(2)
        same(store.to_tensordict(), ref, "tensor scalar")
        store.close()

    def test_index_write_creates_missing_keys_zero_filled(self, server, wire):
        store = TensorDictStore(batch_size=[4], **server.connection_kwargs())
        store["a"] = torch.ones(4)
        store[1:3] = TensorDict(a=torch.full((2,), 5.0), new=torch.ones(2, 3, dtype=torch.int32), batch_size=[2])
        assert torch.equal(store["new"], torch.tensor([[0, 0, 0], [1, 1, 1], [1, 1, 1], [0, 0, 0]], dtype=torch.int32))
        assert torch.equal(store["a"], torch.tensor([1.0, 5.0, 5.0, 1.0]))
        store.close()

    def test_get_at_past_the_batch_dims(self, server):
        x = torch.arange(5 * 4 * 3).reshape(5, 4, 3)
        store = TensorDictStore.from_tensordict(TensorDict(obs=x, batch_size=[5]), **server.connection_kwargs())
        idx: Any
        for idx in [(slice(1, 3), 2), (torch.tensor([4, 0]), 3), (0, slice(None), 1), (Ellipsis, 1), (torch.tensor([1, 2]), torch.tensor([0, 3]))]:
            assert torch.equal(store.get_at("obs", idx), x[idx]), idx
        store.close()

    def test_non_tensor_elements_written_at_an_index_match_tensordict(self, server, nontensor_seed):
        seed = nontensor_seed  # parametrised by the suite: range(nontensor_seeds)
        rng = random.Random(seed)
        n = rng.randint(2, 6)
        ref = TensorDict(a=torch.zeros(n), batch_size=[n])
        ref["info"] = "start"
        store = TensorDictStore.from_tensordict(ref, **server.connection_kwargs())
        try:
            for step in range(6):
                idx = rand_component(rng, n, unique=True)
                if isinstance(idx, torch.Tensor) and idx.dim() > 1:
                    idx = idx.reshape(-1)
                sub = ref[_index_for_torch(idx)]
                k = sub.batch_size[0] if sub.batch_dims else 0
                if rng.random() < 0.5 and sub.batch_dims:
                    info = NonTensorStack(*[f"s{seed}-{step}-{i}" for i in range(k)]) if k else NonTensorData("e", batch_size=[0])
                else:
                    info = NonTensorData(data={"step": step, "seed": seed}, batch_size=sub.batch_size)
                value = TensorDict(a=torch.full(sub.batch_size, float(step)), batch_size=sub.batch_size)
                value["info"] = info
                store[idx] = value
                ref[_index_for_torch(idx)] = value
                want = ref.get("info")
                got = store.get("info")
                want_list = want.tolist() if isinstance(want, NonTensorStack) else [want.data] * n
                got_list = got.tolist() if isinstance(got, NonTensorStack) else [got.data] * n
                assert got_list == want_list, (seed, step, idx)
                assert torch.equal(store["a"], ref["a"])
                for i in range(n):
                    assert store[i]["info"] == ref[i]["info"]
        finally:
            store.close()
