"""Issue 15, sections 3-6: each example behaves as on the in-memory TensorDict / LazyStackedTensorDict.

Every test runs the same operation on the store and on the reference and compares the results
(and, for refused writes, checks that the store is unchanged).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict

from tdstore import LazyStackedTensorDictStore, SchemaError, TensorDictStore, UnsupportedOperationError
from tdstore._core.tdcompat import InplaceWriteErrorBase


def _dense(server, td):
    return TensorDictStore.from_tensordict(td, **server.connection_kwargs())


def _lazy(server, n=3):
    ref = LazyStackedTensorDict(
        *[TensorDict(m=torch.arange(6.0).reshape(3, 2) + 10 * j, r=torch.tensor(float(j))) for j in range(n)], stack_dim=0
    )
    store = TensorDictStore.from_tensordict(ref, **server.connection_kwargs())
    assert isinstance(store, LazyStackedTensorDictStore)
    return store, ref


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (a, b)


# --------------------------------------------------------------------------- section 3
@pytest.mark.parametrize("idx", [(..., 0), (..., -1), (0, 1), (slice(None), ..., 1), (1, ..., 0)])
def test_lazy_get_at_indexes_the_leaf(server, idx):
    """``get_at("m", (..., 0))`` is ``m[..., 0]``, not ``m[:, 0]`` (it was wrong data, no error)."""
    store, ref = _lazy(server)
    try:
        _same(store.get_at("m", idx), ref.get_at("m", idx))
    finally:
        store.clear_redis()


@pytest.mark.parametrize("idx", [(..., 0), (..., -1), (0, ..., 1)])
def test_lazy_set_at_indexes_the_leaf(server, idx):
    store, ref = _lazy(server)
    try:
        value = torch.tensor(-5.0)
        store.set_at_("m", value, idx)
        ref.set_at_("m", value, idx)
        _same(store["m"], ref["m"])
    finally:
        store.clear_redis()


def test_lazy_set_at_int_pair_indexes_the_leaf_as_tensordict(server):
    """``(0, 1)`` reaches the leaf's first feature dim, as ``TensorDict.set_at_`` does (the lazy
    reference raises IndexError there: recorded in tests/test_reference_harness.py)."""
    store, ref = _lazy(server)
    try:
        store.set_at_("m", torch.tensor(-1.0), (0, 1))
        dense = ref.to_tensordict()
        dense.set_at_("m", torch.tensor(-1.0), (0, 1))
        _same(store["m"], dense["m"])
    finally:
        store.clear_redis()


def test_dense_set_at_feature_dims(server):
    td = TensorDict(m=torch.arange(8.0).reshape(4, 2), batch_size=[4])
    store = _dense(server, td)
    try:
        store.set_at_("m", torch.tensor(1.0), (2, 1))  # was IndexError
        td.set_at_("m", torch.tensor(1.0), (2, 1))
        _same(store["m"], td["m"])
        _same(store.get_at("m", (2, 1)), td.get_at("m", (2, 1)))
        _same(store.get_at("m", (..., 0)), td.get_at("m", (..., 0)))
    finally:
        store.clear_redis()


def test_dense_set_at_ellipsis_reaches_the_last_leaf_dim(server):
    """On a 2-d batch, ``(..., j)`` is the leaf's last dim (it wrote batch column j, or raised)."""
    td = TensorDict(m=torch.arange(24.0).reshape(2, 3, 4), batch_size=[2, 3])
    store = _dense(server, td)
    try:
        store.set_at_("m", torch.tensor(-1.0), (..., 1))
        td.set_at_("m", torch.tensor(-1.0), (..., 1))
        _same(store["m"], td["m"])
        value = torch.arange(6.0).reshape(2, 3)
        store.set_at_("m", value, (..., 3))
        td.set_at_("m", value, (..., 3))
        _same(store["m"], td["m"])
    finally:
        store.clear_redis()


