"""The server steps of prioritized replay (``tdstore/replay/priorities.py``): its scripts'
calls (``lua/prio_*.lua``), the ring cursor set together with the tree's rebuild in one
MULTI, and the raw read of the tree for checks. No row byte passes through these steps."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import redis.exceptions

from tdstore._backend.protocols import AsyncClient, AsyncPipeline
from tdstore._backend.scripts import ScriptRunner, get_script
from tdstore._backend.step import read_snapshot
from tdstore._core.keys import CURSOR_MAX, StoreKeys
from tdstore._core.layout import Command
from tdstore.errors import StoreNotFoundError, translate_response_error

__all__ = [
    "build_keys", "draw_keys", "call", "new_rows_command", "set_ring_total", "read_tree", "read_generations",
    "read_root",
]


def build_keys(keys: StoreKeys) -> list[str]:
    """KEYS of ``prio_build`` and ``prio_draw``."""
    return [keys.meta, keys.ring, keys.flags, *keys.replay_keys()]


draw_keys = build_keys


async def call(client: AsyncClient, runner: ScriptRunner, name: str, keys: Sequence[str], args: Sequence[str | int]) -> object:
    """EVALSHA of the script ``name`` (loaded again on NOSCRIPT)."""
    return await runner.call(client, name, keys, [str(a) for a in args])


def new_rows_command(keys: StoreKeys, runner: ScriptRunner) -> Callable[[int, int], Command]:
    """The command builder of an append's MULTI for a store with priorities on: ``start`` ->
    an EVAL of ``lua/prio_new.lua`` (the script's text, never NOSCRIPT inside the MULTI)."""
    text = get_script("prio_new").text(runner.shebang)
    fixed = (keys.meta, *keys.replay_keys())

    def command(start: int, n: int) -> Command:
        return ("EVAL", text, len(fixed), *fixed, start, n)

    return command


async def set_ring_total(client: AsyncClient, keys: StoreKeys, runner: ScriptRunner, total: int, capacity: int) -> bool:
    """``lua/ring_total.lua`` and the rebuild of the priority tree (``prio_build`` "reset", which
    does nothing when priorities are off) in one MULTI: no append or sample sees the new cursor
    with the old tree. False when there is no store (nothing written)."""
    total, capacity = int(total), int(capacity)
    if not 0 <= total <= CURSOR_MAX or capacity < 1:
        raise ValueError(
            f"the ring of {keys.base} needs a row count from 0 to 2**52 and a capacity >= 1, got {total} and {capacity}"
        )

    async def send() -> list[object]:
        async with client.pipeline(transaction=True) as pipe:
            runner.queue(
                pipe, "ring_total", [keys.meta, keys.ring, keys.flags, keys.fence, keys.wv, keys.rate], [str(total), str(capacity)]
            )
            runner.queue(pipe, "prio_build", build_keys(keys), ["reset"])
            return list(await pipe.execute(raise_on_error=False))

    await runner.ensure_loaded(client, "ring_total", "prio_build")
    replies = await runner.run_pipeline(client, send)
    for reply in replies:
        if isinstance(reply, redis.exceptions.ResponseError):
            exc = translate_response_error(reply)
            if isinstance(exc, StoreNotFoundError):
                return False  # (both scripts found no store: neither wrote)
            raise exc from reply
        if isinstance(reply, Exception):
            raise reply
    return True


async def read_tree(client: AsyncClient, keys: StoreKeys) -> list[object]:
    """The settings, the four priority keys, the flags and the cursor, in one snapshot."""

    def build(pipe: AsyncPipeline) -> None:
        pipe.hget(keys.meta, "prio")
        for key in keys.replay_keys():
            pipe.get(key)
        pipe.get(keys.flags)
        pipe.get(keys.ring)

    return await read_snapshot(client, keys, build)


async def read_generations(client: AsyncClient, keys: StoreKeys, runs: Sequence[tuple[int, int]], width: int) -> list[object]:
    """The generations of the rows of ``runs`` (``(first row, count)`` each, not wrapping),
    ``width`` bytes each, in one snapshot: one GETRANGE per run."""

    def build(pipe: AsyncPipeline) -> None:
        for first, count in runs:
            pipe.getrange(keys.prio_gens, first * width, (first + count) * width - 1)

    return await read_snapshot(client, keys, build)


async def read_root(client: AsyncClient, keys: StoreKeys) -> list[object]:
    """The settings and the tree's first 46 bytes (the root node: the sum of p, then the least
    positive p, as 2 doubles or 46 bytes of text by the settings' encoding), in one snapshot:
    what a sharded buffer weighs its shards by."""

    def build(pipe: AsyncPipeline) -> None:
        pipe.hget(keys.meta, "prio")
        pipe.getrange(keys.prio_tree, 0, 45)

    return await read_snapshot(client, keys, build)
