"""The typed registry record (:class:`tdstore._core.layout.Entry`) and its wire format.

The registry JSON must not change with the record: stores written before it must read, and
stores written with it must read in older clients. ``WIRE`` holds registry values as the code
before the record wrote them (captured from stores written by it on fakeredis): each parses
and writes back byte for byte, and today's writers write the same values for the same stores.
Damaged fields raise :class:`~tdstore.errors.CorruptMetadataError` naming the entry and the field.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore._core.codec import DTYPE_BY_NAME, entry_dtype
from tdstore._core.layout import DTYPE_ITEMSIZE, Entry, parse_layout
from tdstore.errors import CorruptMetadataError

#: (store, registry field, value) as the code before the record wrote them, for the stores
#: :func:`_write_stores` makes (the layout version in "o" differs per store: a new store starts
#: at a random one)
WIRE = [
    ("dense", "big", '{"k":"t","dtype":"float32","shape":[4,64],"o":[714612009740290,1]}'),
    ("dense", "i", '{"k":"t","dtype":"int64","shape":[4],"o":[1,2]}'),
    ("dense", "n", '{"k":"td","batch_size":[4],"names":["a"],"o":[1,5]}'),
    ("dense", "n.y", '{"k":"t","dtype":"bfloat16","shape":[4,2],"o":[1,6]}'),
    ("dense", "named", '{"k":"td","batch_size":[4,5],"names":["a","b"],"o":[1,7]}'),
    ("dense", "named.z", '{"k":"t","dtype":"float32","shape":[4,5],"o":[1,8]}'),
    ("dense", "s", '{"k":"nt","enc":"json","stack":0,"o":[1,3]}'),
    ("dense", "st", '{"k":"nt","enc":"json","stack":1,"o":[1,4]}'),
    ("dense", "x", '{"k":"t","dtype":"float32","shape":[4,3],"o":[1,1]}'),
    ("chunked", "big", '{"k":"t","dtype":"float32","shape":[4,64],"o":[1,1],"c":256}'),
    ("chunked", "small", '{"k":"t","dtype":"float32","shape":[4],"o":[1,2]}'),
    ("indexed", "a", '{"k":"t","dtype":"float32","shape":[4],"o":[240269989312514,1]}'),
    ("indexed", "new", '{"k":"t","dtype":"float32","shape":[4,3],"o":[240269989312515,1]}'),
    ("indexed", "s", '{"k":"nt","enc":"json","stack":0,"o":[240269989312516,1]}'),
    ("lazy", "n", '{"k":"td","batch_size":[3],"names":null,"o":[1,4]}'),
    ("lazy", "n.y", '{"k":"lt","dtype":"float32","shape":[3,2],"o":[1,5]}'),
    ("lazy", "r", '{"k":"lt","dtype":"float32","shapes":[[3,1],[3,2],[3,3],[3,4]],"o":[1,2]}'),
    ("lazy", "s", '{"k":"lnt","enc":"json","o":[1,3]}'),
    ("lazy", "x", '{"k":"lt","dtype":"float32","shape":[3],"o":[1,1]}'),
]


def _path(field: str) -> tuple[str, ...]:
    return tuple(field.split("."))


@pytest.mark.parametrize("store, field, raw", WIRE, ids=[f"{s}-{f}" for s, f, _ in WIRE])
def test_round_trip(store: str, field: str, raw: str) -> None:
    """Every entry kind parses from the old wire JSON and writes it back byte for byte."""
    entry = Entry.from_json(_path(field), raw.encode())
    assert entry.to_json() == raw
    assert Entry.from_json(_path(field), raw) == entry == Entry.from_json(_path(field), json.loads(raw))
    assert entry.to_wire() == json.loads(raw)
    assert Entry.from_json(_path(field), entry.to_json()) == entry


def test_what_callers_ask() -> None:
    """The properties that replace the repeated dict logic."""
    by = {(s, f): Entry.from_json(_path(f), raw) for s, f, raw in WIRE}
    x, node, nt, st = by["dense", "x"], by["dense", "named"], by["dense", "s"], by["dense", "st"]
    assert (x.kind, x.dtype, x.shape, x.order, x.chunk) == ("t", "float32", (4, 3), (1, 1), None)
    assert x.is_tensor and x.has_data and not x.is_node and not x.is_non_tensor
    assert x.nbytes == 48 and x.itemsize == 4 and entry_dtype(x) is torch.float32 and x.chunking is None
    assert by["dense", "n.y"].nbytes == 16 and entry_dtype(by["dense", "n.y"]) is torch.bfloat16
    assert node.is_node and not node.has_data and node.batch_size == (4, 5) and node.dim_names == ["a", "b"]
    assert by["lazy", "n"].dim_names is None and by["lazy", "n"].names is None
    assert nt.is_non_tensor and nt.has_data and (nt.enc, nt.stack) == ("json", 0) and st.stack == 1
    big = by["chunked", "big"]
    assert big.chunk == 256 and big.chunking is not None and (big.chunking.size, big.chunking.count) == (256, 4)
    ragged, leaf = by["lazy", "r"], by["lazy", "x"]
    assert ragged.is_ragged and ragged.shape is None and ragged.shapes == ((3, 1), (3, 2), (3, 3), (3, 4))
    assert not leaf.is_ragged and leaf.shape == (3,) and not leaf.is_tensor  # a lazy leaf, not a dense tensor
    assert by["lazy", "s"].kind == "lnt" and by["lazy", "s"].has_data
    assert sorted(by.values(), key=lambda e: e.order_key)[0].order_key == (1, 1)
    assert Entry("td").order_key == (0, 0)  # written before entries had an order


def test_record_is_immutable_and_slotted() -> None:
    entry = Entry.from_json(("x",), WIRE[1][2])
    with pytest.raises(AttributeError):
        entry.shape = (5,)  # type: ignore[misc]
    assert not hasattr(entry, "__dict__")
    assert entry._replace(shape=(5,)).shape == (5,) and entry.shape == (4,)
    assert hash(entry) == hash(Entry.from_json(("x",), WIRE[1][2]))


def test_dtype_sizes_agree_with_torch() -> None:
    """The torch-free table of element sizes (the command line parses without torch) is torch's."""
    assert set(DTYPE_BY_NAME) <= set(DTYPE_ITEMSIZE)
    assert {name: DTYPE_ITEMSIZE[name] for name in DTYPE_BY_NAME} == {n: d.itemsize for n, d in DTYPE_BY_NAME.items()}


