"""LazyStackedTensorDictStore: differential suite against the in-memory lazy stack, and its rules.

The differential tests keep an oracle: the list of element tensordicts, changed by the
same operations as the store, and compared with the store (bytes, dtypes, shapes,
non-tensor values, stack dim) after every step. Random stacks are seeded: ragged and
homogeneous leaves, every storable dtype, 1-3 levels of nesting, stack_dim 0 and 1.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _lazy_workers import describe
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from tdstore import (
    LazyStackedTensorDictStore,
    SchemaError,
    StoreLockedError,
    TensorDictStore,
    UnsupportedOperationError,
)
from tdstore._core.codec import DTYPE_BY_NAME
from tdstore.lazy.plan import split_index
from tdstore.testing.counts import add_cases
from tdstore.testing.strategies import rand_tensor
from tdstore.testing.wire import wire_snapshot

DTYPES = list(DTYPE_BY_NAME.values())
SEEDS = list(range(8))


# --------------------------------------------------------------------------- generators
def _is_leaf(cls: type) -> bool:
    return issubclass(cls, (torch.Tensor, NonTensorData, NonTensorStack))


class Spec:
    """The structure of one random stack: leaves with dtype and per-element shapes."""

    def __init__(self, rng: random.Random, n: int, elem_bs: tuple[int, ...], depth: int) -> None:
        self.n = n
        self.elem_bs = elem_bs
        self.tree = self._tree(rng, elem_bs, depth, 0)

    def _tree(self, rng: random.Random, bs: tuple[int, ...], depth: int, level: int) -> dict[str, Any]:
        tree: dict[str, Any] = {}
        for i in range(rng.randint(1, 3)):
            kind = rng.choice(["t", "t", "t", "nt"])
            if kind == "t":
                dtype = rng.choice(DTYPES)
                ragged = rng.random() < 0.6
                if ragged:
                    shapes = [bs + tuple(rng.randint(0, 3) for _ in range(rng.randint(1, 2))) for _ in range(self.n)]
                    if self.n > 1 and all(s == shapes[0] for s in shapes):
                        shapes[-1] = shapes[-1][:-1] + (shapes[-1][-1] + 1,)
                else:
                    feat = tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 2)))
                    shapes = [bs + feat] * self.n
                tree[f"t{level}_{i}"] = ("t", dtype, shapes)
            else:
                tree[f"nt{level}_{i}"] = ("nt", rng.choice(["str", "json", "pickle"]))
        if level + 1 < depth:
            sub_bs = bs + ((2,) if rng.random() < 0.3 else ())
            tree[f"n{level}"] = ("td", sub_bs, self._tree(rng, sub_bs, depth, level + 1))
        return tree

    def element(self, rng: random.Random, j: int) -> TensorDict:
        return self._fill(rng, self.tree, self.elem_bs, j)

    def _fill(self, rng: random.Random, tree: dict[str, Any], bs: tuple[int, ...], j: int) -> TensorDict:
        td = TensorDict(batch_size=bs)
        for key, spec in tree.items():
            if spec[0] == "t":
                td[key] = rand_tensor(rng, spec[2][j], spec[1])
            elif spec[0] == "nt":
                td[key] = NonTensorData(data=_nt_value(rng, spec[1]), batch_size=bs)
            else:
                td[key] = self._fill(rng, spec[2], spec[1], j)
        return td

    def leaves(self) -> list[tuple[tuple[str, ...], Any]]:
        out: list[tuple[tuple[str, ...], Any]] = []

        def walk(prefix: tuple[str, ...], tree: dict[str, Any]) -> None:
            for key, spec in tree.items():
                if spec[0] == "td":
                    walk(prefix + (key,), spec[2])
                else:
                    out.append((prefix + (key,), spec))

        walk((), self.tree)
        return out


def _nt_value(rng: random.Random, kind: str) -> Any:
    if kind == "str":
        return "s" * rng.randint(0, 5) + str(rng.randint(0, 99))
    if kind == "json":
        return {"a": rng.randint(0, 9), "b": [rng.random(), None, True]}
    return (rng.randint(0, 9), frozenset({rng.randint(0, 3)}))  # not JSON: pickled


def rand_stack(seed: int, stack_dim: int) -> tuple[Spec, list[TensorDict]]:
    rng = random.Random(seed * 7919 + stack_dim)
    n = rng.randint(1, 5)
    elem_bs = tuple(rng.randint(1, 3) for _ in range(rng.randint(stack_dim, 2)))
    spec = Spec(rng, n, elem_bs, depth=rng.randint(1, 3))
    return spec, [spec.element(rng, j) for j in range(n)]


# --------------------------------------------------------------------------- comparison
def as_read(ref: Any) -> Any:
    """What a lazy store's ``to_tensordict()`` returns for a stack equal to ``ref``: the stack's
    own ``to_tensordict()`` when its elements share shapes, the lazy stack itself when ragged."""
    try:
        return ref.to_tensordict()
    except RuntimeError:
        return ref


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Exact equality: types, stack dims, batch sizes, keys, dtypes, shapes, bytes, non-tensor values."""
    if isinstance(want, LazyStackedTensorDict):
        assert isinstance(got, LazyStackedTensorDict), f"{where}: {type(got).__name__} is not a lazy stack"
        assert got.stack_dim == want.stack_dim, where
        assert got.batch_size == want.batch_size, where
        assert len(got.tensordicts) == len(want.tensordicts), where
        for k, (g, w) in enumerate(zip(got.tensordicts, want.tensordicts, strict=True)):
            assert_same(g, w, f"{where}[{k}]")
        return
    if isinstance(want, (NonTensorData, NonTensorStack)):
        assert type(got) is type(want), f"{where}: {type(got).__name__} vs {type(want).__name__}"
        assert got.batch_size == want.batch_size, where
        assert got.tolist() == want.tolist(), where
        return
    if isinstance(want, TensorDictBase):
        assert isinstance(got, TensorDictBase) and not isinstance(got, LazyStackedTensorDict), f"{where}: {type(got)}"
        assert got.batch_size == want.batch_size, where
        gk = set(got.keys(True, True, is_leaf=_is_leaf))
        wk = set(want.keys(True, True, is_leaf=_is_leaf))
        assert gk == wk, f"{where}: keys {gk} vs {wk}"
        for key in wk:
            assert_same(got.get(key), want.get(key), f"{where}.{key}")
        return
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}"
        assert torch.equal(_raw(got), _raw(want)), f"{where}: values differ"
        return
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{k}]")
        return
    assert got == want, f"{where}: {got!r} vs {want!r}"


