"""Lifetimes: ``expire=``, ``store.expire(seconds)``, ``store.persist()``, ``store.ttl()``, on every backend.

The wire state is read with a plain client: every key of a store carries the same expiry
(the meta field ``exp``, ms on the server's clock), keys created later inherit it, and a
store whose lifetime ends is gone as a whole.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from tensordict import TensorDict

from tdstore import StoreNotFoundError, TensorDictStore
from tdstore.testing.counts import record


@pytest.fixture
def client(server):
    c = server.sync_client()
    yield c
    c.close()


def store_keys(client, store) -> list[bytes]:
    return sorted(client.scan_iter(match=f"{store.prefix}:{{{store.td_id}}}:*"))


def expiry(client, store) -> dict[bytes, int]:
    """PTTL of every key of ``store`` (ms; -1: none)."""
    return {key: client.pttl(key) for key in store_keys(client, store)}


def exp_field(client, store) -> int | None:
    raw = client.hget(f"{store.prefix}:{{{store.td_id}}}:meta", "exp")
    return None if raw is None else int(raw)


def has_pexpiretime(client) -> bool:
    try:
        client.execute_command("PEXPIRETIME", "tdstore-test-probe")
    except Exception:  # noqa: BLE001 - Redis 6 and fakeredis < 2.x lack it
        return False
    return True


def assert_one_expiry(client, store, ttl_s: float, *, expect_keys: set[str] | None = None) -> None:
    """Every key of the store expires at the meta's ``exp``, about ``ttl_s`` from now."""
    exp = exp_field(client, store)
    assert exp is not None, "the meta hash records the expiry"
    pttls = expiry(client, store)
    if expect_keys is not None:
        suffixes = {key.decode().split(":", 2)[2] for key in pttls}
        assert suffixes == expect_keys, suffixes
    for key, pttl in pttls.items():
        assert 0 < pttl <= ttl_s * 1000, (key, pttl)
    # the same absolute time on every key: exact where the server tells it, else within the
    # few ms the PTTL calls above took
    if has_pexpiretime(client):
        assert {client.execute_command("PEXPIRETIME", key) for key in pttls} == {exp}
    else:
        assert max(pttls.values()) - min(pttls.values()) <= 50, pttls


def assert_no_expiry(client, store) -> None:
    assert exp_field(client, store) is None
    pttls = expiry(client, store)
    assert pttls and set(pttls.values()) == {-1}, pttls


# ------------------------------------------------------------------ at creation
class TestCreateWithLifetime:
    def test_from_dict(self, make, client):
        store = make("from_dict", {"a": torch.zeros(4, 3), "n": {"b": torch.ones(4)}}, batch_size=[4], expire=60)
        assert_one_expiry(client, store, 60, expect_keys={"meta", "reg", "wv", "d:a", "d:n.b"})
        ttl = store.ttl()
        assert 59 < ttl <= 60

    def test_from_tensordict_with_non_tensor(self, make, client):
        td = TensorDict({"x": torch.arange(6).reshape(3, 2), "s": "text"}, [3])
        store = make("from_tensordict", td, expire=30.5)
        assert_one_expiry(client, store, 30.5, expect_keys={"meta", "reg", "wv", "d:x", "d:s"})
        assert client.hget(f"{store.prefix}:{{{store.td_id}}}:meta", "ttl") == b"30500"

    def test_from_schema(self, make, client):
        schema = {"obs": ([3], torch.float32), ("n", "r"): ([], torch.int64)}
        store = make("from_schema", schema, batch_size=[5], expire=120)
        assert_one_expiry(client, store, 120, expect_keys={"meta", "reg", "wv", "d:obs", "d:n.r"})

    def test_constructor_empty_store(self, make, client):
        store = make(batch_size=[2], expire=10)
        assert_one_expiry(client, store, 10, expect_keys={"meta"})
        store["x"] = torch.ones(2)  # registry and counter created now inherit it
        assert_one_expiry(client, store, 10, expect_keys={"meta", "reg", "wv", "d:x"})

    def test_without_lifetime_nothing_expires(self, make, client):
        store = make("from_dict", {"a": torch.zeros(2)}, batch_size=[2])
        assert_no_expiry(client, store)
        assert store.ttl() is None

    def test_reconnect_keeps_the_stored_lifetime(self, make, client):
        store = make("from_dict", {"a": torch.zeros(2)}, batch_size=[2], expire=50)
        exp = exp_field(client, store)
        other = make(td_id=store.td_id, batch_size=[2], expire=5)
        assert exp_field(client, other) == exp, "expire= applies to the store this call creates only"
        assert_one_expiry(client, store, 50)


