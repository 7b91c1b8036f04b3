"""Trajectory slices chosen on the server (issue 26, item 3): tdstore/replay/slices.py and
lua/slice_draw.lua, lua/slice_check.lua.

On every backend: each slice drawn is one of the valid windows of a Python reference (over
episodes of random lengths, a wrapped ring and rows in flight), 100,000 slices with none
crossing an end, chi-square of uniform starts over the valid windows and of prioritized
starts against p^alpha restricted to them, traj_key, bad keys and arguments refused with
the data unchanged, the rate limiter counting slice_len samples per slice, slices appended
to between the draw and the check drawn again. On the real servers, appending processes
and a sampling process.
"""

from __future__ import annotations

import random
import time

import _slice_workers as w
import pytest
import torch
from fixtures import PoolSpec

from tdstore.errors import CorruptMetadataError, RateLimitTimeoutError, SchemaError
from tdstore.replay import priorities as P
from tdstore.replay import slices as S
from tdstore.testing.counts import record

POOL = PoolSpec(workers=4, warm_up=w.warm_up, warm_up_arg=0.5)
# (sample_slices refuses an end column kept in chunks: these tests keep one string per entry)
pytestmark = pytest.mark.usefixtures("unchunked")


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """The chi-square test's p-value (as tests/test_priorities.py): Q(df/2, stat/2)."""
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def _filled(make, cap: int, seed: int, rows: int, max_len: int = 12):
    """A ring of ``cap`` rows with ``rows`` rows of episodes of random lengths appended
    (wrapping when rows > cap), the last episode left open (no end)."""
    store = make("from_schema", w.SCHEMA, batch_size=[cap])
    rng = random.Random(seed)
    ep = 0
    left = rows
    while left > 0:
        n = min(rng.randint(1, max_len), left, cap)
        left -= n
        store.extend(w.episode(ep, n, done=left > 0))
        ep += 1
    return store


def _reference(server, store, length: int, traj: bool = False) -> list[int]:
    client = server.sync_client()
    try:
        keys = store._conn.keys
        flags_b = client.get(keys.flags) or b""
        cursor = int(client.get(keys.ring) or b"0")
    finally:
        client.close()
    cap = store.batch_size[0]
    flags = [i < len(flags_b) and flags_b[i] == 1 for i in range(cap)]
    done = store[w.END].reshape(-1).tolist()
    ids = store["traj"].tolist() if traj else None
    return w.valid_starts(done, flags, ids, cursor, length)


def _clear_flags(server, store, rows: list[int]) -> None:
    """Rows ``rows`` as an append in flight leaves them: flag clear."""
    client = server.sync_client()
    try:
        for r in rows:
            client.setrange(store._conn.keys.flags, r, b"\x00")
    finally:
        client.close()


def test_every_slice_is_a_valid_window_and_none_crosses_an_end(server, make, request):
    """100,000 slices (1000 samples of 100) over a wrapped ring with three rows in flight:
    every start is in the reference's valid windows, no slice crosses an end, is torn or
    has a gap, and the uniform starts are uniform over the valid windows (chi-square)."""
    cap, length = 96, 4
    store = _filled(make, cap, seed=1, rows=250)
    _clear_flags(server, store, [5, 40, 41])
    valid = _reference(server, store, length)
    assert 20 < len(valid) < cap - length
    where = {a: i for i, a in enumerate(valid)}
    counts = torch.zeros(len(valid), dtype=torch.float64)
    bad = {"torn": 0, "crossing": 0, "mixed": 0, "gaps": 0}
    outside = 0
    g = torch.Generator().manual_seed(0)
    t0 = time.time()
    for _ in range(1000):
        batch, info = store.sample_slices(100, length, end_key=w.END, generator=g, return_info=True)
        assert batch.batch_size == torch.Size([100 * length]) and info["index"].shape == (100 * length,)
        for k, v in w.bad_slices(batch, length).items():
            bad[k] += v
        for a in info["position"].tolist():
            i = where.get(a)
            if i is None:
                outside += 1
            else:
                counts[i] += 1
        assert time.time() - t0 < 120
    p = chi_square_p(counts, torch.full_like(counts, 100_000 / len(valid)))
    record(request, slices=100_000, valid_windows=len(valid), outside=outside, **bad, p_value=p, seconds=round(time.time() - t0, 1))
    assert outside == 0 and bad == {"torn": 0, "crossing": 0, "mixed": 0, "gaps": 0}
    assert torch.equal(info["start"], info["position"] % cap)
    assert torch.equal(info["index"].reshape(100, length)[:, 0], info["start"])
    assert p > 0.001, p