def _raw(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() and t.dtype != torch.uint8 else t.to(torch.uint8) if not t.numel() else t


def oracle(members: list[TensorDict], stack_dim: int) -> LazyStackedTensorDict:
    return LazyStackedTensorDict(*members, stack_dim=stack_dim)


def rand_index(rng: random.Random, n: int, stack_dim: int, ndim: int) -> Any:
    """An index of the stack, as a tuple positioning the stack dim entry."""
    choice = rng.choice(["int", "neg", "slice", "list", "mask", "tensor", "other-dim"])
    if choice == "int":
        entry: Any = rng.randrange(n)
    elif choice == "neg":
        entry = -rng.randint(1, n)
    elif choice == "slice":
        a = rng.randrange(n)
        entry = slice(a, rng.randint(a + 1, n), rng.choice([1, 2]))
    elif choice == "list":
        entry = [rng.randrange(n) for _ in range(rng.randint(1, 4))]
    elif choice == "mask":
        mask = torch.tensor([rng.random() < 0.6 for _ in range(n)])
        mask[rng.randrange(n)] = True
        entry = mask
    elif choice == "tensor":
        entry = torch.tensor([rng.randrange(n) for _ in range(rng.randint(1, 3))])
    else:
        # an index over another batch dim: every element is read, part of each
        other = 1 - stack_dim if ndim > 1 else None
        if other is None:
            return slice(None)
        return (slice(None),) * other + (0,)
    return (slice(None),) * stack_dim + (entry,) if stack_dim else entry


# --------------------------------------------------------------------------- differential
@pytest.mark.parametrize("stack_dim", [0, 1])
@pytest.mark.parametrize("seed", SEEDS)
def test_differential(server, seed: int, stack_dim: int, request: pytest.FixtureRequest) -> None:
    spec, members = rand_stack(seed, stack_dim)
    rng = random.Random(seed)
    ref = oracle([m.clone() for m in members], stack_dim)
    store = TensorDictStore.from_tensordict(oracle(members, stack_dim), **server.connection_kwargs())
    assert isinstance(store, LazyStackedTensorDictStore)
    counts = {"reads": 0, "writes": 0, "errors": 0, "key_ops": 0, "oracle_skips": 0}
    try:
        assert store.stack_dim == stack_dim and store.batch_size == ref.batch_size
        assert_same(store.to_tensordict(), as_read(ref), "upload")
        for _step in range(25):
            op = rng.choice(["index", "index", "leaf", "as_list", "write", "write_entry", "write_index", "inplace", "bad_write", "key"])
            ref = oracle(members, stack_dim)
            if op == "index":
                idx = rand_index(rng, spec.n, stack_dim, len(ref.batch_size))
                assert_same(store[idx], ref[idx], f"store[{idx}]")
                counts["reads"] += 1
            elif op in ("leaf", "as_list"):
                path, leaf = rng.choice(spec.leaves())
                if op == "as_list":
                    got, want = store.get(path, as_list=True), ref.get(path, as_list=True)
                    assert_same(list(got), list(want), f"get({path}, as_list)")
                else:
                    try:
                        want = ref.get(path)
                    except RuntimeError:
                        with pytest.raises(RuntimeError, match="ragged|as_list"):
                            store.get(path)
                        counts["errors"] += 1
                        continue
                    assert_same(store.get(path), want, f"get({path})")
                counts["reads"] += 1
            elif op == "write":
                j = rng.randrange(spec.n)
                new = spec.element(rng, j)
                store[(slice(None),) * stack_dim + (j,)] = new
                members[j] = new.clone()
                counts["writes"] += 1
            elif op == "write_entry":
                j = rng.randrange(spec.n)
                path, leaf = rng.choice(spec.leaves())
                value = spec.element(rng, j).get(path)
                store[(slice(None),) * stack_dim + (j,)] = TensorDict({path: value}, batch_size=[])
                members[j].set(path, value.clone() if isinstance(value, torch.Tensor) else value)
                counts["writes"] += 1
            elif op == "write_index":
                # any index, part of elements included: every tensor entry there gets one value
                idx = rand_index(rng, spec.n, stack_dim, len(ref.batch_size))
                value = rng.randint(0, 5)
                nontensor = [p for p, leaf in spec.leaves() if leaf[0] == "nt"]
                # the oracle: copies of the elements, changed in place through the lazy stack;
                # non-tensor entries stay unchanged, as tdstore and TensorDict >= 0.17 do
                copies = [m.clone() for m in members]
                try:
                    oracle(copies, stack_dim).exclude(*nontensor)[idx] = value
                except (IndexError, RuntimeError):
                    counts["oracle_skips"] += 1  # tensordict 0.14.3 cannot write some of these in memory
                    continue
                store[idx] = value
                members[:] = copies
                counts["writes"] += 1
            elif op == "inplace":
                # in-place math: a snapshot changed in memory and written back as one compare-and-set
                store.apply_(_invert)
                for m in members:
                    m.apply_(_invert)
                counts["writes"] += 1
            elif op == "bad_write":
                ragged = [(p, s) for p, s in spec.leaves() if s[0] == "t"]
                if not ragged:
                    continue
                path, leaf = rng.choice(ragged)
                j = rng.randrange(spec.n)
                shape = list(leaf[2][j])
                if len(shape) > len(spec.elem_bs):
                    shape[-1] += 2  # never broadcastable to the old shape
                else:
                    shape.append(2)
                before = wire_snapshot(server)
                with pytest.raises(SchemaError, match=rf"element {j}.*keep their shapes"):
                    store[(slice(None),) * stack_dim + (j,)] = TensorDict({path: torch.zeros(shape, dtype=leaf[1])}, [])
                assert wire_snapshot(server) == before, "a refused element write changed the server"
                counts["errors"] += 1
            else:
                _key_op(rng, store, members, spec, stack_dim)
                counts["key_ops"] += 1
            assert_same(store.to_tensordict(), as_read(oracle(members, stack_dim)), f"after {op}")
        # a fresh handle (by td_id) and a pickled one see the same stack
        again = LazyStackedTensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs())
        assert_same(again.to_tensordict(), as_read(oracle(members, stack_dim)), "from_store")
        again.close()
        if server.kind != "fakeredis":  # an in-process server cannot be reached from a pickle
            assert_same(pickle.loads(pickle.dumps(store)).to_tensordict(), as_read(oracle(members, stack_dim)), "pickle")
    finally:
        store.clear_redis()
        store.close()
    assert not wire_snapshot(server), "clear_redis left keys behind"
    add_cases(request, f"lazy differential cases on {server.kind}", **counts)