# ------------------------------------------------------------------ keys created later
class TestKeysCreatedLater:
    @pytest.fixture
    def store(self, make):
        store = make("from_schema", {"obs": ([3], torch.float32), "r": ([], torch.float32)}, batch_size=[4])
        store.expire(100)
        return store

    def test_expire_on_existing_store(self, store, client):
        assert_one_expiry(client, store, 100, expect_keys={"meta", "reg", "wv", "d:obs", "d:r"})

    def test_new_entry_and_nested_entry(self, store, client):
        store["new"] = torch.ones(4, 2)
        store["nest"] = TensorDict({"deep": torch.zeros(4)}, [4])
        store["nt"] = "a string"
        expect = {"meta", "reg", "wv", "d:obs", "d:r", "d:new", "d:nest.deep", "d:nt"}
        assert_one_expiry(client, store, 100, expect_keys=expect)

    def test_overwrite_in_place_and_replace(self, store, client):
        store["obs"] = torch.ones(4, 3)  # same shape: SETRANGE in place
        store["r"] = torch.ones(4, 7)  # new shape: tmp key renamed into place
        assert_one_expiry(client, store, 100, expect_keys={"meta", "reg", "wv", "d:obs", "d:r"})
        assert torch.equal(store["r"], torch.ones(4, 7))

    def test_indexed_write_creating_an_entry(self, store, client):
        store[1:3] = TensorDict({"obs": torch.ones(2, 3), "r": torch.ones(2), "fresh": torch.ones(2, 5)}, [2])
        assert_one_expiry(client, store, 100, expect_keys={"meta", "reg", "wv", "d:obs", "d:r", "d:fresh"})
        assert store["fresh"][0].sum() == 0 and store["fresh"][1].sum() == 5

    def test_non_tensor_written_at_an_index(self, make, client):
        store = make("from_dict", {"x": torch.zeros(3), "s": ["a", "b", "c"]}, batch_size=[3], expire=100)
        store[1] = TensorDict({"x": torch.ones(()), "s": "B"}, [])
        assert_one_expiry(client, store, 100, expect_keys={"meta", "reg", "wv", "d:x", "d:s"})
        assert store["s"] == ["a", "B", "c"]

    def test_small_rows_through_the_script(self, store, client):
        store[torch.tensor([0, 2, 3])] = TensorDict({"obs": torch.ones(3, 3), "r": torch.ones(3)}, [3])
        assert_one_expiry(client, store, 100)

    def test_extend_ring_cursor(self, store, client):
        # the appends' keys: the written-row flags "rf" and the append counters "ac" (the
        # in-flight hash "rif" is emptied, so deleted, by the append's write)
        appended = {"meta", "reg", "wv", "ring", "rf", "ac", "d:obs", "d:r"}
        store.extend(TensorDict({"obs": torch.ones(3, 3), "r": torch.ones(3)}, [3]))
        assert_one_expiry(client, store, 100, expect_keys=appended)
        store.extend(TensorDict({"obs": torch.ones(2, 3), "r": torch.ones(2)}, [2]))  # SET of the cursor again
        assert_one_expiry(client, store, 100, expect_keys=appended)

    def test_rename_delete_and_recreate_the_registry(self, store, client):
        store.rename_key_("obs", "observation")
        assert_one_expiry(client, store, 100, expect_keys={"meta", "reg", "wv", "d:observation", "d:r"})
        del store["observation"]
        del store["r"]  # the registry hash is now empty, so the server deleted it
        store["back"] = torch.zeros(4)
        assert_one_expiry(client, store, 100, expect_keys={"meta", "reg", "wv", "d:back"})

    def test_apply_compare_and_set(self, store, client):
        store.apply_(lambda t: t + 1)
        assert_one_expiry(client, store, 100)
        assert torch.equal(store["r"], torch.ones(4))

    def test_clone_is_a_new_store_without_lifetime(self, store, client):
        copy = store.clone()
        try:
            assert_no_expiry(client, copy)
        finally:
            copy.clear_redis()
            copy.close()


