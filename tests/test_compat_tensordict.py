"""The store behaves the same on tensordict 0.14.3 and 0.15.x (TorchRL 0.14.1 pins 0.14.3).

The main CI run covers 0.15.x; the 0.14.3 step of ``.ci/run`` runs this module again, where
``tdstore.base.compat`` supplies what TensorDictBase lacks. Every check compares the store with
an in-memory TensorDict given the same operations, and reads the result back through a
second handle (``from_store``), so a change kept only in a local copy fails.
"""

from __future__ import annotations

import operator

import pytest
import torch
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore.base.compat import NEEDS_COMPAT, TENSORDICT_VERSION
from tdstore.errors import UnsupportedOperationError


def _pair(server):
    local = TensorDict(
        {"a": torch.arange(6, dtype=torch.float32).reshape(3, 2), "n": {"b": torch.ones(3, dtype=torch.float64)}},
        batch_size=[3],
    )
    store = TensorDictStore.from_tensordict(local, **server.connection_kwargs())
    return local, store


def _reread(server, store):
    return TensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs()).to_tensordict()


def test_compat_flag_matches_version():
    assert NEEDS_COMPAT == TENSORDICT_VERSION.startswith("0.14.")


INPLACE = [
    ("add_", (2.0,)),
    ("sub_", (1.0,)),
    ("mul_", (3.0,)),
    ("div_", (2.0,)),
    ("pow_", (2.0,)),
    ("clamp_min_", (2.0,)),
    ("clamp_max_", (2.0,)),
    ("zero_", ()),
    ("neg_", ()),
    ("exp_", ()),
    ("sqrt_", ()),
    ("lerp_", (torch.tensor(10.0), 0.5)),
]


@pytest.mark.parametrize("name,args", INPLACE, ids=[n for n, _ in INPLACE])
def test_inplace_math_reaches_the_server(server, name, args):
    local, store = _pair(server)
    if name == "lerp_":
        args = (local.clone().fill_("a", 10.0).fill_(("n", "b"), 10.0), 0.5)
    out = getattr(store, name)(*args)
    getattr(local, name)(*args)
    assert out is store
    assert (_reread(server, store) == local).all(), name


@pytest.mark.parametrize("op", ["__iadd__", "__isub__", "__imul__", "__itruediv__"])
def test_augmented_assignment(server, op):
    local, store = _pair(server)
    res = getattr(store, op)(2.0)
    getattr(local, op)(2.0)
    assert res is store
    assert (_reread(server, store) == local).all()


def test_apply_inplace_and_masked_fill_(server):
    local, store = _pair(server)
    mask = torch.tensor([True, False, True])
    store.apply_(lambda t: t * 10)
    local.apply_(lambda t: t * 10)
    store.masked_fill_(mask, -1.0)
    local.masked_fill_(mask, -1.0)
    assert (_reread(server, store) == local).all()


def test_read_only_methods_match_memory(server):
    local, store = _pair(server)
    for op in (operator.ge, operator.gt, operator.le, operator.lt, operator.eq, operator.ne):
        assert (op(store, 2.0) == op(local, 2.0)).all(), op
    flags = TensorDictStore.from_tensordict(local > 2, **server.connection_kwargs())
    assert type(flags | (local < 1)) is TensorDict
    assert ((flags | (local < 1)) == ((local > 2) | (local < 1))).all()
    assert ((flags ^ (local < 1)) == ((local > 2) ^ (local < 1))).all()
    assert bool(store.any()) and not bool(store.all())
    assert (store.all(dim=0) == local.all(dim=0)).all()
    mask = torch.tensor([True, False, True])
    assert (store.masked_select(mask) == local.masked_select(mask)).all()
    assert (store.masked_fill(mask, 7.0) == local.masked_fill(mask, 7.0)).all()
    assert torch.equal(_reread(server, store)["a"], local["a"])  # masked_fill left the store unchanged
    assert (store.sum() == local.sum()).all()
    assert (store.apply(lambda t: t + 1) == local.apply(lambda t: t + 1)).all()
    assert list(store.select("a").keys()) == ["a"]
    assert list(store.exclude("a").keys()) == ["n"]
    assert (store[1:] == local[1:]).all()