def test_traj_key_windows(server, make):
    """With traj_key every row of a slice has the start's id; an open episode's rows count too."""
    cap, length = 64, 3
    store = _filled(make, cap, seed=2, rows=150)
    valid = set(_reference(server, store, length, traj=True))
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        batch, info = store.sample_slices(50, length, traj_key="traj", generator=g, return_info=True)
        assert set(info["position"].tolist()) <= valid
        ids = batch["traj"].reshape(-1, length)
        assert bool((ids == ids[:, :1]).all())
        assert w.bad_slices(batch, length)["gaps"] == 0


def test_wrap_around_and_the_write_position(server, make):
    """A slice may run from the ring's last row to its first when they were appended one
    after the other, and never across the boundary between the newest and the oldest row."""
    store = make("from_schema", w.SCHEMA, batch_size=[8])
    store.extend(w.episode(0, 6, done=False))  # rows 0..5
    store.extend(w.episode(0, 5, start=6, done=False))  # rows 6, 7, 0, 1, 2: positions 6..10
    # the ring holds positions 3..10 (steps 3..10, one open episode): windows of 4 start at 3..7
    batch, info = store.sample_slices(200, 4, end_key=w.END, return_info=True, generator=torch.Generator().manual_seed(2))
    assert set(info["position"].tolist()) == {3, 4, 5, 6, 7}
    assert w.bad_slices(batch, 4) == {"torn": 0, "crossing": 0, "mixed": 0, "gaps": 0}
    assert [7, 0, 1, 2] in info["index"].reshape(-1, 4).tolist()  # (position 7: rows 7, 0, 1, 2)
    assert int(batch["step"].min()) == 3 and int(batch["step"].max()) == 10  # (never the overwritten steps 0..2)
    batch = store.sample_slices(5, 8, end_key=w.END)  # (the whole ring: one window)
    assert batch["step"].tolist() == list(range(3, 11)) * 5


def test_prioritized_starts_follow_the_priorities_of_valid_windows(server, make, request):
    """Prioritized: the starts follow p^alpha of their start row, restricted to the valid
    windows (chi-square over 20,000 slices); weights and generations per slice."""
    cap, length = 64, 3
    store = _filled(make, cap, seed=3, rows=140, max_len=8)
    store.enable_priorities(alpha=0.7, beta=0.5, eps=0.0)
    g = torch.Generator().manual_seed(3)
    store.update_priority(torch.arange(cap), torch.rand(cap, generator=g) * 4 + 0.1)
    _clear_flags(server, store, [10])
    valid = _reference(server, store, length)
    leaves = torch.from_numpy(P.tree_report(store)["leaves"])
    weight = torch.tensor([float(leaves[a % cap]) for a in valid], dtype=torch.float64)
    where = {a: i for i, a in enumerate(valid)}
    counts = torch.zeros(len(valid), dtype=torch.float64)
    outside = 0
    for _ in range(100):
        batch, info = store.sample_slices(200, length, end_key=w.END, prioritized=True, generator=g, return_info=True)
        assert info["_weight"].shape == (200,) and info["generation"].shape == (200,)
        assert bool((info["_weight"] > 0).all()) and bool((info["_weight"] <= 1 + 1e-6).all())
        assert w.bad_slices(batch, length)["crossing"] == 0
        for a in info["position"].tolist():
            i = where.get(a)
            if i is None:
                outside += 1
            else:
                counts[i] += 1
    expected = weight / weight.sum() * 20_000
    p = chi_square_p(counts, expected)
    record(request, slices=20_000, valid_windows=len(valid), outside=outside, p_value=p)
    assert outside == 0 and p > 0.001, p
    p_min = float(leaves[leaves > 0].min())
    want = (torch.tensor([float(leaves[r]) for r in info["start"].tolist()], dtype=torch.float64) / p_min) ** -0.5
    assert torch.allclose(info["_weight"].to(torch.float64), want, rtol=1e-5)


def test_prioritized_needs_priorities(server, make):
    store = _filled(make, 16, seed=4, rows=16)
    with pytest.raises(ValueError, match="priorities are off"):
        store.sample_slices(2, 2, end_key=w.END, prioritized=True)