def _invert(t: torch.Tensor) -> torch.Tensor:
    """Every bit inverted (bool: logical not): defined for every dtype, float8 included."""
    if t.dtype == torch.bool:
        return ~t
    flat = t.contiguous().reshape(-1)
    if not flat.numel():
        return t.clone()
    return (~flat.view(torch.uint8)).view(t.dtype).reshape(t.shape)


def _key_op(rng: random.Random, store: LazyStackedTensorDictStore, members: list[TensorDict], spec: Spec, stack_dim: int) -> None:
    """Adds, renames or deletes a top-level key on the store and on every oracle element."""
    keys = [k for k in members[0].keys() if not k.startswith("n") and k in spec.tree]
    choice = rng.choice(["add_ragged", "add_tensor", "add_nt", "rename", "delete"])
    name = f"k{rng.randrange(1000)}"
    if choice == "add_ragged":
        dtype = rng.choice(DTYPES)
        values = [rand_tensor(rng, spec.elem_bs + (j + 1,), dtype) for j in range(spec.n)]
        store[name] = LazyStackedTensorDict(*[TensorDict({"v": v}, spec.elem_bs) for v in values], stack_dim=stack_dim)
        for m, v in zip(members, values, strict=True):
            m[name] = TensorDict({"v": v.clone()}, spec.elem_bs)
        spec.tree[name] = ("td", spec.elem_bs, {"v": ("t", dtype, [tuple(v.shape) for v in values])})
    elif choice == "add_tensor":
        full = store.batch_size
        value = rand_tensor(rng, tuple(full) + (2,), rng.choice(DTYPES))
        store[name] = value
        for m, v in zip(members, value.unbind(stack_dim), strict=True):
            m[name] = v.clone()
        spec.tree[name] = ("t", value.dtype, [spec.elem_bs + (2,)] * spec.n)
    elif choice == "add_nt":
        store[name] = "constant"
        for m in members:
            m[name] = "constant"
        spec.tree[name] = ("nt", "str")
    elif choice == "rename" and keys:
        old = rng.choice(keys)
        store.rename_key_(old, name)
        for m in members:
            m.rename_key_(old, name)
        _rename_spec(spec, old, name)
    elif choice == "delete" and len(keys) > 1:
        old = rng.choice(keys)
        del store[old]
        for m in members:
            del m[old]
        spec.tree.pop(old, None)