# --------------------------------------------------------------------------- section 4
def test_extra_leading_size1_dims_dense(server):
    td = TensorDict(rew=torch.zeros(4), batch_size=[4])
    store = _dense(server, td)
    try:
        store[2] = TensorDict(rew=torch.tensor([3.0]))  # was RuntimeError
        td[2] = TensorDict(rew=torch.tensor([3.0]))
        _same(store["rew"], td["rew"])
    finally:
        store.clear_redis()


def test_extra_leading_size1_dims_lazy(server):
    store, ref = _lazy(server)
    try:
        store[1] = TensorDict(r=torch.tensor([3.0]), m=torch.ones(1, 3, 2))  # was SchemaError
        dense = ref.to_tensordict()
        dense[1] = TensorDict(r=torch.tensor([3.0]), m=torch.ones(1, 3, 2))
        _same(store["r"], dense["r"])
        _same(store["m"], dense["m"])
    finally:
        store.clear_redis()


def test_nontensor_in_nested_td_with_more_batch_dims(server):
    td = TensorDict(sub=TensorDict(x=torch.zeros(4, 3), tag="a", batch_size=[4, 3]), batch_size=[4])
    store = _dense(server, td)
    try:
        value = TensorDict(sub=TensorDict(x=torch.ones(2, 3), tag="q", batch_size=[2, 3]), batch_size=[2])
        store[1:3] = value  # was UnsupportedOperationError
        td[1:3] = value
        got = store.to_tensordict()
        _same(got["sub", "x"], td["sub", "x"])
        assert got["sub"].get("tag").tolist() == td["sub"].get("tag").tolist()
        assert got["sub"].batch_size == td["sub"].batch_size
    finally:
        store.clear_redis()


def test_set_at_plain_value_on_nontensor_entry(server):
    td = TensorDict(r=torch.zeros(4), batch_size=[4])
    td["label"] = "a"
    store = _dense(server, td)
    try:
        store.set_at_("label", "z", 1)  # was UnsupportedOperationError ("is a nested tensordict")
        td.set_at_("label", "z", 1)
        got = store.get_at("label", 1)
        assert isinstance(got, NonTensorData) and got.data == td.get_at("label", 1).data == "z"
        assert store.get("label").tolist() == td.get("label").tolist()
    finally:
        store.clear_redis()


# --------------------------------------------------------------------------- section 5
@pytest.mark.parametrize("idx", [torch.tensor([0, 2]), [0, 2], torch.tensor([True, False, True, False])])
def test_advanced_index_with_another_dtype_raises_as_tensordict(server, idx):
    """Float rows into a uint8 entry through a list/tensor/mask index: TensorDict's error, nothing
    written (they were cast: 0.5 became 0)."""
    td = TensorDict(obs=torch.zeros(4, 2, dtype=torch.uint8), batch_size=[4])
    store = _dense(server, td)
    try:
        value = TensorDict(obs=torch.full((2, 2), 7.5), batch_size=[2])
        with pytest.raises(RuntimeError) as want:
            td[idx] = value
        with pytest.raises(type(want.value), match="dtypes match"):
            store[idx] = value
        with pytest.raises(type(want.value), match="dtypes match"):
            store.set_at_("obs", torch.full((2, 2), 7.5), idx)
        _same(store["obs"], torch.zeros(4, 2, dtype=torch.uint8))  # nothing written
    finally:
        store.clear_redis()


@pytest.mark.parametrize("idx", [1, slice(0, 2), ...])
def test_basic_index_with_another_dtype_casts_as_tensordict(server, idx):
    td = TensorDict(obs=torch.zeros(4, 2, dtype=torch.uint8), batch_size=[4])
    store = _dense(server, td)
    try:
        value = torch.tensor(7.5)
        store.set_at_("obs", value, idx)
        td.set_at_("obs", value, idx)
        _same(store["obs"], td["obs"])
    finally:
        store.clear_redis()


def test_set_wrong_shape_raises_tensordict_inplace_error(server):
    td = TensorDict(obs=torch.zeros(4, 3), batch_size=[4])
    store = _dense(server, td)
    try:
        with pytest.raises(InplaceWriteErrorBase):
            td.set_("obs", torch.ones(4, 5))
        with pytest.raises(InplaceWriteErrorBase, match="obs"):
            store.set_("obs", torch.ones(4, 5))
        _same(store["obs"], torch.zeros(4, 3))
    finally:
        store.clear_redis()


