"""The documented API of TensorDictStore: constructors, entries, whole-store methods, consistency.

Parts of :class:`tdstore.testing.TensorDictStoreTests`: every test takes the ``server`` fixture of
the setting that runs the suite. Wire state is checked with a plain client.
"""

from __future__ import annotations

import json
import pickle
import warnings
from typing import Any

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

import tdstore
from tdstore import TensorDictStore
from tdstore._core.codec import DTYPE_BY_NAME
from tdstore.testing.classes import Point


def _keys(server):
    return sorted(server.sync_client().keys("*"))


def _rand(dtype, shape, gen):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype) * (1 + 2j)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    if dtype in (torch.uint16, torch.uint32, torch.uint64):
        return torch.randint(0, 200, shape, generator=gen).to(dtype)
    return torch.randint(-100, 100, shape, generator=gen).to(dtype)


def _equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype in (torch.uint16, torch.uint32, torch.uint64) or "float8" in str(a.dtype) or a.dtype == torch.complex32:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.numel() else True
    return torch.equal(a, b)


# ------------------------------------------------------------------ constructor
class ConstructorTests:
    def test_default_batch_size_and_repr(self, make):
        store = make()
        assert store.batch_size == torch.Size([])
        assert store.td_id in repr(store)
        assert store._td_id == store.td_id

    def test_td_id_is_read_only(self, make):
        store = make()
        with pytest.raises(AttributeError):
            store.td_id = "other"

    def test_backend_label(self, make):
        store = make(backend="dragonfly")
        assert "dragonfly" in repr(store)

    def test_prefix_and_hash_tag(self, make, server):
        store = make(prefix="myns", batch_size=[2])
        store["a"] = torch.zeros(2)
        keys = _keys(server)
        assert keys and all(k.startswith(f"myns:{{{store.td_id}}}:".encode()) for k in keys)

    def test_prefix_with_brace_is_refused(self, make):
        with pytest.raises(ValueError, match="brace"):
            make(prefix="a{b}")

    def test_given_td_id_and_reconnect_keeps_data(self, make, server):
        store = make(td_id="run-42", batch_size=[3])
        store["x"] = torch.arange(3)
        again = make(td_id="run-42")
        assert again.batch_size == torch.Size([3])  # not reset by the reconnect
        assert torch.equal(again["x"], torch.arange(3))
        with pytest.raises(tdstore.SchemaError, match="batch_size"):
            make(td_id="run-42", batch_size=[4])
        assert make(td_id="run-42").batch_size == torch.Size([3])

    def test_existing_client(self, server):
        client = server.async_client() if server.kind != "fakeredis" else server.connection_kwargs()["client"]
        store = TensorDictStore(client=client, batch_size=[2])
        store["a"] = torch.ones(2)
        assert torch.equal(store["a"], torch.ones(2))
        store.close()

    def test_decode_responses_client_is_refused(self, server, wire):
        before = wire(server)
        if server.kind == "fakeredis":
            import fakeredis.aioredis

            client = fakeredis.aioredis.FakeRedis(server=server._fake_server, decode_responses=True)
        else:
            client = server.async_client(decode_responses=True)
        with pytest.raises(tdstore.ClientConfigError, match="decode_responses"):
            TensorDictStore(client=client)
        assert wire(server) == before

    def test_redis_kwargs_pass_through(self, real_server):
        server = real_server
        store = TensorDictStore(client_name="tds-test", batch_size=[1], **server.connection_kwargs())
        store["a"] = torch.zeros(1)
        names = [c.get("name") for c in server.sync_client().client_list()]
        store.close()
        assert "tds-test" in names

    def test_db_argument(self, real_server):
        server = real_server
        store = TensorDictStore(db=3, batch_size=[1], **server.connection_kwargs())
        store["a"] = torch.zeros(1)
        assert server.sync_client().keys("*") == []
        assert server.sync_client(db=3).keys("*")
        store.clear_redis()
        store.close()

    def test_unix_socket(self, real_server):
        server = real_server
        store = TensorDictStore(batch_size=[2], **server.connection_kwargs(unix=True))
        store["a"] = torch.arange(2)
        assert torch.equal(store["a"], torch.arange(2))
        store.close()

    def test_device_is_persisted(self, make, server):
        store = make(batch_size=[2], device="cpu")
        store["a"] = torch.ones(2)
        assert store.device == torch.device("cpu")
        again = make(cls_method="from_store", td_id=store.td_id)
        assert again.device == torch.device("cpu")
        assert again["a"].device == torch.device("cpu")

    def test_cache_metadata_false(self, make):
        store = make(batch_size=[2], cache_metadata=False)
        store["a"] = torch.ones(2)
        other = make(cls_method="from_store", td_id=store.td_id)
        other["a"] = torch.ones(2, 5, dtype=torch.int16)
        assert store["a"].shape == (2, 5) and store["a"].dtype == torch.int16