def _rename_spec(spec: Spec, old: str, new: str) -> None:
    if old in spec.tree:
        spec.tree[new] = spec.tree.pop(old)


# --------------------------------------------------------------------------- unit tests
def _ragged(stack_dim: int = 0) -> LazyStackedTensorDict:
    a = TensorDict({"x": torch.arange(12.0).reshape(3, 4), "h": torch.arange(3), "s": {"y": torch.zeros(3, 2)}, "nt": "a"}, [3])
    b = TensorDict({"x": torch.arange(15.0).reshape(3, 5), "h": torch.arange(3) + 3, "s": {"y": torch.ones(3, 2)}, "nt": "b"}, [3])
    return LazyStackedTensorDict(a, b, stack_dim=stack_dim)


def test_split_index_unit() -> None:
    assert split_index(1, 2, 0, 4) == ([1], (0,), 1)
    members, remapped, pick = split_index([3, 1, 3], 2, 0, 4)
    assert members == [1, 3] and pick == [3, 1, 3] and remapped[0].tolist() == [1, 0, 1]
    assert split_index((slice(None), 2), 2, 1, 4)[2] == 2
    assert split_index((0, slice(None)), 2, 1, 4)[2] is None
    assert split_index(slice(1, 3), 2, 0, 4)[0] == [1, 2]
    with pytest.raises(IndexError, match="out of bounds"):
        split_index(7, 2, 0, 4)


def test_wire_layout_and_kind(server) -> None:
    ref = _ragged()
    store = LazyStackedTensorDictStore.from_lazy_stack(ref, **server.connection_kwargs())
    try:
        wire = wire_snapshot(server)
        meta = next(v for k, (t, v) in wire.items() if k.endswith(b":meta"))
        assert meta[b"kind"] == b"lazy" and meta[b"stack_dim"] == b"0"
        assert json.loads(meta[b"batch_size"]) == [2, 3]
        reg = next(v for k, (t, v) in wire.items() if k.endswith(b":reg"))
        x = json.loads(reg[b"x"])
        assert x["shapes"] == [[3, 4], [3, 5]] and x["dtype"] == "float32"
        assert json.loads(reg[b"h"])["shape"] == [3]
        data = next(v for k, (t, v) in wire.items() if k.endswith(b":d:x"))
        assert data == ref.tensordicts[0]["x"].numpy().tobytes() + ref.tensordicts[1]["x"].numpy().tobytes()
        with pytest.raises(UnsupportedOperationError, match="LazyStackedTensorDictStore.from_store"):
            TensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs())
        plain = TensorDictStore.from_dict({"a": torch.zeros(2)}, batch_size=[2], **server.connection_kwargs())
        with pytest.raises(UnsupportedOperationError, match="not a lazy stack"):
            LazyStackedTensorDictStore.from_store(td_id=plain.td_id, **server.connection_kwargs())
        plain.clear_redis()
        plain.close()
    finally:
        store.clear_redis()
        store.close()


