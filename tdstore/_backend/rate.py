"""The rate limiter's reads (tdstore/replay/rate_limit.py; the scripts are lua/rate_*.lua)."""

from __future__ import annotations

from tdstore._backend.protocols import AsyncClient
from tdstore._core.keys import StoreKeys

__all__ = ["read_limiter"]

FIELDS = ["min", "spi", "lo", "hi", "to", "ins", "smp"]


async def read_limiter(client: AsyncClient, keys: StoreKeys) -> list[object]:
    """The limiter's settings and counts (:data:`FIELDS`, one HMGET: one consistent read)."""
    return list(await client.execute_command("HMGET", keys.rate, *FIELDS))