# ------------------------------------------------------------------ entries
class EntryTests:
    @pytest.mark.parametrize("name", sorted(DTYPE_BY_NAME))
    def test_every_dtype_round_trips(self, make, name):
        dtype = DTYPE_BY_NAME[name]
        gen = torch.Generator().manual_seed(0)
        store = make(batch_size=[3])
        value = _rand(dtype, (3, 4), gen) if "float8" not in name and name != "complex32" else torch.randn(3, 4).to(dtype)
        store["x"] = value
        assert _equal(store["x"], value)
        assert store.to_tensordict()["x"].dtype == dtype

    def test_empty_and_scalar_entries(self, make):
        store = make(batch_size=[0])
        store["empty"] = torch.zeros(0, 3)
        assert store["empty"].shape == (0, 3)
        scalar = make()
        scalar["s"] = torch.tensor(3.5)
        assert scalar["s"].shape == () and scalar["s"].item() == 3.5

    def test_non_contiguous_and_grad_values(self, make):
        store = make(batch_size=[3])
        base = torch.arange(12.0).reshape(4, 3).t()
        store["t"] = base
        assert torch.equal(store["t"], base)
        grad = torch.ones(3, requires_grad=True)
        store["g"] = grad * 2
        assert not store["g"].requires_grad and torch.equal(store["g"], torch.full((3,), 2.0))

    def test_reads_are_writable_copies(self, make):
        store = make(batch_size=[2])
        store["a"] = torch.zeros(2, 1000)
        first = store["a"]
        first += 1
        assert torch.equal(store["a"], torch.zeros(2, 1000))
        assert torch.equal(first, torch.ones(2, 1000))

    def test_nested_keys_and_dots(self, make):
        store = make(batch_size=[2])
        store["a", "b"] = torch.ones(2)
        store["a.b"] = torch.zeros(2)
        assert torch.equal(store["a", "b"], torch.ones(2))
        assert torch.equal(store["a.b"], torch.zeros(2))
        assert set(store.keys(True, True)) == {("a", "b"), "a.b"}
        assert isinstance(store["a"], TensorDictStore)
        assert store["a"].batch_size == torch.Size([2])

    def test_nested_batch_size_and_names_persist(self, make):
        store = make(batch_size=[2])
        store["sub"] = TensorDict({"x": torch.zeros(2, 3, 4)}, batch_size=[2, 3], names=["env", "time"])
        again = make(cls_method="from_store", td_id=store.td_id)
        assert again["sub"].batch_size == torch.Size([2, 3])
        assert again["sub"].names == ["env", "time"]
        local = again.to_tensordict()
        assert local["sub"].batch_size == torch.Size([2, 3]) and local["sub"].names == ["env", "time"]

    def test_names_persist(self, make):
        store = make(batch_size=[2, 3])
        store.names = ["a", "b"]
        again = make(cls_method="from_store", td_id=store.td_id)
        assert again.names == ["a", "b"]
        assert again.to_tensordict().names == ["a", "b"]

    def test_non_tensor_values(self, make):
        store = make(batch_size=[2])
        store["s"] = "hello"
        store["n"] = NonTensorData(data=None, batch_size=[2])
        store["l"] = NonTensorData(data=[1, "a", [2]], batch_size=[2])
        store["t"] = NonTensorData(data=(1, 2), batch_size=[2])
        store["o"] = NonTensorData(data={1: "int key"}, batch_size=[2])
        assert store["s"] == "hello"
        assert store["n"] is None
        assert store["l"] == [1, "a", [2]] and type(store["l"]) is list
        assert store["t"] == (1, 2) and type(store["t"]) is tuple  # pickled: JSON would make a list
        assert store["o"] == {1: "int key"}
        assert store.entry_class("s") is NonTensorData

    def test_non_tensor_encoding_on_the_wire(self, make, server):
        store = make(batch_size=[])
        store["j"] = NonTensorData(data={"a": [1, 2]})
        store["p"] = NonTensorData(data={1, 2})
        client = server.sync_client()
        reg = client.hgetall(f"tensordict:{{{store.td_id}}}:reg")
        assert json.loads(reg[b"j"])["enc"] == "json"
        assert json.loads(reg[b"p"])["enc"] == "pickle"
        assert client.get(f"tensordict:{{{store.td_id}}}:d:j") == b'{"a":[1,2]}'

    def test_non_tensor_stack(self, make):
        store = make(batch_size=[2])
        store["l"] = NonTensorStack.from_list(["a", "b"])
        assert store["l"] == ["a", "b"]
        assert store.entry_class("l") is NonTensorStack
        assert store[1]["l"] == "b"

    def test_keys_items_values_len_in(self, make):
        store = make(batch_size=[2])
        store["a"] = torch.zeros(2)
        store["n", "b"] = torch.ones(2)
        assert list(store.keys()) == ["a", "n"]
        assert list(store.keys(True)) == ["a", "n", ("n", "b")]
        assert list(store.keys(True, True)) == ["a", ("n", "b")]
        assert "a" in store.keys() and ("n", "b") in store.keys(True)
        assert "zz" not in store.keys()
        assert len(store.keys()) == 2
        assert len(store) == 2  # the first batch dim
        values = dict(store.items(True, True))
        assert torch.equal(values[("n", "b")], torch.ones(2))
        assert len(list(store.values())) == 2

    def test_del_and_rename(self, make, server):
        store = make(batch_size=[2])
        store["a"] = torch.zeros(2)
        store["n", "b"] = torch.ones(2)
        store.rename_key_("a", "c")
        assert list(store.keys()) == ["c", "n"] or set(store.keys()) == {"c", "n"}
        assert torch.equal(store["c"], torch.zeros(2))
        store.rename_key_("n", "m")
        assert torch.equal(store["m", "b"], torch.ones(2))
        store.del_("m")
        del store["c"]
        assert list(store.keys()) == []
        # only the store's meta, registry and write counter remain (no orphaned data key)
        assert {k.rsplit(b":", 1)[-1] for k in _keys(server)} <= {b"meta", b"reg", b"wv"}
        with pytest.raises(KeyError, match="zz"):
            store.del_("zz")

    def test_rename_safe(self, make):
        store = make(batch_size=[1])
        store["a"] = torch.zeros(1)
        store["b"] = torch.ones(1)
        with pytest.raises(KeyError):
            store.rename_key_("a", "b", safe=True)
        store.rename_key_("a", "b")
        assert torch.equal(store["b"], torch.zeros(1)) and list(store.keys()) == ["b"]

    def test_update_is_one_step_and_merges_nested(self, make, server):
        store = make(batch_size=[2])
        store["n", "keep"] = torch.zeros(2)
        lv_key = f"tensordict:{{{store.td_id}}}:meta"
        before = int(server.sync_client().hget(lv_key, "lv"))
        store.update({"a": torch.ones(2), "n": {"new": torch.ones(2, 3)}, "s": "text"})
        after = int(server.sync_client().hget(lv_key, "lv"))
        assert after == before + 1  # one atomic layout change
        assert set(store.keys(True, True)) == {("n", "keep"), ("n", "new"), "a", "s"}
        assert store["s"] == "text"

    def test_update_does_not_download(self, make, monkeypatch):
        store = make(batch_size=[2])
        store["a"] = torch.zeros(2)
        from tdstore._backend import ops as _backend
        from tdstore._backend import reads as _run_reads

        def no_read(*args, **kwargs):
            raise AssertionError("update() downloaded an entry")

        monkeypatch.setattr(_backend, "read_entries", no_read)
        monkeypatch.setattr(_run_reads, "read_runs", no_read)
        monkeypatch.setattr(_run_reads, "runs_step", no_read)
        store.update({"a": torch.ones(2), "b": torch.ones(2)})
        monkeypatch.undo()
        assert torch.equal(store["a"], torch.ones(2))

    def test_set_in_place_checks_shape_and_casts(self, make, wire, server):
        store = make(batch_size=[2])
        store["a"] = torch.zeros(2, 3)
        store.set_("a", torch.ones(2, 3, dtype=torch.int64))
        assert store["a"].dtype == torch.float32 and torch.equal(store["a"], torch.ones(2, 3))
        before = wire(server)
        with pytest.raises(RuntimeError, match="does not fit"):
            store.set_("a", torch.ones(2, 4))
        with pytest.raises(KeyError):
            store.set_("missing", torch.ones(2))
        assert wire(server) == before

    def test_update_in_place(self, make):
        store = make(batch_size=[2])
        store["a"] = torch.zeros(2)
        store["n", "b"] = torch.zeros(2, dtype=torch.int32)
        store.update_({"a": torch.ones(2), "n": {"b": torch.full((2,), 7.9)}})
        assert torch.equal(store["n", "b"], torch.full((2,), 7, dtype=torch.int32))
        with pytest.raises(KeyError):
            store.update_({"zz": torch.ones(2)})

    def test_pop(self, make):
        store = make(batch_size=[2])
        store["a"] = torch.arange(2)
        assert torch.equal(store.pop("a"), torch.arange(2))
        assert "a" not in store.keys()
        assert store.pop("a", "dflt") == "dflt"
        assert store.pop("a", None) is None
        with pytest.raises(KeyError):
            store.pop("a")

    def test_empty(self, make, server):
        store = make(batch_size=[2])
        store["a"] = torch.zeros(2)
        store["n", "b"] = torch.zeros(2)
        keys = _keys(server)
        empty = store.empty()
        assert type(empty) is TensorDict  # in memory: nothing is created on the server
        assert list(empty.keys()) == [] and empty.batch_size == torch.Size([2])
        deep = store.empty(recurse=True)
        assert list(deep.keys(True)) == ["n"]
        out = store.apply(lambda t: t + 1)
        assert type(out) is TensorDict and torch.equal(out["a"], torch.ones(2))
        assert torch.equal((store + 1)["n", "b"], torch.ones(2))
        assert _keys(server) == keys

    def test_entry_class(self, make):
        store = make(batch_size=[2])
        store["a"] = torch.zeros(2)
        store["n", "b"] = torch.zeros(2)
        assert store.entry_class("a") is torch.Tensor
        assert store.entry_class("n") is TensorDictStore

    def test_replace_with_new_shape_and_dtype(self, make):
        store = make(batch_size=[2])
        store["a"] = torch.zeros(2)
        store["a"] = torch.ones(2, 5, dtype=torch.int8)
        assert store["a"].shape == (2, 5) and store["a"].dtype == torch.int8
        store["a"] = TensorDict({"x": torch.ones(2)}, [2])
        assert torch.equal(store["a", "x"], torch.ones(2))
        store["a"] = torch.zeros(2)
        assert store.entry_class("a") is torch.Tensor and list(store.keys(True)) == ["a"]


