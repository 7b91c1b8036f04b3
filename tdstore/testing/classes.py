"""Importable tensorclasses for the round-trip tests (from_store imports them by path)."""

from __future__ import annotations

import torch
from tensordict import tensorclass


@tensorclass
class Point:
    pos: torch.Tensor
    mass: torch.Tensor