# ------------------------------------------------------------------ expire / persist
class TestExpirePersist:
    def test_persist_clears_every_key(self, make, client):
        store = make("from_dict", {"a": torch.zeros(2), "n": {"b": torch.ones(2)}}, batch_size=[2], expire=20)
        store.extend(TensorDict({"a": torch.ones(1), "n": {"b": torch.ones(1)}}, [1]))
        assert store.persist() is store
        assert_no_expiry(client, store)
        assert set(expiry(client, store)) >= {f"{store.prefix}:{{{store.td_id}}}:ring".encode()}
        assert store.ttl() is None
        store["later"] = torch.ones(2)
        assert_no_expiry(client, store)

    def test_expire_replaces_the_expiry(self, make, client):
        store = make("from_dict", {"a": torch.zeros(2)}, batch_size=[2], expire=1000)
        assert store.expire(30) is store
        assert_one_expiry(client, store, 30)
        store.expire(3000)
        assert 2990 < store.ttl() <= 3000
        assert_one_expiry(client, store, 3000)

    def test_on_a_nested_handle_applies_to_the_store(self, make, client):
        store = make("from_dict", {"n": {"b": torch.ones(2)}, "a": torch.zeros(2)}, batch_size=[2])
        store["n"].expire(40)
        assert_one_expiry(client, store, 40, expect_keys={"meta", "reg", "wv", "d:a", "d:n.b"})
        store["n"].persist()
        assert_no_expiry(client, store)

    def test_key_added_by_another_handle_meanwhile(self, make, client):
        """The expiring handle's cached layout misses a key: the script refuses, it re-lists."""
        store = make("from_dict", {"a": torch.zeros(2)}, batch_size=[2])
        store.keys()  # layout cached
        other = make("from_store", td_id=store.td_id)
        other["b"] = torch.ones(2)
        store.expire(25)
        assert_one_expiry(client, store, 25, expect_keys={"meta", "reg", "wv", "d:a", "d:b"})

    def test_short_lifetime_removes_the_whole_store(self, make, client, server):
        store = make("from_dict", {"a": torch.zeros(3), "n": {"b": torch.ones(3)}}, batch_size=[3])
        store.extend(TensorDict({"a": torch.ones(1), "n": {"b": torch.ones(1)}}, [1]))
        td_id = store.td_id
        store.expire(1)
        assert len(store_keys(client, store)) == 8  # meta reg wv ring rf ac d:a d:n.b
        deadline = time.monotonic() + 10
        while store_keys(client, store) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert store_keys(client, store) == [], "every key expired"
        with pytest.raises(StoreNotFoundError, match=f"No TensorDictStore with td_id='{td_id}' found.*expired"):
            TensorDictStore.from_store(td_id=td_id, **server.connection_kwargs())
        with pytest.raises(StoreNotFoundError):
            store.ttl()
        with pytest.raises(StoreNotFoundError):
            store.expire(5)

    def test_created_with_a_short_lifetime(self, make, client, server):
        store = make("from_tensordict", TensorDict({"x": torch.ones(2)}, [2]), expire=1.0)
        time.sleep(1.3)
        assert store_keys(client, store) == []
        with pytest.raises(StoreNotFoundError, match="No TensorDictStore"):
            TensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs())
        with pytest.raises(StoreNotFoundError):
            store.to_tensordict()

    def test_clear_and_write_recreates_with_the_same_lifetime(self, make, client):
        store = make("from_dict", {"a": torch.zeros(2)}, batch_size=[2], expire=80)
        store.clear_redis()
        assert store_keys(client, store) == []
        store["a"] = torch.ones(2)
        assert_one_expiry(client, store, 80, expect_keys={"meta", "reg", "wv", "d:a"})


# ------------------------------------------------------------------ bad input
BAD = [
    (0, ValueError, "positive, finite"),
    (-3, ValueError, "positive, finite"),
    (float("nan"), ValueError, "positive, finite"),
    (float("inf"), ValueError, "positive, finite"),
    (10**13, ValueError, "at most"),
    ("10", TypeError, "number of seconds"),
    (True, TypeError, "number of seconds"),
    ([1], TypeError, "number of seconds"),
]


class TestBadLifetime:
    @pytest.mark.parametrize("value,exc,text", BAD)
    def test_expire_method(self, make, client, value, exc, text):
        store = make("from_dict", {"a": torch.zeros(2)}, batch_size=[2], expire=70)
        before = expiry(client, store)
        exp = exp_field(client, store)
        with pytest.raises(exc, match=f"lifetime of td_id='{store.td_id}'.*{text}"):
            store.expire(value)
        assert exp_field(client, store) == exp
        after = expiry(client, store)
        assert set(after) == set(before) and all(0 < v <= 70_000 for v in after.values())

    def test_from_store_takes_no_lifetime(self, make, client, server):
        store = make("from_dict", {"a": torch.zeros(2)}, batch_size=[2])
        with pytest.raises(TypeError, match=f"from_store\\(td_id='{store.td_id}'\\).*call .expire\\(seconds\\)"):
            TensorDictStore.from_store(td_id=store.td_id, expire=10, **server.connection_kwargs())
        assert_no_expiry(client, store)

    @pytest.mark.parametrize("value,exc,text", BAD)
    def test_at_creation_creates_nothing(self, server, client, value, exc, text):
        conn = server.connection_kwargs()
        before = sorted(client.keys("*"))
        with pytest.raises(exc, match=text):
            TensorDictStore.from_dict({"a": torch.zeros(2)}, batch_size=[2], expire=value, **conn)
        with pytest.raises(exc, match=text):
            TensorDictStore.from_schema({"a": ([2], torch.float32)}, batch_size=[2], expire=value, **conn)
        with pytest.raises(exc, match=text):
            TensorDictStore(batch_size=[2], expire=value, **conn)
        assert sorted(client.keys("*")) == before


