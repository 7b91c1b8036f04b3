"""``Connection.script``: a script that may be sent twice (the indexed write of small rows,
the priority draw, check and update, the slice draw and check) goes from the calling thread
on the direct client, with no hop to the IO loop; a script's error raises its class from
there; a server that forgot the script (NOSCRIPT) gets it through the IO loop, and the next
call is direct again. Results are compared with an in-memory TensorDict on every backend
(fakeredis has no direct client: everything goes through the IO loop there)."""

from __future__ import annotations

import threading

import _slice_workers as w
import pytest
import torch
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore._backend.connection import Connection
from tdstore.errors import CorruptMetadataError, StoreNotFoundError

pytestmark = pytest.mark.lua


@pytest.fixture
def hops(monkeypatch):
    """Every call that went through ``Connection.run`` (the IO loop), as it happens."""
    seen: list[object] = []
    real = Connection.run

    def counted(self, fn, timeout=None, *, idempotent=True):
        seen.append(fn)
        return real(self, fn, timeout, idempotent=idempotent)

    monkeypatch.setattr(Connection, "run", counted)
    return seen


@pytest.fixture
def on_real(real_server):
    """``on_real(method, *args, **kwargs)``: a store on the real server (cleared at the end)."""
    made: list[TensorDictStore] = []

    def factory(method: str, *args, **kwargs):
        store = getattr(TensorDictStore, method)(*args, **real_server.connection_kwargs(), **kwargs)
        made.append(store)
        return store

    yield factory
    for store in made:
        try:
            store.clear_redis()
        except StoreNotFoundError:
            pass
        store.close()


SCHEMA = {"x": ([4], torch.float32), "y": ([], torch.int64)}


def _in_threads(work, count: int = 4) -> None:
    """Runs ``work(t)`` in ``count`` threads at once; fails with the first error any raised."""
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            work(t)
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and not any(t.is_alive() for t in threads)