@pytest.mark.parametrize("stack_dim", [0, 1])
def test_reads_match_lazy_stack(server, stack_dim: int) -> None:
    ref = _ragged(stack_dim)
    store = LazyStackedTensorDictStore.from_lazy_stack(ref, **server.connection_kwargs())
    try:
        assert store.batch_size == ref.batch_size and len(store) == len(ref)
        assert_same(store.to_tensordict(), as_read(ref))
        assert_same(store["h"], ref["h"])
        assert_same(store["s"]["y"], ref["s"]["y"])
        assert isinstance(store["s"], LazyStackedTensorDictStore) and store["s"].batch_size == ref["s"].batch_size
        assert store["nt"] == ref["nt"]
        with pytest.raises(UnsupportedOperationError, match=r"ragged .*as_list=True.*store\[j\].*to_tensordict"):
            store["x"]
        assert_same(store.get("x", as_list=True), ref.get("x", as_list=True))
        nested = store.get("x", as_nested_tensor=True)
        assert nested.is_nested and torch.equal(nested[1], ref.tensordicts[1]["x"])
        try:
            padded = ref.get("x", as_padded_tensor=True)
        except RuntimeError:  # tensordict 0.14.3 pads only the first dim of each element
            with pytest.raises(RuntimeError):
                store.get("x", as_padded_tensor=True)
        else:
            assert_same(store.get("x", as_padded_tensor=True), padded)
        elem = (slice(None),) * stack_dim + (1,)
        assert_same(store[elem], ref[elem])
        assert set(store.keys(True, True)) == set(ref.keys(True, True))
        assert store.entry_class("s") is LazyStackedTensorDictStore
        assert store.get("missing", "default") == "default"
        # a nested key is a lazy store of its own: reads and writes through it
        assert_same(store["s"].to_tensordict(), as_read(ref["s"]))
        store["s"][elem] = TensorDict({"y": torch.full((3, 2), 5.0)}, [3])
        assert store[elem]["s", "y"].eq(5).all()
        with pytest.raises(KeyError, match="missing"):
            store["missing"]
    finally:
        store.clear_redis()
        store.close()


def test_element_write_errors_leave_data(server) -> None:
    ref = _ragged()
    store = LazyStackedTensorDictStore.from_lazy_stack(ref, **server.connection_kwargs())
    try:
        before = wire_snapshot(server)
        with pytest.raises(SchemaError, match=r"key \('x',\) at element 1 .*\[3, 5\]"):
            store[1] = TensorDict({"x": torch.zeros(3, 6)}, [3])
        with pytest.raises(KeyError, match="not in"):
            store[0] = TensorDict({"zz": torch.zeros(3)}, [3])
        with pytest.raises(UnsupportedOperationError, match="whole elements"):
            store[:, 0] = TensorDict({"nt": "q"}, [2])
        assert wire_snapshot(server) == before
        # a non-tensor and a tensor of one element, in one write
        store[1] = TensorDict({"nt": "changed", "h": torch.tensor([7, 8, 9])}, [3])
        got = store[1]
        assert got["nt"] == "changed" and got["h"].tolist() == [7, 8, 9]
        # part of every element (a batch dim that is not the stack dim)
        store[:, 0] = 0
        assert store[0]["x"][0].abs().sum() == 0 and store[1]["x"][0].abs().sum() == 0
        assert store[0]["x"][1].abs().sum() > 0
        store.set_at_("h", torch.tensor(-1), (0, 2))
        assert store[0]["h"].tolist() == [0, 1, -1]
    finally:
        store.clear_redis()
        store.close()


def test_upload_refusals_write_nothing(server) -> None:
    kw = server.connection_kwargs()
    a = TensorDict({"x": torch.zeros(2)}, [])
    b = TensorDict({"x": torch.zeros(2, dtype=torch.int32)}, [])
    with pytest.raises(SchemaError, match=r"different dtypes"):
        LazyStackedTensorDictStore.from_lazy_stack(LazyStackedTensorDict(a, b), **kw)
    c = TensorDict({"y": torch.zeros(2)}, [])
    with pytest.raises(SchemaError, match=r"differ in their keys.*element 1"):
        LazyStackedTensorDictStore.from_lazy_stack(LazyStackedTensorDict(a, c), **kw)
    with pytest.raises(TypeError, match="expects a LazyStackedTensorDict"):
        LazyStackedTensorDictStore.from_lazy_stack(a, **kw)
    assert not wire_snapshot(server)


