"""What the dense and the lazy store share (tdstore/base/handle.py), and behaves the same in both.

The two classes get their key list, ``entry_class``, lock, repr, handle construction, rename
checks and trivial overrides from one mixin, ``StoreHandle``, instead of a copy each; the
lazy store's refused methods come from the same factory as the dense store's
(``tdstore.base.unsupported.refuse``). These tests check that the members are the same
objects, and that what both do through them holds on a server.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict

import tdstore
import tdstore.errors
from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore.errors import EntryNotFoundError, StoreClosedError, UnsupportedOperationError
from tdstore.server import ServerHandle

SHARED = (
    "keys", "_key_list", "entry_class", "_entry_or_default", "_check_rename", "__repr__",
    "lock_", "unlock_", "is_locked", "_is_locked", "is_contiguous", "is_shared", "is_memmap",
    "detach_", "_rename_subtds", "close", "__enter__", "__exit__", "__eq__", "__ne__", "_handle",
)  # fmt: skip


def test_the_two_store_classes_share_one_copy_of_the_handle_machinery() -> None:
    for name in SHARED:
        dense = TensorDictStore.__dict__.get(name) or getattr(TensorDictStore, name)
        lazy = LazyStackedTensorDictStore.__dict__.get(name) or getattr(LazyStackedTensorDictStore, name)
        assert name not in TensorDictStore.__dict__ and name not in LazyStackedTensorDictStore.__dict__, name
        assert dense is lazy or getattr(dense, "__func__", dense) is getattr(lazy, "__func__", lazy), name
    # the hooks of TensorDictBase are set once too
    assert TensorDictStore._reads_return_copies is LazyStackedTensorDictStore._reads_return_copies is True


def test_every_exception_class_of_errors_is_exported_at_the_top_level() -> None:
    classes = {n for n in tdstore.errors.__all__ if isinstance(getattr(tdstore.errors, n), type)}
    assert classes <= set(tdstore.__all__), sorted(classes - set(tdstore.__all__))
    for name in classes:
        assert getattr(tdstore, name) is getattr(tdstore.errors, name), name


def _lazy(server: ServerHandle) -> LazyStackedTensorDictStore:
    a = TensorDict({"x": torch.zeros(3), "n": NonTensorData("p"), "sub": {"y": torch.ones(3, 2)}}, [])
    b = TensorDict({"x": torch.ones(4), "n": NonTensorData("q"), "sub": {"y": torch.zeros(3, 2)}}, [])
    return LazyStackedTensorDictStore.from_lazy_stack(LazyStackedTensorDict(a, b), **server.connection_kwargs())


def _dense(server: ServerHandle) -> TensorDictStore:
    store = TensorDictStore(batch_size=[2], **server.connection_kwargs())
    store["x"] = torch.zeros(2, 3)
    store["n"] = "p"
    store["sub"] = {"y": torch.ones(2, 2)}
    return store


@pytest.mark.parametrize("make", [_dense, _lazy], ids=["dense", "lazy"])
def test_lock_on_a_closed_handle_raises(server: ServerHandle, make: Any) -> None:
    """The lazy store's lock_() used to do nothing on a closed handle (the dense one raised)."""
    store = make(server)
    other = type(store).from_store(td_id=store.td_id, **server.connection_kwargs())
    store.close()
    for call in (store.lock_, store.unlock_):
        with pytest.raises(StoreClosedError):
            call()
    assert not other.is_locked  # nothing was sent
    other.lock_()
    assert other.is_locked
    other.unlock_()
    assert not other.is_locked
    other.clear_redis()
    other.close()


@pytest.mark.parametrize("make", [_dense, _lazy], ids=["dense", "lazy"])
def test_keys_entry_class_and_repr(server: ServerHandle, make: Any) -> None:
    store = make(server)
    try:
        lazy = isinstance(store, LazyStackedTensorDictStore)
        assert sorted(map(str, store.keys())) == ["n", "sub", "x"]
        assert ("sub", "y") in list(store.keys(include_nested=True))
        # non-tensor entries: leaves only for an is_leaf that says so on the lazy store (as
        # TensorDict); the dense store lists them unless is_leaf says no
        leaves = list(store.keys(include_nested=True, leaves_only=True))
        assert ("n" in leaves) is not lazy and "sub" not in leaves and ("sub", "y") in leaves
        everything = list(store.keys(True, True, is_leaf=lambda c: issubclass(c, (torch.Tensor, NonTensorData, NonTensorStack))))
        assert "n" in everything
        assert store.entry_class("x") is torch.Tensor
        assert store.entry_class("sub") is type(store)
        assert issubclass(store.entry_class("n"), (NonTensorData, NonTensorStack))
        with pytest.raises(EntryNotFoundError, match="nope"):
            store.entry_class("nope")
        text = repr(store)
        assert text.startswith(f"{type(store).__name__}(td_id={store.td_id!r}, prefix={store.prefix!r}, ")
        assert "x: float32" in text and "n: NonTensor" in text and f"sub: {type(store).__name__}[2]" in text
        assert "is_shared" not in text and store.is_shared() is False and store.detach_() is store
    finally:
        store.clear_redis()
        store.close()
    assert repr(store).endswith(", closed)")