def test_bad_keys_and_arguments_are_refused_and_change_nothing(server, make):
    store = make(
        "from_schema", {**w.SCHEMA, "f": ([], torch.float32), "wide": ([2], torch.bool), "flag": ([], torch.bool)},
        batch_size=[16],
    )
    td = w.episode(0, 10)
    td["f"] = torch.zeros(10)
    td["wide"] = torch.zeros(10, 2, dtype=torch.bool)
    td["flag"] = torch.zeros(10, dtype=torch.bool)
    store.extend(td)
    before = store.to_tensordict()
    state = store.ring_state()
    cases = [
        (SchemaError, "'missing' is not in the store", dict(end_key="missing")),
        (SchemaError, "holds torch.float32", dict(end_key="f")),
        (SchemaError, "holds torch.bool; it must be an integer", dict(traj_key="flag")),
        (SchemaError, "one element per row", dict(end_key="wide")),
        (SchemaError, "not a tensor entry", dict(end_key="next")),
        (ValueError, "exactly one of", dict()),
        (ValueError, "exactly one of", dict(end_key=w.END, traj_key="traj")),
    ]
    for exc, match, kw in cases:
        with pytest.raises(exc, match=match) as info:
            store.sample_slices(2, 3, **kw)
        assert store.td_id in str(info.value)
    for n, length, match in [(0, 3, "num_slices"), (2, 0, "slice_len"), (2, 17, "longer than the ring's 16"), (True, 2, "num_slices")]:
        with pytest.raises(ValueError, match=match):
            store.sample_slices(n, length, end_key=w.END)
    with pytest.raises(ValueError, match="no episode of at least 11"):
        store.sample_slices(2, 11, end_key=w.END)
    assert (store.to_tensordict() == before).all() and store.ring_state() == state
    assert store.sample_slices(3, 10, end_key=w.END)["step"].tolist() == list(range(10)) * 3


def test_an_empty_ring_and_one_of_short_episodes_say_so(server, make):
    store = make("from_schema", w.SCHEMA, batch_size=[32])
    with pytest.raises(ValueError, match="no episode of at least 2"):
        store.sample_slices(1, 2, end_key=w.END)
    for ep in range(30):
        store.extend(w.episode(ep, 1))  # (every row an end: only slices of one row)
    with pytest.raises(ValueError, match="no episode of at least 2"):
        store.sample_slices(4, 2, end_key=w.END)
    assert store.sample_slices(4, 1, end_key=w.END).batch_size == torch.Size([4])
    with pytest.raises(ValueError, match="no episode of at least 2"):
        store.sample_slices(4, 2, traj_key="traj")


def test_a_rare_valid_window_is_found_by_the_scan(server, make):
    """One valid window of 8 among 500 rows of one-row episodes: rejection keeps failing and
    the scan draws it."""
    store = make("from_schema", w.SCHEMA, batch_size=[512])
    for ep in range(60):
        store.extend(w.episode(ep, 8 if ep == 30 else 1))
    for ep in range(60, 500):
        store.extend(w.episode(ep, 1))
    batch, info = store.sample_slices(10, 8, end_key=w.END, return_info=True)
    assert set(batch["ep"].tolist()) == {30} and batch["step"].tolist() == list(range(8)) * 10


def test_the_rate_limiter_counts_slice_len_samples_per_slice(server, make):
    store = _filled(make, 64, seed=5, rows=64)
    store.set_rate_limit(min_size=1)
    store.sample_slices(3, 4, end_key=w.END)
    assert store.rate_limit().samples == 12


def test_slices_appended_to_between_the_draw_and_the_check_are_drawn_again(server, make, monkeypatch):
    """The check after the read finds the cursor moved past a window's oldest row: that slice
    is drawn again, and the batch keeps its order."""
    store = make("from_schema", w.SCHEMA, batch_size=[16])
    store.extend(w.episode(0, 16))  # (its end at row 15: no slice runs on into episode 1)
    real = S._draw
    calls = []

    def draw_then_append(*args, **kwargs):
        d = real(*args, **kwargs)
        calls.append(d.starts.numel())
        if len(calls) == 1:
            store.extend(w.episode(1, 2, done=False))  # (rows 0, 1 reserved again: windows from positions 0, 1 go stale)
        return d

    monkeypatch.setattr(S, "_draw", draw_then_append)
    batch, info = store.sample_slices(40, 4, end_key=w.END, return_info=True, generator=torch.Generator().manual_seed(5))
    assert calls[0] == 40 and len(calls) >= 2  # (some of 40 starts among 0..12 were at 0 or 1)
    assert w.bad_slices(batch, 4) == {"torn": 0, "crossing": 0, "mixed": 0, "gaps": 0}
    assert bool((info["position"] >= 2).all())
    assert torch.equal(batch["step"].reshape(40, 4)[:, 0] % 16, info["position"] % 16)


def test_a_chunked_end_column_is_refused(server, make):
    store = make("from_schema", w.SCHEMA, batch_size=[64], chunk_bytes=16)
    store.extend(w.episode(0, 10))
    with pytest.raises(SchemaError, match="chunked") as info:
        store.sample_slices(2, 3, end_key=w.END)
    assert store.td_id in str(info.value)


def test_a_damaged_end_column_gives_a_clear_error(server, make):
    store = _filled(make, 32, seed=8, rows=32)
    client = server.sync_client()
    try:
        client.delete(store._conn.keys.data(w.END))  # (evicted, or deleted by hand)
    finally:
        client.close()
    with pytest.raises(CorruptMetadataError, match=r"sample_slices\(\) from .*: the episode column .*damaged or evicted"):
        store.sample_slices(2, 3, end_key=w.END)