def test_layout_changes_seen_by_other_handles(server) -> None:
    kw = server.connection_kwargs()
    store = LazyStackedTensorDictStore.from_lazy_stack(_ragged(), **kw)
    other = LazyStackedTensorDictStore.from_store(td_id=store.td_id, **kw)
    try:
        assert "x" in other.keys()
        # another client replaces x with other shapes: the cached layout must not be used
        store["x"] = LazyStackedTensorDict(*[TensorDict({"a": torch.full((3, k), float(k))}, [3]) for k in (1, 2)], stack_dim=0)
        assert isinstance(other["x"], LazyStackedTensorDictStore)
        assert other[1]["x", "a"].shape == (3, 2)
        with pytest.raises(SchemaError, match="keep their shapes"):
            other[0] = TensorDict({"x": {"a": torch.zeros(3, 5)}}, [3])
        other[0] = TensorDict({"x": {"a": torch.full((3, 1), 9.0)}}, [3])
        assert store[0]["x", "a"].flatten().tolist() == [9.0, 9.0, 9.0]
        other.rename_key_("h", "hh")
        assert "hh" in store.keys() and "h" not in store.keys()
        store.lock_()
        assert other.is_locked
        with pytest.raises(StoreLockedError):
            other[0] = TensorDict({"hh": torch.zeros(3, dtype=torch.long)}, [3])
        with pytest.raises(StoreLockedError):
            other["new"] = torch.zeros(2, 3)
        store.unlock_()
        other[0] = TensorDict({"hh": torch.zeros(3, dtype=torch.long)}, [3])
        assert store[0]["hh"].tolist() == [0, 0, 0]
    finally:
        other.close()
        store.clear_redis()
        store.close()
    assert not wire_snapshot(server)


def test_clone_and_unsupported(server) -> None:
    store = LazyStackedTensorDictStore.from_lazy_stack(_ragged(1), **server.connection_kwargs())
    try:
        copy = store.clone()
        assert copy.td_id != store.td_id and isinstance(copy, LazyStackedTensorDictStore)
        assert_same(copy.to_tensordict(), store.to_tensordict())
        copy.clear_redis()
        copy.close()
        with pytest.raises(UnsupportedOperationError, match="update_"):
            store.update_({"h": torch.zeros(3, 2, dtype=torch.long)})
        with pytest.raises(UnsupportedOperationError, match="to_tensordict"):
            store.view(-1)
        assert_same(store.select("h"), _ragged(1).select("h"))
    finally:
        store.clear_redis()
        store.close()
    store.close()  # idempotent


# --------------------------------------------------------------------------- other processes
def test_reconnect_from_spawned_process(real_server, tmp_path: Path) -> None:
    """A spawned process reconnects by td_id, and by a pickled handle, and reads the stack exactly."""
    stores, jobs, expected = [], [], {}
    try:
        for stack_dim in (0, 1):
            _, members = rand_stack(100 + stack_dim, stack_dim)
            ref = oracle(members, stack_dim)
            store = LazyStackedTensorDictStore.from_lazy_stack(ref, **real_server.connection_kwargs())
            stores.append(store)
            request = json.dumps({"td_id": store.td_id, "kwargs": real_server.connection_kwargs()})
            handle_file = tmp_path / f"handle{stack_dim}.pkl"
            handle_file.write_bytes(pickle.dumps(store))
            for mode, arg in (("by_id", request), ("pickled", str(handle_file))):
                out = str(tmp_path / f"{mode}{stack_dim}.pkl")
                jobs.append([mode, arg, out])
                expected[out] = describe(ref)
        (tmp_path / "jobs.json").write_text(json.dumps(jobs))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), *sys.path]))
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).parent / "_lazy_workers.py"), str(tmp_path / "jobs.json")],
            capture_output=True, text=True, timeout=120, env=env,
        )
        assert proc.returncode == 0, proc.stderr
        for out, want in expected.items():
            assert pickle.loads(Path(out).read_bytes()) == want, out
    finally:
        for store in stores:
            store.clear_redis()
            store.close()