@pytest.mark.parametrize("make", [_dense, _lazy], ids=["dense", "lazy"])
def test_rename_checks(server: ServerHandle, make: Any) -> None:
    store = make(server)
    try:
        with pytest.raises(EntryNotFoundError, match="nope"):
            store.rename_key_("nope", "other")
        with pytest.raises(KeyError, match="already present"):
            store.rename_key_("x", "n", safe=True)
        assert sorted(map(str, store.keys())) == ["n", "sub", "x"]  # unchanged
        store.rename_key_("x", "z")
        assert sorted(map(str, store.keys())) == ["n", "sub", "z"]
    finally:
        store.clear_redis()
        store.close()


def test_refused_methods_of_the_lazy_store_name_the_store_and_the_alternative(server: ServerHandle) -> None:
    store = _lazy(server)
    try:
        for name in ("fill_", "where", "batch_size_"):
            with pytest.raises(UnsupportedOperationError, match=rf"LazyStackedTensorDictStore\.{name}\(\) is not supported") as err:
                getattr(store, name)("x", 1)
            assert store.td_id in str(err.value) and f"to_tensordict().{name}(" in str(err.value)
        with pytest.raises(UnsupportedOperationError, match="cannot work on data that lives on a server"):
            store.view(-1)
    finally:
        store.clear_redis()
        store.close()


def test_a_store_given_as_a_value_or_operand_is_read_as_one_snapshot(server: ServerHandle) -> None:
    """A store of either class written into another store, or compared with one, is read
    whole by ``to_tensordict()`` (one atomic read; ``tdstore.base.handle.snapshot_of``), and
    the result is what the in-memory snapshot gives."""
    conn = server.connection_kwargs()
    same = LazyStackedTensorDictStore.from_lazy_stack(
        LazyStackedTensorDict(TensorDict({"x": torch.zeros(3)}, []), TensorDict({"x": torch.ones(3)}, [])), **conn
    )
    dense = TensorDictStore(batch_size=[2], **conn)
    try:
        dense["from_lazy"] = same
        assert torch.equal(dense["from_lazy", "x"], same.to_tensordict()["x"])
        source = TensorDictStore.from_dict({"x": torch.arange(6.0).reshape(2, 3)}, batch_size=[2], **conn)
        dense["from_dense"] = source
        assert torch.equal(dense["from_dense", "x"], source["x"])
        assert (dense["from_lazy"] == same).all()
        assert not (dense["from_dense"] == same).all()
        same[1] = TensorDict({"x": torch.full((3,), 5.0)}, [])  # a lazy element written from a dense store's row
        one = TensorDictStore.from_dict({"x": torch.full((3,), 7.0)}, batch_size=[], **conn)
        same[0] = one  # a store as the value of an element write
        assert torch.equal(same.to_tensordict()["x"], torch.stack([torch.full((3,), 7.0), torch.full((3,), 5.0)]))
        for other in (source, one):
            other.clear_redis()
    finally:
        for store in (same, dense):
            store.clear_redis()


def test_the_store_classes_are_built_from_few_bases() -> None:
    """Issue 25, item 3: the ring buffer and the lifetime are modules that take a store, the
    refused and compatibility methods are tables installed on the class, the layout cache is
    the handle's. What is left as bases: the shared handle, the reads and the writes (the
    dense class's constructors, clear_redis and pickling are its own methods, in store/core.py)."""
    dense = [b.__name__ for b in TensorDictStore.__bases__]
    lazy = [b.__name__ for b in LazyStackedTensorDictStore.__bases__]
    assert dense == ["StoreHandle", "StoreWrites", "StoreReads", "TensorDictBase"]
    assert lazy == ["StoreHandle", "LazyReads", "LazyWrites", "TensorDictBase"]
    for cls in (TensorDictStore, LazyStackedTensorDictStore):
        assert not cls.__abstractmethods__
        assert cls.__dict__["view"].__doc__.startswith("Not supported on a store")  # an installed table method
