"""The one place tdstore touches names that tensordict does not export publicly.

tensordict's private names change between releases (``tensordict.base._KeyThroughLeafError``
exists in 0.15 and not in 0.14), and tdstore supports every tensordict release its CI
installs. Each name here is tensordict's own class where the installed release has it, so
code written for TensorDict catches what a store raises, and a class of the same bases
otherwise. Nothing else in tdstore imports a private tensordict name (tests/test_compat_tensordict.py
checks the source). The methods that tensordict 0.14's TensorDictBase lacks are filled in by
:mod:`tdstore.base.compat`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

__all__ = ["KeyThroughLeafError", "InplaceWriteErrorBase", "default_covers_leaf"]


def _private(name: str) -> type | None:
    """tensordict.base's class ``name``, or None where this tensordict release lacks it."""
    import tensordict.base

    value = getattr(tensordict.base, name, None)
    return value if isinstance(value, type) else None


class _KeyThroughLeafFallback(ValueError):
    """A key goes through a leaf: ``get(("x", "sub"))`` with ``x`` a tensor.

    A ``ValueError``, as TensorDict raises for the same call in every release.
    """


class _InplaceWriteFallback(ValueError, RuntimeError):
    """A value does not fit the entry it is written into in place."""


if TYPE_CHECKING:  # what the type checker sees: a class of the bases both releases have

    class KeyThroughLeafError(ValueError): ...

    class InplaceWriteErrorBase(ValueError, RuntimeError): ...

else:  # tensordict 0.15: its own classes; 0.14 raises a plain ValueError, so the fallbacks serve
    KeyThroughLeafError = _private("_KeyThroughLeafError") or _KeyThroughLeafFallback
    InplaceWriteErrorBase = _private("_InplaceWriteError") or _InplaceWriteFallback


@functools.cache
def default_covers_leaf() -> bool:
    """Whether this tensordict's ``get(key, default)`` returns the default for a key that goes
    through a leaf (0.15) or raises as without one (0.14). The stores follow the installed
    TensorDict; asked of TensorDict itself once, so a later release's rule is followed too."""
    import torch
    from tensordict import TensorDict

    try:
        TensorDict({"a": torch.zeros(1)}, []).get(("a", "b"), None)
    except ValueError:
        return False
    return True
