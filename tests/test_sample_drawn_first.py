"""A uniform sample of a full ring in one server step (``store/ring.py: sample_drawn_first``).

Once a read of the ring showed it full and without a rate limiter, ``sample()`` draws its
rows among all the ring's rows and reads them in one snapshot with the cursor, the
limiter mark and their flags; a drawn row whose flag is clear is drawn again (rejection),
so the batch is uniform over the written rows as before. These tests check that the flags
read step is gone, that unwritten rows are never returned, the statistics, and that every
change the snapshot shows (a ring set back, a limiter set elsewhere, damaged flags) is
handled as the two-step sample handles it.
"""

from __future__ import annotations

import threading

import pytest
import torch
from tensordict import TensorDict
from test_append_flags import dead_reservation
from test_priorities import chi_square_p

from tdstore import TensorDictStore
from tdstore._backend import append as _append
from tdstore.errors import CorruptMetadataError, RateLimitTimeoutError
from tdstore.store import ring as _ring

CAP = 8


def rows(first: int, n: int) -> TensorDict:
    """Rows whose ``y`` is the ring row they are appended to (while the ring has not come round)."""
    y = torch.arange(first, first + n, dtype=torch.float32)
    return TensorDict(x=y[:, None].expand(n, 2).clone(), y=y, batch_size=[n])


def new_ring(server, cap: int = CAP) -> TensorDictStore:
    return TensorDictStore.from_schema(
        {"x": ([2], torch.float32), "y": ([], torch.float32)}, batch_size=[cap], **server.connection_kwargs()
    )


@pytest.fixture
def store(server):
    s = new_ring(server)
    yield s
    s.clear_redis()
    s.close()


def count_flag_reads(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = _append.ring_flags

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_append, "ring_flags", counted)
    return calls


def test_a_full_ring_is_sampled_without_reading_its_flags_first(store, server, monkeypatch):
    store.extend(rows(0, CAP))
    flag_reads = count_flag_reads(monkeypatch)
    first = store.sample(5)  # the two-step sample: it learns that the ring is full
    assert len(flag_reads) == 1 and store._conn.ring_full
    client = server.sync_client() if server.kind != "fakeredis" else None
    multi = (lambda: client.info("commandstats").get("cmdstat_multi", {}).get("calls", 0)) if client else None
    before = multi() if multi else 0
    for _ in range(20):
        batch, info = store.sample(5, return_info=True)
        assert torch.equal(batch["y"], info["index"].to(torch.float32))  # each row is the one its index names
        assert torch.equal(batch["x"][:, 0], batch["y"])
    assert len(flag_reads) == 1, "a sample of a full ring read its flags in a step of its own"
    if multi:
        assert multi() - before == 20, "one snapshot per sample"
        client.close()
    assert first.batch_size == torch.Size([5])


@pytest.mark.parametrize("large", [False, True], ids=["flags-read-whole", "flags-per-row"])
def test_rows_not_written_are_never_drawn(store, monkeypatch, large):
    if large:
        monkeypatch.setattr(_ring._append_mod, "FLAGS_READ_MAX", 2)  # the BITFIELD path of large rings
    store.extend(rows(0, CAP))
    store.sample(1)  # (the ring is known full from here)
    assert dead_reservation(store, 3) == CAP  # rows 0-2 reserved again by an appender that died
    assert store._conn.ring_full
    seen: set[int] = set()
    for _ in range(30):
        batch, info = store.sample(40, return_info=True)
        assert batch.batch_size == torch.Size([40])
        assert torch.equal(batch["y"], info["index"].to(torch.float32))
        seen |= set(info["index"].tolist())
    assert seen == set(range(3, CAP)), f"drew {sorted(seen)}: rows 0-2 are not written"


def test_the_draw_is_uniform_over_the_written_rows(server):
    cap = 64
    store = new_ring(server, cap)
    try:
        store.extend(rows(0, cap))
        store.sample(1)
        dead_reservation(store, 8)  # rows 0-7: their flags cleared, never written
        gen = torch.Generator().manual_seed(7)
        counts = torch.zeros(cap, dtype=torch.float64)
        for _ in range(40):
            _, info = store.sample(500, generator=gen, return_info=True)
            counts += torch.bincount(info["index"], minlength=cap).to(torch.float64)
        assert counts[:8].sum() == 0
        written = counts[8:]
        p = chi_square_p(written, torch.full_like(written, written.sum() / written.numel()))
        print(f"drawn-first uniform: draws={int(written.sum())} cells={written.numel()} p={p:.3f}")
        assert p > 0.001
    finally:
        store.clear_redis()
        store.close()


def test_a_ring_set_back_elsewhere_is_sampled_as_it_is_now(store, server):
    store.extend(rows(0, CAP))
    store.sample(1)
    other = TensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs())
    try:
        other.set_ring_total(3)  # rows 0-2 count as written, the others not
        assert store._conn.ring_full  # (this handle does not know yet)
        for _ in range(10):
            _, info = store.sample(20, return_info=True)
            assert int(info["index"].max()) < 3
        assert not store._conn.ring_full
    finally:
        other.close()


