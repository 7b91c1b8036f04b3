"""Bad input gets a clear exception naming the key and the store, and leaves the server unchanged.

Every case snapshots the whole keyspace with a plain client before and after.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import tdstore
from tdstore import TensorDictStore


def _bad_cases(store):
    return {
        "wrong batch size": (lambda: store.__setitem__("x", torch.zeros(5)), RuntimeError, "batch dimension mismatch"),
        "nested wrong batch": (
            lambda: store.__setitem__("t", TensorDict({"x": torch.zeros(3)}, [3])),
            RuntimeError,
            "batch dimension mismatch",
        ),
        "set_ missing key": (lambda: store.set_("zz", torch.zeros(4)), KeyError, "zz"),
        "set_ wrong shape": (lambda: store.set_("a", torch.zeros(4, 2)), RuntimeError, "does not fit"),
        "update_ missing": (lambda: store.update_({"a": torch.zeros(4), "zz": torch.zeros(4)}), KeyError, "zz"),
        "sparse value": (lambda: store.__setitem__("sp", torch.zeros(4).to_sparse()), TypeError, "to_dense"),
        "unsupported dtype": (lambda: store.__setitem__("q", _quint()), TypeError, "cannot be stored"),
        "get missing": (lambda: store["zz"], KeyError, "zz"),
        "del missing": (lambda: store.del_("zz"), KeyError, "zz"),
        "rename missing": (lambda: store.rename_key_("zz", "yy"), KeyError, "zz"),
        "rename into itself": (lambda: store.rename_key_("n", ("n", "c")), ValueError, "own sub-key"),
        "key under a leaf": (lambda: store.__setitem__(("a", "x"), torch.zeros(4)), KeyError, "not a nested"),
        "index out of range": (lambda: store[10], IndexError, ""),
        "index write out of range": (lambda: store.__setitem__(10, TensorDict(a=torch.tensor(1.0))), IndexError, ""),
        "index write bad shape": (
            lambda: store.__setitem__(slice(0, 2), TensorDict(a=torch.zeros(3), batch_size=[3])),
            RuntimeError,
            "",
        ),
        "bad key type": (lambda: store.set(3, torch.zeros(4)), KeyError, "NestedKeys"),
        "batch size not fitting": (lambda: setattr(store, "batch_size", [5]), RuntimeError, "does not fit"),
        "view": (lambda: store.view(2, 2), tdstore.UnsupportedOperationError, "to_tensordict"),
    }


def _quint():
    return torch.quantize_per_tensor(torch.zeros(4), 0.1, 0, torch.quint8)


class FailureTests:
    """Bad input: a clear exception that names the key and the store; the server stays unchanged."""

    @pytest.fixture
    def filled(self, server):
        """A store with a tensor, a nested tensor and a non-tensor entry."""
        store = TensorDictStore(batch_size=[4], **server.connection_kwargs())
        store["a"] = torch.arange(4.0)
        store["n", "b"] = torch.zeros(4, 2, dtype=torch.int32)
        store["s"] = "text"
        yield store
        store.close()

    @pytest.mark.parametrize(
        "case",
        [
            "wrong batch size", "nested wrong batch", "set_ missing key", "set_ wrong shape", "update_ missing",
            "sparse value", "unsupported dtype", "get missing", "del missing", "rename missing", "rename into itself",
            "key under a leaf", "index out of range", "index write out of range", "index write bad shape",
            "bad key type", "batch size not fitting", "view",
        ],
    )  # fmt: skip
    def test_bad_input_leaves_the_server_unchanged(self, filled, server, wire, case):
        fn, exc, match = _bad_cases(filled)[case]
        before = wire(server)
        with pytest.raises(exc, match=match or None) as info:
            fn()
        assert wire(server) == before
        message = str(info.value)
        if isinstance(info.value, tdstore.TDStoreError) or "not found" in message or "mismatch" in message:
            assert filled.td_id in message  # names the store

    def test_closed_store(self, filled, server, wire):
        before = wire(server)
        filled.close()
        for fn in (lambda: filled["a"], lambda: filled.__setitem__("a", torch.zeros(4)), filled.to_tensordict,
                   lambda: list(filled.keys()), filled.clear_redis):
            with pytest.raises(tdstore.StoreClosedError, match=filled.td_id):
                fn()
        assert wire(server) == before

    @pytest.mark.usefixtures("unchunked")  # the one-string layout
    def test_oversize_value_is_refused_before_sending(self, real_server, wire):
        client = real_server.sync_client()
        client.config_set("proto-max-bulk-len", 1024 * 1024)
        try:
            store = TensorDictStore(batch_size=[2], **real_server.connection_kwargs())
            store["small"] = torch.zeros(2)
            before = wire(real_server)
            with pytest.raises(tdstore.EntryTooLargeError, match=r"'big'.*2097152 bytes.*1048576") as info:
                store["big"] = torch.zeros(2, 256 * 1024, dtype=torch.float32)
            assert "proto-max-bulk-len" in str(info.value) and "split" in str(info.value)
            import redis

            assert isinstance(info.value, redis.exceptions.ResponseError)
            with pytest.raises(tdstore.EntryTooLargeError):
                store.update({"ok": torch.zeros(2), "big": torch.zeros(2, 256 * 1024)})
            with pytest.raises(tdstore.EntryTooLargeError):
                TensorDictStore.from_schema({"big": ([300_000], torch.float32)}, batch_size=[1], **real_server.connection_kwargs())
            assert wire(real_server) == before
            assert torch.equal(store["small"], torch.zeros(2))  # the connection still works
            store.close()
        finally:
            client.config_set("proto-max-bulk-len", 512 * 1024 * 1024)

    @pytest.mark.usefixtures("unchunked")  # the one-string layout
    def test_failed_from_tensordict_leaves_nothing(self, real_server, wire):
        client = real_server.sync_client()
        client.config_set("proto-max-bulk-len", 1024 * 1024)
        try:
            before = wire(real_server)
            td = TensorDict({"ok": torch.zeros(2), "big": torch.zeros(2, 256 * 1024)}, [2])
            with pytest.raises(tdstore.EntryTooLargeError):
                TensorDictStore.from_tensordict(td, **real_server.connection_kwargs())
            assert wire(real_server) == before
        finally:
            client.config_set("proto-max-bulk-len", 512 * 1024 * 1024)

    def test_unknown_td_id_and_malformed_td_id(self, server, wire):
        before = wire(server)
        with pytest.raises(tdstore.StoreNotFoundError, match="does-not-exist"):
            TensorDictStore.from_store(td_id="does-not-exist", **server.connection_kwargs())
        with pytest.raises(ValueError, match="td_id"):
            TensorDictStore.from_store(td_id="bad id with spaces", **server.connection_kwargs())
        with pytest.raises(ValueError, match="td_id"):
            TensorDictStore.from_store(td_id="", **server.connection_kwargs())
        assert wire(server) == before

    def test_wrong_batch_size_for_existing_td_id(self, filled, server, wire):
        before = wire(server)
        with pytest.raises(tdstore.SchemaError, match=r"\[4\]"):
            TensorDictStore(td_id=filled.td_id, batch_size=[7], **server.connection_kwargs())
        assert wire(server) == before

    def test_corrupt_metadata_is_reported(self, filled, server):
        client = server.sync_client()
        reg = f"tensordict:{{{filled.td_id}}}:reg"
        client.hset(reg, "a", '{"k":"t","dtype":"float99","shape":[4],"o":[1,1]}')
        with pytest.raises(tdstore.CorruptMetadataError, match="float99"):
            TensorDictStore.from_store(td_id=filled.td_id, **server.connection_kwargs())
        client.hset(reg, "a", '{"k":"t","dtype":"float32","shape":[4,2],"o":[1,1]}')  # 8 floats, 4 stored
        other = TensorDictStore.from_store(td_id=filled.td_id, **server.connection_kwargs())
        with pytest.raises(tdstore.CorruptMetadataError, match="expected 32 bytes"):
            other["a"]
        other.close()

    def test_format_version_mismatch(self, filled, server):
        server.sync_client().hset(f"tensordict:{{{filled.td_id}}}:meta", "fmt", "99")
        with pytest.raises(tdstore.FormatVersionError, match="'99'.*'1'"):
            TensorDictStore.from_store(td_id=filled.td_id, **server.connection_kwargs())

    def test_evicted_entry_is_a_clear_error(self, filled, server, wire):
        server.sync_client().delete(f"tensordict:{{{filled.td_id}}}:d:a")
        before = wire(server)
        for read in (lambda: filled["a"], lambda: filled[1:3], lambda: filled[2], filled.to_tensordict):
            with pytest.raises(tdstore.DataLostError, match="gone from the server"):
                read()
        for write in (lambda: filled.__setitem__(slice(0, 2), 1.0), lambda: filled.__setitem__(1, TensorDict(a=torch.tensor(2.0)))):
            with pytest.raises(tdstore.DataLostError):
                write()  # never recreated zero-padded by a row write
        assert wire(server) == before