def test_lazy_element_that_does_not_fit_is_a_runtime_error(server):
    store, ref = _lazy(server)
    try:
        before = store["m"].clone()
        with pytest.raises(RuntimeError):
            ref[0] = TensorDict(m=torch.ones(3, 5))
        with pytest.raises(RuntimeError) as got:
            store[0] = TensorDict(m=torch.ones(3, 5))
        assert isinstance(got.value, SchemaError) and isinstance(got.value, InplaceWriteErrorBase)
        _same(store["m"], before)
    finally:
        store.clear_redis()


def test_unsupported_operation_is_not_implemented(server):
    assert issubclass(UnsupportedOperationError, NotImplementedError)
    assert issubclass(UnsupportedOperationError, RuntimeError)
    store = _dense(server, TensorDict(x=torch.zeros(2), batch_size=[2]))
    try:
        with pytest.raises(NotImplementedError):
            store.view(-1)
    finally:
        store.clear_redis()


# --------------------------------------------------------------------------- section 6
def test_root_names_set_nested_leading_names(server):
    td = TensorDict(
        sub=TensorDict(x=torch.zeros(4, 3), deep=TensorDict(y=torch.zeros(4, 3, 2), batch_size=[4, 3, 2]), batch_size=[4, 3]),
        batch_size=[4],
    )
    store = _dense(server, td)
    try:
        store["sub"].names = [None, "b"]
        td["sub"].names = [None, "b"]
        for names in (["env"], None):
            store.names = names
            td.names = names
            assert store["sub"].names == td["sub"].names
            assert store["sub", "deep"].names == td["sub", "deep"].names
    finally:
        store.clear_redis()


def test_lazy_to_local_warns_like_dense(server):
    store, ref = _lazy(server)
    try:
        with pytest.warns(DeprecationWarning, match="to_local"):
            got = store.to_local()
        assert type(got) is type(ref.to_tensordict())
    finally:
        store.clear_redis()


def test_lazy_to_tensordict_is_what_the_stack_returns(server):
    store, ref = _lazy(server)
    try:
        got, want = store.to_tensordict(), ref.to_tensordict()
        assert type(got) is type(want) is TensorDict
        assert got.batch_size == want.batch_size
        for key in want.keys():
            _same(got[key], want[key])
    finally:
        store.clear_redis()


def test_ragged_lazy_to_tensordict_stays_lazy(server):
    ref = LazyStackedTensorDict(TensorDict(x=torch.zeros(2)), TensorDict(x=torch.ones(3)), stack_dim=0)
    store = TensorDictStore.from_tensordict(ref, **server.connection_kwargs())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = store.to_tensordict()
        assert isinstance(got, LazyStackedTensorDict)
        assert [t["x"].tolist() for t in got.tensordicts] == [[0.0, 0.0], [1.0, 1.0, 1.0]]
    finally:
        store.clear_redis()


def test_peer_identity_names_read_the_public_values(server):
    """Read-only names that tensordict.store's stores have (``_td_id``, and on the lazy store
    ``_stack_dim`` and ``_count``), which its own test suite and some user code read."""
    kw = server.connection_kwargs()
    dense = TensorDictStore.from_tensordict(TensorDict({"x": torch.zeros(4, 2)}, [4]), **kw)
    stack = LazyStackedTensorDict(*[TensorDict({"x": torch.zeros(2)}, [2]) for _ in range(3)], stack_dim=1)
    lazy = LazyStackedTensorDictStore.from_lazy_stack(stack, **kw)
    try:
        assert dense._td_id == dense.td_id and lazy._td_id == lazy.td_id
        assert lazy._stack_dim == lazy.stack_dim == 1 and lazy._count == 3
        with pytest.raises(AttributeError):
            lazy._count = 5
    finally:
        dense.clear_redis()
        lazy.clear_redis()