# ------------------------------------------------------------------ whole-store
class WholeStoreTests:
    def test_to_tensordict(self, make):
        store = make(batch_size=[3])
        store["a"] = torch.arange(3)
        store["n", "b"] = torch.ones(3, 2)
        store["s"] = "x"
        local = store.to_tensordict()
        assert type(local) is TensorDict and local.batch_size == torch.Size([3])
        assert torch.equal(local["a"], torch.arange(3)) and local["s"] == "x"
        assert torch.equal(local["n", "b"], torch.ones(3, 2))

    def test_to_local_warns(self, make):
        store = make(batch_size=[1])
        store["a"] = torch.zeros(1)
        with pytest.warns(DeprecationWarning, match="to_tensordict"):
            local = store.to_local()
        assert torch.equal(local["a"], torch.zeros(1))

    def test_flatten_unflatten(self, make):
        store = make(batch_size=[1])
        store["n", "b"] = torch.zeros(1)
        flat = store.flatten_keys()
        assert list(flat.keys()) == ["n.b"] and type(flat) is TensorDict
        assert list(flat.unflatten_keys().keys(True, True)) == [("n", "b")]
        with pytest.raises(ValueError, match="inplace"):
            store.flatten_keys(inplace=True)
        store2 = make(batch_size=[1])
        store2["x.y"] = torch.zeros(1)
        assert list(store2.unflatten_keys().keys(True, True)) == [("x", "y")]

    def test_clone(self, make):
        store = make(batch_size=[2])
        store["a"] = torch.arange(2)
        copy = store.clone()
        assert copy.td_id != store.td_id
        copy["a"] = torch.zeros(2, dtype=torch.int64)
        assert torch.equal(store["a"], torch.arange(2))
        shallow = store.clone(recurse=False)
        assert shallow.td_id == store.td_id
        copy.clear_redis()
        copy.close()

    def test_from_dict(self, make):
        store = make(cls_method="from_dict", input_dict={"a": torch.zeros(5, 3)}, batch_size=[5])
        assert store.batch_size == torch.Size([5])
        auto = make(cls_method="from_dict", input_dict={"a": torch.zeros(5, 3), "b": torch.zeros(5, 3, 2)}, auto_batch_size=True)
        assert auto.batch_size == torch.Size([5, 3])
        dims = make(cls_method="from_dict", input_dict={"a": torch.zeros(5, 3)}, batch_dims=1, names=["t"])
        assert dims.batch_size == torch.Size([5]) and dims.names == ["t"]

    def test_from_tensordict_is_one_step(self, make, server):
        td = TensorDict({"a": torch.randn(4, 2), "n": {"b": torch.arange(4)}, "s": "str"}, [4])
        store = make(cls_method="from_tensordict", td=td)
        wv = server.sync_client().get(f"tensordict:{{{store.td_id}}}:wv")
        assert wv == b"1"  # created with all its leaves in a single commit
        assert (store.to_tensordict() == td).all()
        assert store.to_tensordict()["s"] == "str"

    @pytest.mark.usefixtures("unchunked")  # the one-string layout (and a 21 MB entry)
    def test_from_schema_zero_fills_on_the_server(self, make, server, monkeypatch):
        from tdstore._backend import ops as _backend

        sent: list[Any] = []
        original = _backend.commit

        async def spy(client, keys, runner, ops, **kwargs):
            sent.extend(op.payload for op in ops if op.payload is not None)
            return await original(client, keys, runner, ops, **kwargs)

        monkeypatch.setattr(_backend, "commit", spy)
        store = make(
            cls_method="from_schema",
            schema={"obs": ([4, 4, 3], torch.uint8), ("n", "act"): ([2], torch.float32), "r": ([], torch.float64)},
            batch_size=[10],
        )
        assert sent == []  # no tensor bytes went through the client
        assert store["obs"].shape == (10, 4, 4, 3) and not store["obs"].any()
        assert store["n", "act"].dtype == torch.float32 and store["r"].shape == (10,)
        assert server.sync_client().strlen(f"tensordict:{{{store.td_id}}}:d:obs") == 10 * 48

    @pytest.mark.usefixtures("unchunked")  # the one-string layout (and a 21 MB entry)
    def test_from_schema_example(self, make):
        store = make(
            cls_method="from_schema",
            schema={"obs": ([84, 84, 3], torch.uint8), "action": ([4], torch.float32), "reward": ([], torch.float32)},
            batch_size=[1000],
        )
        store[0] = TensorDict(
            obs=torch.ones(84, 84, 3, dtype=torch.uint8), action=torch.ones(4), reward=torch.ones(()), batch_size=[]
        )
        assert torch.equal(store["action"][:2], torch.tensor([[1.0] * 4, [0.0] * 4]))

    @pytest.mark.parametrize(
        "schema",
        [
            {"a": ([2], "float32")},
            {"a": ([-1], torch.float32)},
            {"a": ([2.5], torch.float32)},
            {"a": [2]},
            {3: ([2], torch.float32)},
            {"a": ([2], torch.float32), ("a", "b"): ([2], torch.float32)},
            {"ok": ([2], torch.float32), "bad": ([2], torch.qint8)},
        ],
        ids=["dtype-str", "negative", "float-dim", "no-dtype", "int-key", "leaf-and-parent", "bad-dtype"],
    )
    def test_bad_schema_writes_nothing(self, server, schema, wire):
        before = wire(server)
        with pytest.raises(tdstore.SchemaError):
            TensorDictStore.from_schema(schema, batch_size=[3], **server.connection_kwargs())
        assert wire(server) == before

    def test_from_store(self, make, server):
        store = make(batch_size=[3], device="cpu")
        store["a"] = torch.arange(3)
        again = TensorDictStore.from_store(td_id=store.td_id, **_conn(store, server))
        assert again.batch_size == torch.Size([3]) and torch.equal(again["a"], torch.arange(3))
        again.close()

    def test_from_store_unknown_id(self, server, wire):
        before = wire(server)
        with pytest.raises(tdstore.StoreNotFoundError, match="no-such-id") as info:
            TensorDictStore.from_store(td_id="no-such-id", **server.connection_kwargs())
        assert isinstance(info.value, KeyError)
        assert wire(server) == before

    def test_tensorclass_round_trip(self, make, server):
        point = Point(pos=torch.randn(4, 3), mass=torch.ones(4), batch_size=[4])  # type: ignore[call-arg]
        store = make(cls_method="from_tensordict", td=point)
        again = TensorDictStore.from_store(td_id=store.td_id, **_conn(store, server))
        assert isinstance(again, Point)
        assert torch.equal(again.pos, point.pos)
        plain = TensorDictStore.from_store(td_id=store.td_id, tensorclass_cls=None, **_conn(store, server))
        assert isinstance(plain, Point)  # None means "use the stored class"
        explicit = TensorDictStore.from_store(td_id=store.td_id, tensorclass_cls="tdstore.testing.classes.Point", **_conn(store, server))
        assert isinstance(explicit, Point)

    def test_pickle_reconnects(self, make, server):
        store = make(batch_size=[2])
        store["a"] = torch.arange(2)
        if server.kind == "fakeredis":
            with pytest.raises(TypeError, match="in-process"):
                pickle.dumps(store)
            return
        again = pickle.loads(pickle.dumps(store))
        assert again.td_id == store.td_id and torch.equal(again["a"], torch.arange(2))
        nested = pickle.loads(pickle.dumps(store))
        nested["n", "x"] = torch.ones(2)
        sub = pickle.loads(pickle.dumps(store["n"]))
        assert torch.equal(sub["x"], torch.ones(2))
        again.close()

    def test_close(self, make, server):
        store = make(batch_size=[2])
        store["a"] = torch.arange(2)
        keys = _keys(server)
        store.close()
        store.close()  # idempotent
        assert _keys(server) == keys  # data stays
        with pytest.raises(tdstore.StoreClosedError, match="from_store"):
            store["a"]
        with pytest.raises(tdstore.StoreClosedError):
            store["b"] = torch.zeros(2)
        assert store.td_id in repr(store)

    def test_clear_redis_deletes_exactly_this_store(self, make, server):
        other = make(batch_size=[1])
        other["keep"] = torch.zeros(1)
        server.sync_client().set("unrelated", b"x")
        before = set(_keys(server))
        store = make(batch_size=[2])
        store["a"] = torch.zeros(2)
        store["n", "b"] = torch.zeros(2)
        store["s"] = "x"
        store.clear_redis()
        assert set(_keys(server)) == before
        with pytest.raises(tdstore.StoreNotFoundError):
            store["a"]
        store["a"] = torch.ones(2)  # the handle stays usable
        assert store.batch_size == torch.Size([2]) and torch.equal(store["a"], torch.ones(2))

    def test_unsupported_methods_name_the_alternative(self, make):
        store = make(batch_size=[2, 3])
        store["a"] = torch.zeros(2, 3)
        for call in (lambda: store.view(-1), lambda: store.transpose(0, 1), lambda: store.permute(1, 0),
                     lambda: store.unsqueeze(0), lambda: store.squeeze(0), lambda: store.share_memory_(),
                     lambda: store.memmap_()):
            with pytest.raises(tdstore.UnsupportedOperationError, match="to_tensordict"):
                call()

    def test_batch_size_change_checks_entries(self, make):
        store = make(batch_size=[2, 3])
        store["a"] = torch.zeros(2, 3)
        store.batch_size = [2]
        assert store.batch_size == torch.Size([2])
        with pytest.raises(RuntimeError, match="does not fit"):
            store.batch_size = [3]
        assert store.batch_size == torch.Size([2])

    def test_lock_is_on_the_server(self, make):
        store = make(batch_size=[2])
        store["a"] = torch.zeros(2)
        other = make(cls_method="from_store", td_id=store.td_id)
        store.lock_()
        assert other.is_locked
        with pytest.raises(RuntimeError):
            other["b"] = torch.zeros(2)
        other.set_("a", torch.ones(2))  # in-place writes stay allowed, as on a locked TensorDict
        store.unlock_()
        other["b"] = torch.zeros(2)
        assert torch.equal(store["a"], torch.ones(2))


