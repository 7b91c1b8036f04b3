"""The server steps of trajectory slices (``tdstore/replay/slices.py``): the draw of the
slices' starts (``lua/slice_draw.lua``) and the check after their rows were read
(``lua/slice_check.lua``). No row byte passes through these steps; the draw reads only the
bytes of the episode column of the windows it tests. Both are sent by ``Connection.script``
(a read: from the calling thread where it can)."""

from __future__ import annotations

from tdstore._core.keys import StoreKeys

__all__ = ["draw_keys", "check_keys"]


def draw_keys(keys: StoreKeys, column: str) -> list[str]:
    """KEYS of ``slice_draw``: the meta hash, the cursor, the flags, the episode column
    ``column`` (its one data string) and the four priority keys."""
    return [keys.meta, keys.ring, keys.flags, column, *keys.replay_keys()]


def check_keys(keys: StoreKeys) -> list[str]:
    """KEYS of ``slice_check``."""
    return [keys.flags, keys.ring, keys.prio_gens]