def test_a_rate_limiter_set_elsewhere_counts_and_holds_the_next_samples(store, server):
    store.extend(rows(0, CAP))
    store.sample(1)
    other = TensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs())
    try:
        # one sample per insert counted from now on, 5 ahead at most: one sample of 4 goes, not two
        other.set_rate_limit(min_size=1, samples_per_insert=1.0, error_buffer=6.0, timeout=0.2)
        assert store._conn.ring_full  # (this handle does not know yet)
        before = other.rate_limit()
        store.sample(4)
        after = other.rate_limit()
        assert after.samples - before.samples == 4, (before, after)  # the sample went through the limiter
        assert not store._conn.ring_full
        with pytest.raises(RateLimitTimeoutError):
            store.sample(4)
    finally:
        other.close()


@pytest.mark.parametrize("large", [False, True], ids=["flags-read-whole", "flags-per-row"])
def test_damaged_flags_are_one_clear_error_and_change_nothing(store, server, monkeypatch, large):
    if large:
        monkeypatch.setattr(_ring._append_mod, "FLAGS_READ_MAX", 2)
    store.extend(rows(0, CAP))
    store.sample(1)
    client = server.sync_client()
    try:
        flags = store._conn.keys.flags
        client.delete(flags)
        client.hset(flags, "not", "flags")
        before = store.to_tensordict()
        with pytest.raises(CorruptMetadataError, match="flags"):
            store.sample(4)
        assert client.type(flags) in (b"hash", "hash")
        after = store.to_tensordict()
        assert torch.equal(before["y"], after["y"]) and torch.equal(before["x"], after["x"])
        client.delete(flags)
        client.set(flags, b"\x02" * CAP)  # bytes other than 0 and 1
        with pytest.raises(CorruptMetadataError, match="other than 0 and 1"):
            store.sample(4)
    finally:
        client.close()


def _unwrite_after_the_draw(server, store, monkeypatch, sharded=None) -> list[int]:
    """After the first draw of the two-step sample (rows drawn from a flags read), the first row
    drawn is made unwritten on the server: flag cleared and bytes zeroed, as on a promoted
    replica that never got the write which flagged it. Returns that row. (A ShardedStore draws
    on its shards from threads at once: the lock lets exactly one draw unwrite its row.)"""
    client = server.sync_client()
    real = _ring.draw_written
    hit: list[int] = []
    once = threading.Lock()

    def draw_then_unwrite(target, n, generator, read=None):
        idx = real(target, n, generator, read)
        with once:
            if not hit:
                row = int(idx[0])
                hit.append(row)
                keys = target._conn.keys
                client.setrange(keys.flags, row, b"\x00")
                for name in ("x", "y"):
                    width = 8 if name == "x" else 4
                    client.setrange(keys.data((name,)), row * width, b"\x00" * width)
        return idx

    monkeypatch.setattr(_ring, "draw_written", draw_then_unwrite)
    return hit


@pytest.mark.parametrize("large", [False, True], ids=["flags-whole", "flags-per-row"])
def test_a_row_unwritten_between_the_draw_and_the_read_is_drawn_again(store, server, monkeypatch, large):
    """The two-step sample (a ring not full) reads its drawn rows with their flags in one
    snapshot: a row whose flag is clear by then is drawn again, never returned. Before, the rows
    were read without their flags: a failover to a replica that lacked the row's write gave
    back its zero bytes (tests/test_sharded_failover.py saw one)."""
    if large:
        monkeypatch.setattr(_ring._append_mod, "FLAGS_READ_MAX", 4)  # (a ring of 8 rows: flags read per row)
    store.extend(rows(1, 6))  # rows 0-5 hold y = 1..6; 6 and 7 never written
    hit = _unwrite_after_the_draw(server, store, monkeypatch)
    batch, info = store.sample(64, return_info=True, generator=torch.Generator().manual_seed(3))
    assert len(hit) == 1
    assert bool((batch["y"] > 0).all()), batch["y"].tolist()
    assert hit[0] not in info["index"].tolist()
    assert torch.equal(batch["y"], info["index"].float() + 1)


def test_a_sharded_sample_draws_again_a_row_unwritten_after_its_draw(real_server, monkeypatch):
    """The same on a ShardedStore's general path (its shards not full): each shard's rows are
    read with their flags."""
    from tdstore import ShardedStore

    sharded = ShardedStore.from_schema(
        {"x": ([2], torch.float32), "y": ([], torch.float32)}, batch_size=[16], block_rows=8,
        **real_server.connection_kwargs(),
    )
    try:
        for block in sharded.blocks:
            block.extend(rows(1, 6))
        hit = _unwrite_after_the_draw(real_server, None, monkeypatch)
        batch = sharded.sample(64, generator=torch.Generator().manual_seed(5))
        assert len(hit) == 1 and bool((batch["y"] > 0).all()), batch["y"].tolist()
    finally:
        sharded.clear_redis()
        sharded.close()
