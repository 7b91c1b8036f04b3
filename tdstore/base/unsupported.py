"""The TensorDictBase methods that cannot work on data that lives on a server.

A view, a transposition or a memory-mapped copy would have to alias server memory;
each of these raises :class:`~tdstore.errors.UnsupportedOperationError` naming the
in-memory alternative instead of silently downloading everything.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

from tdstore.base.host import SharedBase
from tdstore.errors import UnsupportedOperationError

if TYPE_CHECKING:
    from tensordict import TensorDictBase

__all__ = ["StoreUnsupported", "install", "refuse"]

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


def _unsupported(name: str, hint: str, why: str = _ON_A_SERVER) -> Callable[..., NoReturn]:
    def method(self: TensorDictBase, *args: object, **kwargs: object) -> NoReturn:
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
    """A table of methods (not a base; :func:`install`): TensorDictBase's methods that raise on a
    store, each naming the alternative."""


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


#: what every class body holds: not methods of a table
_CLASS_MACHINERY = frozenset(vars(type("_Empty", (), {}))) | {"__annotations__", "__orig_bases__", "__parameters__"}


def install(cls: type, *tables: type) -> None:
    """Gives ``cls`` the methods of each table (:class:`StoreUnsupported`, and
    :class:`~tdstore.base.compat.StoreCompat014`) that neither ``cls`` nor any of its bases
    before ``TensorDictBase`` defines: they take the place of TensorDictBase's methods only,
    as tables between the store's own classes and TensorDictBase would in the MRO, without
    being bases. Earlier tables win over later ones."""
    below = cls.__mro__[: next(i for i, k in enumerate(cls.__mro__) if k.__name__ == "TensorDictBase")]
    for table in tables:
        for name, value in vars(table).items():
            if name in _CLASS_MACHINERY or any(name in vars(k) for k in below):
                continue
            setattr(cls, name, value)
    abc.update_abstractmethods(cls)  # (TensorDictBase's abstract methods they define are no longer abstract)