@pytest.mark.multiprocess
def test_concurrent_element_writes_never_torn(real_server, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Two writer processes rewrite whole ragged elements while this process reads them.

    Every write sets every value of one element to one stamp, so a read that mixes two
    writes (torn) shows two stamps in one element. Bounded: 2 x 40 writes, 40 s of reads.
    """
    import time

    from tdstore.testing.counts import record

    n, count = 6, 40
    members = [TensorDict({"a": torch.zeros(j + 1, dtype=torch.float64), "b": torch.zeros(4, dtype=torch.long)}, []) for j in range(n)]
    store = LazyStackedTensorDictStore.from_lazy_stack(LazyStackedTensorDict(*members), **real_server.connection_kwargs())
    procs = []
    try:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), *sys.path]))
        for w in (1, 2):
            job = {"td_id": store.td_id, "kwargs": real_server.connection_kwargs(), "writer": w, "count": count, "seed": w, "n": n}
            jobs = tmp_path / f"jobs{w}.json"
            jobs.write_text(json.dumps([["writer", json.dumps(job), str(tmp_path / f"written{w}.json")]]))
            procs.append(subprocess.Popen(
                [sys.executable, str(Path(__file__).parent / "_lazy_workers.py"), str(jobs)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            ))
        torn = checked = 0
        deadline = time.monotonic() + 40
        rng = random.Random(0)
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            for td in _read_some(store, rng, n):
                stamps = set(td["a"].tolist()) | set(td["b"].tolist())
                checked += 1
                torn += len(stamps) != 1
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
        written: dict[int, set[int]] = {}
        for w in (1, 2):
            for j, stamps in json.loads((tmp_path / f"written{w}.json").read_text()).items():
                written.setdefault(int(j), set()).update(stamps)
        final = store.to_tensordict().to_lazystack(0)
        lost = 0
        for j, td in enumerate(final.tensordicts):
            stamps = set(td["a"].tolist()) | set(td["b"].tolist())
            assert len(stamps) == 1, f"element {j} is torn at rest: {stamps}"
            lost += bool(written.get(j)) and stamps.pop() not in written[j]
        record(request, reads=checked, torn_reads=f"{torn}/{checked}", elements_not_last_written=f"{lost}/{n}")
        assert checked > 0 and torn == 0 and lost == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        store.clear_redis()
        store.close()


def _read_some(store: LazyStackedTensorDictStore, rng: random.Random, n: int) -> list[TensorDict]:
    """Elements read in one step each: ``store[j].to_tensordict()`` (an element view reads each key
    it is asked for from the server, so two keys read through it may come from two writes), a
    lazy stack of several, or every element."""
    choice = rng.randrange(3)
    if choice == 0:
        return [store[rng.randrange(n)].to_tensordict()]
    if choice == 1:
        return [td.to_tensordict() for td in store[[rng.randrange(n) for _ in range(3)]].tensordicts]
    return [td.to_tensordict() for td in store.tensordicts]


def test_nontensor_stacks_and_corrupt_metadata(server) -> None:
    """Elements holding NonTensorStacks round-trip; hand-corrupted metadata and lost bytes raise clearly."""
    from tdstore import CorruptMetadataError, DataLostError

    a = TensorDict({"x": torch.zeros(2), "labels": NonTensorStack("p", "q")}, [2])
    b = TensorDict({"x": torch.ones(2), "labels": NonTensorStack("r", "s")}, [2])
    ref = LazyStackedTensorDict(a, b, stack_dim=1)
    store = LazyStackedTensorDictStore.from_lazy_stack(ref, **server.connection_kwargs())
    client = server.sync_client()
    try:
        assert_same(store.to_tensordict(), as_read(ref))
        assert store[:, 1]["labels"] == ["r", "s"]
        reg = next(k for k in client.scan_iter(count=1000) if k.endswith(b":reg"))
        client.hset(reg, "x", json.dumps({"k": "lt", "dtype": "float32", "shapes": [[2]], "o": [1, 1]}))
        with pytest.raises(CorruptMetadataError, match=r"\('x',\).*needs a shape or 2 element shapes"):
            LazyStackedTensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs())
        client.hset(reg, "x", json.dumps({"k": "lt", "dtype": "float32", "shape": [2], "o": [1, 1]}))
        data = next(k for k in client.scan_iter(count=1000) if k.endswith(b":d:x"))
        client.delete(data)
        with pytest.raises(DataLostError, match=r"\('x',\)"):
            LazyStackedTensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs())[0]
    finally:
        client.close()
        store.clear_redis()
        store.close()


def test_too_large_leaf_writes_nothing(real_server) -> None:
    """A leaf over the server's proto-max-bulk-len is refused before anything is sent."""
    client = real_server.sync_client()
    old = client.config_get("proto-max-bulk-len")["proto-max-bulk-len"]
    client.config_set("proto-max-bulk-len", 1024 * 1024)
    try:
        members = [TensorDict({"big": torch.zeros(200_000 + j)}, []) for j in range(2)]  # 1.6 MB together
        from tdstore import EntryTooLargeError

        with pytest.raises(EntryTooLargeError, match=r"\('big',\).*proto-max-bulk-len"):
            LazyStackedTensorDictStore.from_lazy_stack(LazyStackedTensorDict(*members), **real_server.connection_kwargs())
        assert not wire_snapshot(real_server)
    finally:
        client.config_set("proto-max-bulk-len", old)
        client.close()


def test_update_and_recreate_after_clear(server) -> None:
    """update() with a ragged lazy stack adds its keys in one step; a write after clear_redis() recreates the stack."""
    ref = _ragged()
    store = LazyStackedTensorDictStore.from_lazy_stack(ref, **server.connection_kwargs())
    try:
        extra = LazyStackedTensorDict(TensorDict({"y": torch.ones(3, 1)}, [3]),
                                      TensorDict({"y": torch.ones(3, 4)}, [3]))
        store.update(extra)
        assert store.get("y", as_list=True)[1].shape == (3, 4)
        store.update({"w": torch.arange(6).reshape(2, 3), "skipped": torch.zeros(2, 3)}, keys_to_update=["w"])
        assert store["w"].tolist() == [[0, 1, 2], [3, 4, 5]] and "skipped" not in store.keys()
        store.clear_redis()
        assert not wire_snapshot(server)
        with pytest.raises(KeyError, match="No LazyStackedTensorDictStore"):
            store[0]
        store["q"] = torch.arange(6).reshape(2, 3)  # recreates the stack (same batch size and stack dim), no other keys
        assert list(store.keys()) == ["q"] and store.batch_size == ref.batch_size
        assert_same(store.to_tensordict(), as_read(LazyStackedTensorDict(*[TensorDict({"q": torch.arange(3) + 3 * j}, [3]) for j in range(2)])))
    finally:
        store.clear_redis()
        store.close()


@pytest.mark.multiprocess
def test_concurrent_inplace_math_loses_no_update(real_server, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Two processes each run ``store.add_(1)`` 15 times on a ragged stack: every increment lands."""
    from tdstore.testing.counts import record

    count = 15
    members = [TensorDict({"a": torch.zeros(j + 1, dtype=torch.long)}, []) for j in range(3)]
    store = LazyStackedTensorDictStore.from_lazy_stack(LazyStackedTensorDict(*members), **real_server.connection_kwargs())
    try:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), *sys.path]))
        procs = []
        for w in (1, 2):
            job = {"td_id": store.td_id, "kwargs": real_server.connection_kwargs(), "count": count}
            jobs = tmp_path / f"add{w}.json"
            jobs.write_text(json.dumps([["adder", json.dumps(job), str(tmp_path / f"done{w}")]]))
            procs.append(subprocess.Popen(
                [sys.executable, str(Path(__file__).parent / "_lazy_workers.py"), str(jobs)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            ))
        for p in procs:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err
        final = store.to_tensordict().to_lazystack(0)
        values = [int(v) for td in final.tensordicts for v in td["a"].tolist()]
        lost = sum(2 * count - v for v in values)
        record(request, increments=2 * count * len(values), lost_increments=lost)
        assert values == [2 * count] * len(values)
    finally:
        store.clear_redis()
        store.close()


def test_element_view_reads_through_to_the_server(server) -> None:
    """``L[0]`` shows what another handle wrote after the view was made, as an element of a
    LazyStackedTensorDict shows writes made through its stack (issue: reads read the server)."""
    stack = LazyStackedTensorDict(
        TensorDict({"v": torch.zeros(2), "s": TensorDict({"x": torch.zeros(3)}, [])}, []),
        TensorDict({"v": torch.zeros(2), "s": TensorDict({"x": torch.zeros(3)}, [])}, []),
    )
    ref = stack.clone()
    store = LazyStackedTensorDictStore.from_lazy_stack(stack, **server.connection_kwargs())
    view, ref_view = store[0], ref[0]
    other = LazyStackedTensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs())
    new = TensorDict({"v": torch.ones(2), "s": TensorDict({"x": torch.full((3,), 2.0)}, [])}, [])
    other[0] = new
    ref[0] = new
    for key in ("v", ("s", "x")):
        assert torch.equal(view[key], ref_view[key]), key
    assert torch.equal(view["s"]["x"], ref_view["s"]["x"])
    assert torch.equal(view.to_tensordict()["v"], ref_view["v"])
    other.close()
    store.clear_redis()
    store.close()