def _rows(n: int, seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict(x=torch.randn(n, 4, generator=g), y=torch.randint(0, 1000, (n,), generator=g), batch_size=[n])


def _writes(store, ref: TensorDict) -> None:
    """Indexed writes of small rows (the write_runs script): an int, a list, a slice, a mask."""
    for index, value in (
        (3, _rows(1, 1)[0]),
        (torch.tensor([1, 7, 8]), _rows(3, 2)),
        (slice(4, 6), _rows(2, 3)),
        (torch.arange(10) % 4 == 0, _rows(3, 4)),
    ):
        store[index] = value
        ref[index] = value


def test_indexed_writes_match_the_reference(server, make):
    store = make("from_schema", SCHEMA, batch_size=[10])
    ref = TensorDict(x=torch.zeros(10, 4), y=torch.zeros(10, dtype=torch.int64), batch_size=[10])
    _writes(store, ref)
    assert (store.to_tensordict() == ref).all()


def test_small_row_writes_go_from_the_calling_thread(real_server, on_real, hops):
    store = on_real("from_schema", SCHEMA, batch_size=[10])
    store[0] = _rows(1, 0)[0]  # (the first call sets the connection up, on the IO loop)
    assert store._conn.direct_client() is not None
    ref = store.to_tensordict()
    hops.clear()
    _writes(store, ref)
    assert hops == []
    assert (store.to_tensordict() == ref).all()


def test_priority_and_slice_scripts_go_from_the_calling_thread(real_server, on_real, hops):
    store = on_real("from_schema", w.SCHEMA, batch_size=[64])
    for ep in range(6):
        store.extend(w.episode(ep, 8, done=True))
    store.enable_priorities(alpha=0.7, beta=0.5)
    g = torch.Generator().manual_seed(0)
    store.sample(4, prioritized=True, return_info=True, generator=g)
    hops.clear()
    for _ in range(5):
        batch, info = store.sample(32, prioritized=True, return_info=True, generator=g)
        assert torch.equal(batch["step"], info["index"] % 8)  # (row r holds step r % 8 of episode r // 8)
        applied = store.update_priority(info["index"], torch.rand(32, generator=g) * 3, generation=info["generation"])
        assert bool(applied.all())
        slices = store.sample_slices(6, 4, end_key=w.END, generator=g)
        assert w.bad_slices(slices, 4) == {"torn": 0, "crossing": 0, "mixed": 0, "gaps": 0}
    assert hops == []


def test_a_script_error_raises_its_class_from_the_direct_call(real_server, on_real, hops):
    store = on_real("from_schema", w.SCHEMA, batch_size=[16])
    store.extend(w.episode(0, 8))
    store.enable_priorities(alpha=1.0, beta=1.0)
    store.update_priority(torch.tensor([1]), torch.tensor([2.0]))
    plain = real_server.sync_client()
    try:
        plain.set(store._conn.keys.replay_keys()[0], b"damaged")  # (the leaves: not the tree of 16 rows)
    finally:
        plain.close()
    hops.clear()
    with pytest.raises(CorruptMetadataError, match="priority tree"):
        store.update_priority(torch.tensor([1]), torch.tensor([2.0]))
    assert hops == []  # (raised from the direct reply: not sent again through the IO loop)


def test_a_forgotten_script_is_loaded_through_the_io_loop_then_direct_again(real_server, on_real, hops):
    store = on_real("from_schema", SCHEMA, batch_size=[10])
    ref = TensorDict(x=torch.zeros(10, 4), y=torch.zeros(10, dtype=torch.int64), batch_size=[10])
    store[0] = ref[0]
    plain = real_server.sync_client()
    try:
        plain.script_flush()
    finally:
        plain.close()
    hops.clear()
    row = _rows(1, 9)[0]
    store[2] = row  # NOSCRIPT on the direct client: sent again on the IO loop, which loads it
    ref[2] = row
    assert len(hops) == 1
    hops.clear()
    store[5] = row
    ref[5] = row
    assert hops == []
    assert (store.to_tensordict() == ref).all()


def test_threads_share_the_direct_path(server, make):
    store = make("from_schema", SCHEMA, batch_size=[200])
    store.extend(_rows(200, 0))
    store.enable_priorities(alpha=1.0, beta=1.0)
    ref = store.to_tensordict()

    def work(t: int) -> None:
        for i in range(25):
            row = 50 * t + 2 * i
            value = _rows(2, 1000 * t + i)
            store[row : row + 2] = value
            ref[row : row + 2] = value  # (each thread its own rows of the reference)
            store.update_priority(torch.tensor([row, row + 1]), torch.tensor([float(t + 1), float(i + 1)]))

    _in_threads(work)
    assert (store.to_tensordict() == ref).all()
    from tdstore.replay import priorities as P

    report = P.tree_report(store)
    assert report is not None and report["problems"] == []


def test_small_whole_entry_reads_and_writes_go_from_the_calling_thread(real_server, on_real, hops):
    """``store[key]`` reads and ``store[key] = v`` / ``update`` of existing tensors (same shape
    and dtype: written in place) go on the direct client, with no hop to the IO loop; results
    against an in-memory TensorDict."""
    store = on_real("from_dict", {"a": torch.zeros(6, 3), "n": {"b": torch.zeros(6)}}, batch_size=[6])
    ref = TensorDict({"a": torch.zeros(6, 3), "n": {"b": torch.zeros(6)}}, batch_size=[6])
    store["a"]  # (the first calls set the connection up, on the IO loop)
    store["a"] = torch.ones(6, 3)
    ref["a"] = torch.ones(6, 3)
    hops.clear()
    for i in range(5):
        value = torch.full((6, 3), float(i))
        store["a"] = value
        ref["a"] = value
        store.update({"a": value + 1, "n": {"b": torch.arange(6.0) * i}})
        ref.update({"a": value + 1, "n": {"b": torch.arange(6.0) * i}})
        assert torch.equal(store["a"], ref["a"]) and torch.equal(store["n", "b"], ref["n", "b"])
    assert hops == []
    assert (store.to_tensordict() == ref).all()


def test_a_direct_whole_entry_write_respects_the_lock_of_another_handle(real_server, on_real, hops):
    """The armed connection of a whole-entry write WATCHes the meta hash: a lock_() taken by
    another handle after it armed aborts the armed EXEC, and the write is refused with the lock
    error; in-place row writes still go (TensorDict's lock semantics); after unlock_() the
    direct path writes again."""
    store = on_real("from_dict", {"a": torch.zeros(4)}, batch_size=[4])
    for _ in range(3):
        store["a"] = torch.ones(4)  # (arms the direct connection)
    other = TensorDictStore.from_store(td_id=store.td_id, **real_server.connection_kwargs())
    try:
        other.lock_()
        with pytest.raises(RuntimeError, match="locked"):
            store["a"] = torch.full((4,), 7.0)
        assert torch.equal(store["a"], torch.ones(4))  # unchanged
        store[1] = TensorDict(a=torch.tensor(5.0), batch_size=[])
        assert store["a"].tolist() == [1.0, 5.0, 1.0, 1.0]
        other.unlock_()
        hops.clear()
        store["a"] = torch.full((4,), 2.0)
        store["a"] = torch.full((4,), 3.0)
        assert store["a"].tolist() == [3.0] * 4 and hops == []
    finally:
        other.close()


def test_a_direct_whole_entry_write_recreates_an_evicted_key(real_server, on_real):
    """A whole entry written in place whose data key is gone (evicted, deleted by hand) is
    written whole again, as the IO loop's way does, not refused; a row write into it is refused
    with DataLostError (a SETRANGE would recreate the rest zero-padded)."""
    from tdstore.errors import DataLostError

    store = on_real("from_dict", {"a": torch.zeros(4), "b": torch.zeros(4)}, batch_size=[4])
    for _ in range(3):
        store["a"] = torch.ones(4)
    plain = real_server.sync_client()
    try:
        plain.delete(store._conn.keys.data(("a",)))
        store["a"] = torch.arange(4.0)
        assert store["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
        plain.delete(store._conn.keys.data(("b",)))
        with pytest.raises(DataLostError, match="no data at|bytes are gone"):
            store[1] = TensorDict(a=torch.tensor(9.0), b=torch.tensor(9.0), batch_size=[])
        assert store["a"].tolist() == [0.0, 1.0, 2.0, 3.0]  # (nothing of that row write landed)
    finally:
        plain.close()


def test_threads_write_and_read_whole_entries_directly(server, make):
    """4 threads, each setting and reading back its own entry 30 times, on one handle (the
    direct client and its one armed slot shared)."""
    store = make("from_dict", {f"k{t}": torch.zeros(5) for t in range(4)}, batch_size=[5])

    def work(t: int) -> None:
        for i in range(30):
            value = torch.full((5,), float(100 * t + i))
            store[f"k{t}"] = value
            got = store[f"k{t}"]
            if not torch.equal(got, value):
                raise AssertionError(f"thread {t} step {i}: read {got.tolist()}, wrote {value.tolist()}")

    _in_threads(work)
    assert [store[f"k{t}"][0].item() for t in range(4)] == [100.0 * t + 29 for t in range(4)]


def test_lazy_element_writes_go_from_the_calling_thread(real_server, hops):
    """An element write of a LazyStackedTensorDictStore with tensor leaves only goes as an armed
    write from the calling thread (one round trip); a lock_() by another handle refuses it, as
    before, and leaves the element as it was; results against the in-memory lazy stack."""
    from tensordict import lazy_stack

    from tdstore import LazyStackedTensorDictStore

    ref = lazy_stack([TensorDict(x=torch.full((n,), float(n)), y=torch.tensor(n)) for n in (1, 2, 3)])
    store = LazyStackedTensorDictStore.from_lazy_stack(ref, **real_server.connection_kwargs())
    other = LazyStackedTensorDictStore.from_store(td_id=store.td_id, **real_server.connection_kwargs())
    try:
        store[0] = TensorDict(x=torch.tensor([5.0]), y=torch.tensor(5))  # (sets the connection up)
        ref[0] = TensorDict(x=torch.tensor([5.0]), y=torch.tensor(5))
        hops.clear()
        for i in range(4):
            value = TensorDict(x=torch.tensor([float(i), float(i + 1)]), y=torch.tensor(10 + i))
            store[1] = value
            ref[1] = value
            assert torch.equal(store[1]["x"], ref[1]["x"]) and int(store[1]["y"]) == 10 + i
        assert hops == []
        other.lock_()
        with pytest.raises(RuntimeError, match="locked"):
            store[2] = TensorDict(x=torch.zeros(3), y=torch.tensor(0))
        other.unlock_()
        for j in range(3):
            assert torch.equal(store[j]["x"], ref[j]["x"]) and torch.equal(store[j]["y"], ref[j]["y"])
    finally:
        other.close()
        store.clear_redis()
        store.close()