def test_the_rate_limiter_holds_a_slice_sample_back_and_counts_nothing(server, make):
    store = _filled(make, 64, seed=6, rows=20)
    store.set_rate_limit(min_size=30, timeout=0.05)
    with pytest.raises(RateLimitTimeoutError):
        store.sample_slices(2, 3, end_key=w.END)
    assert store.rate_limit().samples == 0
    store.extend(w.episode(99, 10))
    store.sample_slices(2, 3, end_key=w.END)
    assert store.rate_limit().samples == 6


def test_a_layout_change_before_the_draw_is_followed(server, make, monkeypatch):
    """The draw refuses a column resolved under another layout version (TDS_STALE): the
    sample resolves it again and draws."""
    store = _filled(make, 32, seed=7, rows=32)
    real = S._column
    calls = []

    def old_layout(*args, **kwargs):
        col = real(*args, **kwargs)
        calls.append(col.lv)
        return col._replace(lv=col.lv - 1) if len(calls) == 1 else col

    monkeypatch.setattr(S, "_column", old_layout)
    assert store.sample_slices(3, 2, end_key=w.END).batch_size == torch.Size([6])
    assert len(calls) == 2


def test_prioritized_slices_whose_start_generation_moved_are_drawn_again(server, make, monkeypatch):
    store = make("from_schema", w.SCHEMA, batch_size=[16])
    store.extend(w.episode(0, 16))  # (its end at row 15: no slice runs on into episode 1)
    store.enable_priorities(alpha=1.0, beta=1.0, eps=0.0)
    real = S._draw
    calls = []

    def draw_then_append(*args, **kwargs):
        d = real(*args, **kwargs)
        calls.append(d.starts.numel())
        if len(calls) == 1:
            store.extend(w.episode(1, 2, done=False))
        return d

    monkeypatch.setattr(S, "_draw", draw_then_append)
    batch, info = store.sample_slices(40, 4, end_key=w.END, prioritized=True, return_info=True,
                                      generator=torch.Generator().manual_seed(8))
    assert len(calls) >= 2 and bool((info["position"] >= 2).all())
    assert w.bad_slices(batch, 4) == {"torn": 0, "crossing": 0, "mixed": 0, "gaps": 0}
    assert bool((info["generation"] == 0).all())  # (rows written before the tree: generation 0)


@pytest.mark.parametrize("race_server", ["redis", "valkey", "cluster"], indirect=True)
def test_a_round_on_every_deployment(race_server, stores):
    """Uniform, traj_key and prioritized slices on the real servers and on a Redis Cluster
    (every key of the draw in the store's one slot)."""
    store = stores(race_server, "from_schema", w.SCHEMA, batch_size=[32])
    for ep, n in enumerate([5, 7, 3, 9, 4, 6]):
        store.extend(w.episode(ep, n))
    for kw in (dict(end_key=w.END), dict(traj_key="traj")):
        batch = store.sample_slices(20, 4, **kw)
        assert w.bad_slices(batch, 4) == {"torn": 0, "crossing": 0, "mixed": 0, "gaps": 0}
    store.enable_priorities()
    batch, info = store.sample_slices(20, 4, end_key=w.END, prioritized=True, return_info=True)
    assert w.bad_slices(batch, 4)["crossing"] == 0 and info["_weight"].shape == (20,)
    store.clear_redis()


@pytest.mark.slow
@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "prioritized"])
def test_appending_processes_and_a_sampler_never_see_a_crossing_or_torn_slice(race_server, pool, request, prioritized):
    """3 processes append whole episodes (done at each one's end) to a ring of 256 rows for
    4 s while a fourth samples slices of 4 rows (uniform, or by priority): no slice crosses
    an end, is torn, mixes episodes or has a gap."""
    conn = race_server.connection_kwargs()
    from tdstore import TensorDictStore

    store = TensorDictStore.from_schema(w.SCHEMA, batch_size=[256], **conn)
    if prioritized:
        store.enable_priorities()
    duration = 4.0
    t0 = time.time()
    appenders = [pool.submit(w.appender, conn, store.td_id, i + 1, duration) for i in range(3)]
    sampler = pool.submit(w.sampler, conn, store.td_id, 4, duration, prioritized)
    appended = sum(f.result(120) for f in appenders)
    counts = sampler.result(120)
    assert time.time() - t0 < 60
    record(request, appended=appended, **counts)
    assert counts["slices"] > 0 and appended > 256
    assert {k: counts[k] for k in ("torn", "crossing", "mixed", "gaps")} == {"torn": 0, "crossing": 0, "mixed": 0, "gaps": 0}
    store.clear_redis()
    store.close()
