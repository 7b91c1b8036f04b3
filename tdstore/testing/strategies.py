"""Seeded random data shared by the differential suites."""

from __future__ import annotations

import random

import torch


def rand_tensor(
    rng: random.Random, shape: tuple[int, ...], dtype: torch.dtype, *, int_range: tuple[int, int] = (-1000, 1000)
) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` drawn from a torch generator seeded by ``rng``."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_complex:
        return torch.complex(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)).to(dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, int_range[0]), min(info.max, int_range[1])
    return torch.randint(low, high, shape, generator=gen).to(dtype)