def test_names_popitem_and_exclude_inplace(server):
    _, store = _pair(server)
    assert store.names == [None]
    store.names = ["time"]
    assert TensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs()).names == ["time"]
    store["z"] = torch.zeros(3)
    key, value = store.popitem()
    assert key == "z" and torch.equal(value, torch.zeros(3))
    assert "z" not in store.keys()
    for method in (store.exclude, store.select):
        with pytest.raises(RuntimeError, match="inplace"):
            method("a", inplace=True)
    assert sorted(_reread(server, store).keys()) == ["a", "n"]


def test_views_still_refused(server):
    _, store = _pair(server)
    with pytest.raises(UnsupportedOperationError, match="to_tensordict"):
        store.unbind(0)
    with pytest.raises(UnsupportedOperationError, match="to_tensordict"):
        store.repeat(2)


def test_no_private_tensordict_name_outside_tdcompat():
    """tensordict's private names differ between releases (``_KeyThroughLeafError`` is 0.15 only):
    every use goes through ``tdstore._core.tdcompat``, which falls back where a release lacks one."""
    import ast
    import pathlib

    import tdstore

    root = pathlib.Path(tdstore.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() == "_core/tdcompat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tensordict":
                private = [a.name for a in node.names if a.name.startswith("_")]
                private += [part for part in (node.module or "").split(".") if part.startswith("_")]
                found += [f"{path.relative_to(root)}:{node.lineno}: {name}" for name in private]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = node.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(base, ast.Name) and base.id == "tensordict":
                    found.append(f"{path.relative_to(root)}:{node.lineno}: tensordict...{node.attr}")
    assert found == []


def test_get_through_a_leaf_on_every_release(server):
    """``get(("a", "x"))`` with ``a`` a tensor: a ValueError naming the key and the store, as
    TensorDict raises on 0.14 and 0.15. With a default passed, the store does what the installed
    TensorDict does: 0.15 returns the default, 0.14 raises all the same."""
    from tdstore._core.tdcompat import KeyThroughLeafError, default_covers_leaf

    local, store = _pair(server)
    try:
        with pytest.raises(ValueError):
            local.get(("a", "x"))
        with pytest.raises(KeyThroughLeafError, match=f"'a' is a Tensor.*{store.td_id}") as got:
            store.get(("a", "x"))
        assert isinstance(got.value, ValueError)
        if NEEDS_COMPAT:  # tensordict 0.14
            assert not default_covers_leaf()
            with pytest.raises(ValueError):
                local.get(("a", "x"), "dflt")
            with pytest.raises(KeyThroughLeafError):
                store.get(("a", "x"), "dflt")
        else:
            assert default_covers_leaf()
            assert local.get(("a", "x"), "dflt") == "dflt"
            assert store.get(("a", "x"), "dflt") == "dflt"
        assert store.get(("n", "missing"), None) is None
        assert (_reread(server, store) == local).all()
    finally:
        store.clear_redis()


def test_inplace_write_error_on_every_release(server):
    """``set_`` with a value of the wrong shape: tdstore's InplaceWriteError is a ValueError and a
    RuntimeError on both releases (tensordict 0.15's own class where it exists); nothing written."""
    from tdstore._core.tdcompat import InplaceWriteErrorBase
    from tdstore.errors import InplaceWriteError

    local, store = _pair(server)
    try:
        with pytest.raises(InplaceWriteError, match="'a'") as got:
            store.set_("a", torch.zeros(3, 5))
        assert isinstance(got.value, InplaceWriteErrorBase)
        assert isinstance(got.value, ValueError) and isinstance(got.value, RuntimeError)
        assert (_reread(server, store) == local).all()
    finally:
        store.clear_redis()
