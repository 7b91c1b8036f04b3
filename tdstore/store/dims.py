"""The batch dims of a store: its batch size and dim names, changed on the server (functions
that take the store; :class:`~tdstore.store.core.TensorDictStore`'s ``batch_size`` setter and
names methods delegate here).

Each change is one layout commit (``_commit_planned``): the plan checks it against the
layout read in the same step, so a concurrent layout change makes it plan again.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tdstore._backend import ops as _backend
from tdstore._core import values as _values
from tdstore._core.layout import Entry

if TYPE_CHECKING:
    from tdstore.store import TensorDictStore

__all__ = ["change_batch_size", "write_names"]


def change_batch_size(store: TensorDictStore, new_size: torch.Size) -> None:
    """The ``batch_size`` setter: one layout commit (every entry must fit the new size; names
    of another length are dropped)."""

    def plan(layout: _backend.Layout) -> tuple[list[_backend.Op], dict[str, str] | None]:
        n = len(new_size)
        for path, meta in store._descendants(layout, store._path):
            shape = meta.shape if meta.is_tensor else meta.batch_size if meta.is_node else None
            if shape is not None and torch.Size(shape[:n]) != new_size:
                raise RuntimeError(
                    f"the batch size {list(new_size)} does not fit entry {path!r} of shape "
                    f"{list(shape)} in {store._where()}"
                )
        names = store._node(layout).dim_names
        if names is not None and len(names) != n:
            names = None
        if not store._path:
            return [], {"batch_size": json.dumps(list(new_size)), "names": json.dumps(names)}
        meta = layout.entries[store._path]._replace(batch_size=tuple(new_size), names=None if names is None else tuple(names))
        return [_backend.Op("node", store._path, meta)], None

    store._commit_planned(plan, check_lock=True)


def write_names(store: TensorDictStore, names: list[str | None] | None) -> None:
    """Gives the store's batch dims ``names`` (None: unnamed) in one layout commit; the leading
    names of every nested tensordict follow, as TensorDict's do."""
    if names is not None:
        _values.check_names(names, store._where())
        if all(n is None for n in names):
            names = None

    def plan(layout: _backend.Layout) -> tuple[list[_backend.Op], dict[str, str] | None]:
        # as TensorDict does: the leading names of every nested tensordict follow
        ops = _nested_names_ops(store._descendants(layout, store._path), names, len(store._node(layout).batch_size or ()))
        if not store._path:
            return ops, {"names": json.dumps(names)}
        meta = layout.entries[store._path]._replace(names=None if names is None else tuple(names))
        return [_backend.Op("node", store._path, meta), *ops], None

    store._commit_planned(plan, check_lock=False)


def _nested_names_ops(
    descendants: Sequence[tuple[tuple[str, ...], Entry]], names: list[str | None] | None, n: int
) -> list[_backend.Op]:
    """``node`` ops giving every nested tensordict the leading ``names`` (None: unnamed) of its parent."""
    lead: list[str | None] = list(names) if names is not None else [None] * n
    ops = []
    for path, meta in descendants:
        if not meta.is_node:
            continue
        old = meta.dim_names or [None] * len(meta.batch_size or ())
        new: list[str | None] | None = lead + list(old[n:])
        if new is not None and all(x is None for x in new):
            new = None
        if new != meta.dim_names:
            ops.append(_backend.Op("node", path, meta._replace(names=None if new is None else tuple(new))))
    return ops