# ------------------------------------------------------------------ consistency
class ConsistencyTests:
    def test_layout_version_bumps_only_on_layout_changes(self, make, server):
        store = make(batch_size=[2])
        client = server.sync_client()
        meta = f"tensordict:{{{store.td_id}}}:meta"
        lv = lambda: int(client.hget(meta, "lv"))  # noqa: E731
        store["a"] = torch.zeros(2)
        v1 = lv()
        store["a"] = torch.ones(2)  # same shape and dtype: value write only
        assert lv() == v1
        store["a"] = torch.ones(2, 2)
        assert lv() == v1 + 1
        store[0] = TensorDict(a=torch.zeros(2), batch_size=[])
        assert lv() == v1 + 1
        store.del_("a")
        assert lv() == v1 + 2

    def test_cached_metadata_never_stale(self, make):
        store = make(batch_size=[2])
        store["a"] = torch.zeros(2)
        assert store["a"].shape == (2,)  # fills the cache
        other = make(cls_method="from_store", td_id=store.td_id)
        other["a"] = torch.arange(6, dtype=torch.int16).reshape(2, 3)
        other["new"] = torch.ones(2)
        got = store["a"]
        assert got.dtype == torch.int16 and got.shape == (2, 3) and torch.equal(got, torch.arange(6, dtype=torch.int16).reshape(2, 3))
        assert "new" in store.keys()
        assert torch.equal(store[1]["a"], torch.tensor([3, 4, 5], dtype=torch.int16))
        local = store.to_tensordict()
        assert set(local.keys()) == {"a", "new"}

    @pytest.mark.parametrize("idx", [3, slice(2, 9), slice(1, None, 3), [7, 0, 2], "mask"])
    def test_index_writes_of_large_and_small_rows(self, make, server, idx):
        # obs rows (8 KB) go through SETRANGE in a WATCH-guarded MULTI, act rows through Lua
        ref = TensorDict(obs=torch.zeros(10, 2048), act=torch.zeros(10, 2, dtype=torch.int16), batch_size=[10])
        store = make(cls_method="from_tensordict", td=ref)
        if idx == "mask":
            idx = torch.arange(10) % 3 == 0
        n = ref[idx].batch_size
        value = TensorDict(obs=torch.randn(*n, 2048), act=torch.randint(0, 99, (*n, 2), dtype=torch.int16), batch_size=n)
        wv = f"tensordict:{{{store.td_id}}}:wv"
        before = int(server.sync_client().get(wv))
        store[idx] = value
        ref[idx] = value
        assert int(server.sync_client().get(wv)) == before + 1  # one write step
        assert (store.to_tensordict() == ref).all()

    def test_recreated_store_never_matches_a_stale_cache(self, make):
        store = make(td_id="again", batch_size=[4])
        store["x"] = torch.arange(4.0)
        assert torch.equal(store[0:4]["x"], torch.arange(4.0))  # fills the cache
        other = make(cls_method="from_store", td_id="again")
        other.clear_redis()
        other["x"] = torch.arange(4, dtype=torch.int32)  # same size, another dtype
        got = store[0:4]["x"]
        assert got.dtype == torch.int32 and torch.equal(got, torch.arange(4, dtype=torch.int32))

    def test_writes_with_a_stale_cache_are_replanned(self, make):
        store = make(batch_size=[2])
        store["a"] = torch.zeros(2)
        other = make(cls_method="from_store", td_id=store.td_id)
        other["a"] = TensorDict({"x": torch.zeros(2)}, [2])  # "a" becomes a nested tensordict
        store["b"] = torch.ones(2)  # planned against a stale layout: refused, refreshed, retried
        assert set(store.keys(True)) == {"a", ("a", "x"), "b"}
        store[0] = TensorDict({"b": torch.tensor(5.0)}, [])
        assert torch.equal(other["b"], torch.tensor([5.0, 1.0]))


def _conn(store, server):
    """Connection kwargs of the server a store lives on (fakeredis: a client on the same server)."""
    kw = store._conn.pool_kwargs
    if "server" in kw:
        import fakeredis.aioredis

        return {"client": fakeredis.aioredis.FakeRedis(server=kw["server"])}
    return server.connection_kwargs()


warnings.filterwarnings("ignore", category=FutureWarning)