def _write_stores(kw) -> dict[str, object]:
    td = TensorDict(
        {
            "x": torch.arange(12.0).reshape(4, 3),
            "i": torch.zeros(4, dtype=torch.int64),
            "s": "hello",
            "st": NonTensorStack(*[NonTensorData(str(k)) for k in range(4)]),
            "n": TensorDict({"y": torch.ones(4, 2, dtype=torch.bfloat16)}, [4]),
            "named": TensorDict({"z": torch.ones(4, 5)}, [4, 5], names=["a", "b"]),
        },
        [4],
    )
    dense = TensorDictStore.from_tensordict(td, **kw())
    dense["big"] = torch.zeros(4, 64)
    chunked = TensorDictStore.from_tensordict(
        TensorDict({"big": torch.zeros(4, 64), "small": torch.ones(4)}, [4]), chunk_bytes=256, **kw()
    )
    indexed = TensorDictStore(batch_size=[4], **kw())
    indexed["a"] = torch.zeros(4)
    indexed[1:3] = TensorDict({"new": torch.ones(2, 3)}, [2])  # created zero-filled by an index write
    indexed[0] = TensorDict({"s": NonTensorData("row")}, [])
    elements = [
        TensorDict({"x": torch.zeros(3), "r": torch.zeros(3, k + 1), "s": "hi", "n": TensorDict({"y": torch.ones(3, 2)}, [3])}, [3])
        for k in range(4)
    ]
    lazy = LazyStackedTensorDictStore.from_lazy_stack(LazyStackedTensorDict(*elements), **kw())
    lazy[1] = TensorDict({"s": "changed"}, [])  # an element write of a non-tensor leaf rewrites its entry
    return {"dense": dense, "chunked": chunked, "indexed": indexed, "lazy": lazy}


def _unversioned(raw: str) -> str:
    """The registry value with the layout version of its order left out."""
    return re.sub(r'"o":\[\d+,', '"o":[LV,', raw)


def test_writers_write_the_old_wire_format(server) -> None:
    """The stores of ``WIRE``, written today, hold the same registry values (read with a plain client)."""
    stores = _write_stores(server.connection_kwargs)
    r = server.sync_client()
    got = []
    for name, store in stores.items():
        for field, raw in sorted(r.hgetall(f"tensordict:{{{store.td_id}}}:reg").items()):
            got.append((name, field.decode(), _unversioned(raw.decode())))
    assert got == [(s, f, _unversioned(raw)) for s, f, raw in WIRE]
    for store in stores.values():
        store.clear_redis()


