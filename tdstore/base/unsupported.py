"""The TensorDictBase methods that cannot work on data that lives on a server.

A view, a transposition or a memory-mapped copy would have to alias server memory;
each of these raises :class:`~tdstore.errors.UnsupportedOperationError` naming the
in-memory alternative instead of silently downloading everything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from tdstore.base.host import SharedBase
from tdstore.errors import UnsupportedOperationError

__all__ = ["StoreUnsupported", "refuse"]

_VIEW_METHODS = (
    "view", "transpose", "permute", "unsqueeze", "squeeze", "reshape", "flatten",
    "unflatten", "expand", "expand_as", "repeat", "repeat_interleave", "unbind",
    "split", "chunk", "_view", "_transpose", "_permute", "_squeeze", "_unsqueeze",
    "_add_batch_dim", "_remove_batch_dim", "_maybe_remove_batch_dim",
)  # fmt: skip
_MEMORY_METHODS = (
    "share_memory_", "memmap_", "memmap", "memmap_like", "make_memmap",
    "make_memmap_from_storage", "make_memmap_from_tensor", "_memmap_", "pin_memory",
    "consolidate", "record_stream",
)  # fmt: skip


_ON_A_SERVER = "cannot work on data that lives on a server"


def _unsupported(name: str, hint: str, why: str = _ON_A_SERVER) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise UnsupportedOperationError(f"{type(self).__name__}.{name.lstrip('_')}() {why} ({self._where()}). {hint}")

    method.__name__ = name
    method.__doc__ = f"Not supported on a store: raises UnsupportedOperationError. {hint}"
    return method


def refuse(cls: type, names: Sequence[str], hint: Callable[[str], str], why: str = _ON_A_SERVER) -> None:
    """Sets each method ``name`` of ``cls`` to one that raises UnsupportedOperationError:
    ``"<class>.<name>() <why> (<store>). <hint(name)>"``."""
    for name in names:
        setattr(cls, name, _unsupported(name, hint(name), why))


class StoreUnsupported(SharedBase):
    """Mixin: methods of TensorDictBase that raise on a store, each naming the alternative."""

    def _where(self) -> str:  # overridden by the store
        return "?"


refuse(
    StoreUnsupported,
    _VIEW_METHODS,
    lambda name: f"Call store.to_tensordict().{name.lstrip('_')}(...) for an in-memory result, "
    "or index the store (store[idx]) to read only some rows.",
)
refuse(
    StoreUnsupported,
    _MEMORY_METHODS,
    lambda name: f"Call store.to_tensordict().{name.lstrip('_')}(...) on an in-memory copy; "
    "the store itself is already shared through the server (pass its td_id).",
)