# ------------------------------------------------------------------ races
def _consistent(client, store) -> tuple[int, int]:
    """(violations, checks): keys whose expiry disagrees with the meta hash's ``exp``."""
    exp = exp_field(client, store)
    pttls = expiry(client, store)
    bad = sum(1 for pttl in pttls.values() if (exp is None) != (pttl == -1) or pttl == -2)
    if exp is not None and has_pexpiretime(client):
        bad += sum(1 for key in pttls if client.execute_command("PEXPIRETIME", key) not in (exp, -2))
    return bad, len(pttls)


def test_concurrent_writers_and_expire_persist(server, request):
    """Writers add entries and write rows while the main thread flips expire()/persist():
    once they stop, every key agrees with the meta hash (all expire at ``exp``, or none)."""
    conn = server.connection_kwargs()
    store = TensorDictStore.from_schema({"x": ([2], torch.float32)}, batch_size=[8], **conn)
    client = server.sync_client()
    stop = threading.Event()
    errors: list[BaseException] = []
    writes = [0, 0]

    def writer(k: int) -> None:
        handle = TensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs())
        try:
            i = 0
            end = time.monotonic() + 20
            while not stop.is_set() and i < 400 and time.monotonic() < end:
                handle[f"w{k}_{i % 5}"] = torch.full((8,), float(i))  # new keys and replaced ones
                handle[i % 8] = TensorDict({"x": torch.ones(2)}, [])  # rows (WATCH-guarded)
                if i % 7 == 0:
                    del handle[f"w{k}_{i % 5}"]
                i += 1
            writes[k % 2] += i
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
        finally:
            handle.close()

    def run_writers(base: int, during) -> None:
        stop.clear()
        threads = [threading.Thread(target=writer, args=(base + k,), daemon=True) for k in range(2)]
        for t in threads:
            t.start()
        try:
            during()
        finally:
            stop.set()
            for t in threads:
                t.join(30)

    def flips() -> None:
        for round_ in range(12):
            store.expire(300) if round_ % 2 == 0 else store.persist()  # ends with persist()
            time.sleep(0.03)
        time.sleep(0.2)  # keys created after the last persist() must not expire

    violations = checks = 0
    try:
        run_writers(0, flips)
        bad, n = _consistent(client, store)
        violations, checks = violations + bad, checks + n
        assert exp_field(client, store) is None
        store.expire(300)
        run_writers(10, lambda: time.sleep(0.3))  # keys created under a settled expiry inherit it
        bad, n = _consistent(client, store)
        violations, checks = violations + bad, checks + n
        assert exp_field(client, store) is not None
    finally:
        stop.set()
        client.close()
        store.clear_redis()
        store.close()
    record(request, ttl_violations=violations, ttl_checks=checks, writes=sum(writes))
    assert not errors, errors
    assert sum(writes) > 0 and checks > 6
    assert violations == 0


def test_clear_deletes_ring_keys_created_after_the_listing(server, monkeypatch):
    """N2: a first append between the clear's listing and its script created the row flags and
    append counters after the SCAN; they survived with no TTL. The clear now seals the store
    before it lists the keys (N3), so that append is refused as one to a deleted store, and
    nothing of the store is left (checked with a plain client)."""
    import torch

    from tdstore import TensorDictStore
    from tdstore._backend import lifecycle

    store = TensorDictStore.from_schema({"x": ((3,), torch.float32)}, batch_size=[8], **server.connection_kwargs())
    other = TensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs())
    real = lifecycle._listed_keys

    async def listed_then_append(client, keys, cluster_node):
        found = await real(client, keys, cluster_node)
        import asyncio

        try:  # (a blocking call: not on the IO loop)
            await asyncio.to_thread(other.extend, _rows())
        except StoreNotFoundError as err:
            refused.append(err)
        return found

    refused: list[Exception] = []

    def _rows():
        from tensordict import TensorDict

        return TensorDict({"x": torch.ones(2, 3)}, [2])

    monkeypatch.setattr(lifecycle, "_listed_keys", listed_then_append)
    store.clear_redis()
    assert len(refused) == 1 and store.td_id in str(refused[0])
    client = server.sync_client()
    left = [k for k in client.scan_iter(match=f"{store._conn.keys.base}:*") if b":tmp:" not in k]
    assert left == []