#: (entry of WIRE, JSON field changes (``...`` deletes the field), words the error names)
HOSTILE = {
    "kind-unknown": (("dense", "x"), {"k": "zz"}, ["('x',)", "malformed metadata"]),
    "kind-missing": (("dense", "x"), {"k": ...}, ["('x',)", "malformed metadata"]),
    "order-string": (("dense", "x"), {"o": "x"}, ["('x',)", "'o'"]),
    "shape-bool": (("dense", "x"), {"shape": [4, True]}, ["('x',)", "shape"]),
    "shape-huge": (("dense", "x"), {"shape": [4] + [10**6] * 8}, ["('x',)", "shape", "more than any server holds"]),
    "shape-missing": (("dense", "x"), {"shape": ...}, ["('x',)", "shape"]),
    "dtype-unknown": (("dense", "x"), {"dtype": "float99"}, ["('x',)", "'dtype'", "float99"]),
    "dtype-list": (("dense", "x"), {"dtype": ["float32"]}, ["('x',)", "'dtype'"]),
    "chunk-misaligned": (("chunked", "big"), {"c": 3}, ["('big',)", "'c'"]),
    "chunk-bool": (("chunked", "big"), {"c": True}, ["('big',)", "'c'"]),
    "chunk-bomb": (("chunked", "big"), {"c": 4, "shape": [4, 10**11]}, ["('big',)", "'c'", "strings"]),
    "node-bs-negative": (("dense", "named"), {"batch_size": [-4]}, ["('named',)", "batch size"]),
    "node-names-length": (("dense", "named"), {"names": ["a"]}, ["('named',)", "names"]),
    "nt-enc": (("dense", "s"), {"enc": "zzz"}, ["('s',)", "'enc'"]),
    "nt-stack": (("dense", "st"), {"stack": "x"}, ["('st',)", "'stack'"]),
    "lazy-shapes": (("lazy", "r"), {"shapes": [[3], "x"]}, ["('r',)", "'shapes'"]),
    "lazy-enc": (("lazy", "s"), {"enc": None}, ["('s',)", "'enc'"]),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_fields_name_the_field(case: str) -> None:
    (store, field), changes, words = HOSTILE[case]
    meta = json.loads(next(raw for s, f, raw in WIRE if (s, f) == (store, field)))
    for name, value in changes.items():
        if value is ...:
            meta.pop(name)
        else:
            meta[name] = value
    with pytest.raises(CorruptMetadataError) as err:
        Entry.from_json(_path(field), json.dumps(meta), "tensordict:{damaged}")
    for word in words + ["tensordict:{damaged}"]:
        assert word in str(err.value), (case, str(err.value))


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'"t"', b"null", b"\xff\xfe", b"[" * 100_000])
def test_registry_values_that_are_no_entry(raw: bytes) -> None:
    """Through parse_layout, as the stores read it: the error names the entry and the store."""
    with pytest.raises(CorruptMetadataError) as err:
        parse_layout({b"lv": b"1"}, {b"x": raw}, "tensordict:{damaged}")
    assert "('x',)" in str(err.value) and "tensordict:{damaged}" in str(err.value)


def test_parsed_entries_are_kept_by_raw_value_and_never_hide_damage() -> None:
    """parse_layout keeps valid entries by their raw field and value: the same bytes give the
    same record without parsing again, and other bytes for the same field are parsed (and
    refused when damaged), never answered from what was kept."""
    from tdstore._core import layout as _layout

    meta = {b"lv": b"3", b"batch_size": b"[4]"}
    good = json.dumps({"k": "t", "dtype": "float32", "shape": [4, 2]}).encode()
    first = parse_layout(meta, {b"x": good}, "the store s")
    again = parse_layout(meta, {b"x": good}, "the store s")
    assert first is not None and again is not None
    assert again.entries[("x",)] is first.entries[("x",)]  # kept, not parsed again
    assert (b"x", good) in _layout._PARSED
    bad = json.dumps({"k": "t", "dtype": "float32", "shape": [4, -2]}).encode()
    with pytest.raises(CorruptMetadataError, match="shape"):
        parse_layout(meta, {b"x": bad}, "the store s")
    assert (b"x", bad) not in _layout._PARSED
    other = json.dumps({"k": "t", "dtype": "int64", "shape": [4]}).encode()
    got = parse_layout(meta, {b"x": other}, "the store s")
    assert got is not None and got.entries[("x",)].dtype == "int64"


def test_a_batch_size_nested_too_deep_is_a_value_error() -> None:
    """JSON nested deeper than the parser goes raises RecursionError in ``json.loads``; the
    layout says ValueError, as for any batch size that does not parse (its callers turn that
    into CorruptMetadataError), and remembers nothing."""
    from tdstore._core.layout import Layout

    deep = "[" * 100_000 + "]" * 100_000
    layout = Layout(lv=1, meta={"batch_size": deep}, entries={})
    with pytest.raises(ValueError, match="nested too deep"):
        layout.batch_size  # noqa: B018 - the property parses
    assert "batch_size" not in layout.memo
    assert Layout(lv=1, meta={"batch_size": "[4, 2]"}, entries={}).batch_size == [4, 2]
