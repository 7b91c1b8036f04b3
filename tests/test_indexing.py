"""Pure index math (no server): every index resolves exactly as torch resolves it."""

from __future__ import annotations

import random

import pytest
import torch

from tdstore._backend.reads import choose_read
from tdstore._core.indexing import consumed_dims, row_runs, select_rows


def _random_index(rng: random.Random, shape: tuple[int, ...]):
    n = shape[0]
    choices = [
        lambda: rng.randrange(-n, n),
        lambda: slice(rng.randrange(-n - 1, n + 1), rng.randrange(-n - 1, n + 2), rng.randint(1, 3)),
        lambda: slice(None, rng.randrange(-n, n)),
        lambda: torch.randint(-n, n, (rng.randint(0, 4),)),
        lambda: torch.randint(-n, n, (2, 2)),
        lambda: [rng.randrange(n) for _ in range(rng.randint(1, 3))],
        lambda: torch.rand(shape[:1]) < 0.5,
        lambda: torch.rand(shape) < 0.5,
        lambda: (Ellipsis, rng.randrange(shape[-1])),
        lambda: (None, slice(None), None),
        lambda: (slice(None), torch.randint(0, shape[1], (3,))) if len(shape) > 1 else 0,
        lambda: (torch.randint(0, n, (2, 1)), torch.randint(0, shape[1], (3,))) if len(shape) > 1 else 0,
    ]
    return rng.choice(choices)()


@pytest.mark.parametrize("seed", range(10))
def test_select_rows_matches_torch(seed):
    rng = random.Random(seed)
    for _ in range(500):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3)))
        idx = _random_index(rng, shape)
        ref = torch.arange(torch.Size(shape).numel()).reshape(shape)
        want = ref[torch.tensor(idx) if isinstance(idx, list) else idx]
        got = select_rows(idx, shape)
        assert got.shape == want.shape and torch.equal(got, want), (shape, idx)


@pytest.mark.parametrize("idx", [5, -6, slice(0, 2, -1), torch.tensor([7]), torch.tensor([-9]), (0, 0, 0)])
def test_select_rows_raises_like_torch(idx):
    ref = torch.arange(15).reshape(5, 3)
    with pytest.raises(Exception) as want:
        ref[idx]
    with pytest.raises(type(want.value)):
        select_rows(idx, (5, 3))


def test_row_runs_coalesce_in_result_order():
    assert row_runs(torch.tensor([0, 1, 2, 5, 6, 2]), 4) == [(0, 12), (20, 8), (8, 4)]
    assert row_runs(torch.tensor([3, 3]), 2) == [(6, 2), (6, 2)]  # duplicates stay in order
    assert row_runs(torch.tensor([], dtype=torch.long), 4) == []
    assert row_runs(torch.tensor(4), 10) == [(40, 10)]


def test_consumed_dims():
    assert consumed_dims(0, 3) == 1
    assert consumed_dims((slice(None), 2), 3) == 2
    assert consumed_dims((None, 1), 3) == 1
    assert consumed_dims((..., 1), 4) == 4
    assert consumed_dims(torch.ones(2, 3, dtype=torch.bool), 3) == 2


def test_choose_read():
    assert choose_read([(i * 16, 16) for i in range(256)]) == "gather"
    assert choose_read([(i * 21168, 21168) for i in range(256)]) == "getrange"
    # rows of 256 B or less go through the script; larger ones cost the server 1.5-9x as much there
    assert choose_read([(i * 256, 256) for i in range(256)]) == "gather"
    assert choose_read([(i * 512, 512) for i in range(256)]) == "getrange"
    assert choose_read([(i * 4096, 4096) for i in range(256)]) == "getrange"
    assert choose_read([(0, 16)] * 3) == "getrange"
    assert choose_read([(0, None)]) == "getrange"
