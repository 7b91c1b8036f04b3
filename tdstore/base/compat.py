"""tensordict 0.14.3 compatibility for :class:`~tdstore.TensorDictStore`.

TorchRL 0.14.1 pins ``tensordict<0.15,>=0.14.3``, so the store must work on 0.14.3 as
well as 0.15.x. tensordict 0.15 gives ``TensorDictBase`` generic implementations of many
methods and hooks for backends whose reads return copies (``_reads_return_copies``,
``_inplace_on_copies``...). 0.14.3 has neither: ~30 more methods are abstract, and the
in-place math (``add_``, ``zero_``, ``+=``...) changes the tensors that ``items()``
returns, which on a store are copies, so the change would be silently lost.

:class:`StoreCompat014` fills that gap with TensorDictBase's public surface only:
read-only methods run on ``to_tensordict()`` (one consistent snapshot), the in-place
methods run through the store's compare-and-set ``_inplace_on_copies``, and the methods
that would alias server memory raise ``UnsupportedOperationError``. On 0.15.x the table
is empty, so nothing changes there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import tensordict
from tensordict import NestedKey, TensorDict, TensorDictBase

from tdstore._core.keys import KeyTypeError
from tdstore.base.handle import snapshot_of
from tdstore.base.host import SharedBase
from tdstore.errors import UnsupportedOperationError

if TYPE_CHECKING:
    import torch
    from tensordict.base import CompatibleType
    from tensordict.utils import IndexType

__all__ = ["NEEDS_COMPAT", "StoreCompat014", "TENSORDICT_VERSION"]

TENSORDICT_VERSION: str = str(tensordict.__version__)
#: True where TensorDictBase lacks the 0.15 copy hooks (tensordict 0.14.x)
NEEDS_COMPAT: bool = not hasattr(TensorDictBase, "_inplace_on_copies")

# In-place methods of tensordict 0.14.3 that change the leaves that items() returns
# (copies, on a store); each runs on a snapshot and is written back as one compare-and-set.
_INPLACE_MATH = (
    "abs_", "acos_", "add_", "addcdiv_", "addcmul_", "asin_", "atan_", "ceil_", "clamp_max_",
    "clamp_min_", "cos_", "cosh_", "div_", "erf_", "erfc_", "exp_", "expm1_", "floor_", "frac_",
    "lerp_", "lgamma_", "log10_", "log1p_", "log2_", "log_", "masked_fill_", "maximum_",
    "minimum_", "mul_", "neg_", "pow_", "reciprocal_", "round_", "sigmoid_", "sign_", "sin_",
    "sinh_", "sqrt_", "sub_", "tan_", "tanh_", "trunc_", "zero_",
)  # fmt: skip

# Read-only methods that build a new in-memory TensorDict: they run on one snapshot.
_ON_SNAPSHOT = (
    "__ge__", "__gt__", "__le__", "__lt__", "__or__", "__xor__", "all", "any", "masked_fill",
    "masked_select", "_cast_reduction", "_multithread_apply_flat",
)  # fmt: skip

# Methods that would alias server memory.
_UNSUPPORTED = ("_repeat", "_unbind", "_to_module", "_multithread_rebuild")


def _is_nested_key(key: object) -> bool:
    if isinstance(key, str):
        return True
    return isinstance(key, tuple) and bool(key) and all(_is_nested_key(k) for k in key)


def _inplace(name: str) -> Callable[..., TensorDictBase]:
    def method(self: TensorDictBase, *args: object, **kwargs: object) -> TensorDictBase:
        def run(td: TensorDictBase) -> TensorDictBase:
            getattr(td, name)(*args, **kwargs)
            return td

        run.__name__ = name
        return self._inplace_on_copies(run)

    method.__name__ = name
    method.__doc__ = f"``{name}`` as one compare-and-set on the server (see ``apply_``)."
    return method


def _on_snapshot(name: str) -> Callable[..., object]:
    def method(self: TensorDictBase, *args: object, **kwargs: object) -> object:
        args = tuple(snapshot_of(a) for a in args)
        return getattr(self.to_tensordict(), name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"``{name}`` of an in-memory snapshot (``to_tensordict()``)."
    return method


def _unsupported(name: str) -> Callable[..., object]:
    def method(self: TensorDictBase, *args: object, **kwargs: object) -> object:
        raise UnsupportedOperationError(
            f"{type(self).__name__}.{name.lstrip('_')}() cannot work on data that lives on a server "
            f"({self._where()}). Call it on store.to_tensordict() for an in-memory result."
        )

    method.__name__ = name
    return method


class StoreCompat014(SharedBase):
    """A table of methods (not a base) installed on both store classes where TensorDictBase's would
    apply (:func:`tdstore.base.unsupported.install`): the 0.15 behaviour on tensordict 0.14.x."""


if NEEDS_COMPAT:

    class _Methods:
        @property
        def names(self: TensorDictBase) -> list[str | None]:
            names = self._td_dim_names
            return [None] * self.batch_dims if names is None else list(names)

        @names.setter
        def names(self: TensorDictBase, value: Sequence[str | None] | None) -> None:
            self._set_names(value)

        def _apply_nest(self: TensorDictBase, fn: Callable[..., object], *others: object, inplace: bool = False, **kwargs: object) -> TensorDictBase | None:
            others = tuple(snapshot_of(o) for o in others)
            if kwargs.get("out") is self:
                kwargs.pop("out")
                inplace = True
            if not inplace:
                return self.to_tensordict()._apply_nest(fn, *others, inplace=False, **kwargs)

            def run(td: TensorDictBase) -> TensorDictBase:
                td._apply_nest(fn, *others, inplace=True, **kwargs)
                return td

            run.__name__ = getattr(fn, "__name__", "apply_")
            return self._inplace_on_copies(run)

        def _select(self: TensorDictBase, *keys: NestedKey, inplace: bool = False, strict: bool = True, set_shared: bool = True) -> TensorDictBase:
            if inplace:  # as tensordict 0.15 does for every backend that reads copies
                raise RuntimeError(f"Cannot call select inplace on {self._where()}; use del_ to remove entries")
            return self.to_tensordict()._select(*keys, inplace=False, strict=strict, set_shared=set_shared)

        def _exclude(self: TensorDictBase, *keys: NestedKey, inplace: bool = False, set_shared: bool = True) -> TensorDictBase:
            if inplace:
                raise RuntimeError(f"Cannot call exclude inplace on {self._where()}; use del_ to remove entries")
            return self.to_tensordict()._exclude(*keys, inplace=False, set_shared=set_shared)

        def _index_tensordict(
            self: TensorDictBase, index: IndexType, new_batch_size: torch.Size | None = None, names: Sequence[str] | None = None
        ) -> TensorDictBase:
            return self._read_index(index)

        def _convert_to_tensordict(self: TensorDictBase, dict_value: Mapping[str, object], non_blocking: bool | None = None) -> TensorDict:
            return TensorDict(dict_value, batch_size=self.batch_size, device=self.device, names=self._maybe_names())

        def _check_device(self: TensorDictBase) -> None:
            return None

        def _check_is_shared(self: TensorDictBase) -> bool:
            return False

        def _stack_onto_(self: TensorDictBase, list_item: list[CompatibleType], dim: int) -> TensorDictBase:
            import torch

            stacked = torch.stack([snapshot_of(td) for td in list_item], dim)
            self.update_(stacked)
            return self

        @classmethod
        def _load_memmap(cls, *args: object, **kwargs: object) -> TensorDictBase:
            raise UnsupportedOperationError(f"{cls.__name__} cannot be loaded from a memory-mapped folder")

        def from_dict_instance(self: TensorDictBase, input_dict: Mapping[NestedKey, object], *args: object, **kwargs: object) -> TensorDict:
            return TensorDict.from_dict(input_dict, *args, **kwargs)

        def set(self: TensorDictBase, key: object, item: CompatibleType, *args: object, **kwargs: object) -> TensorDictBase:
            # 0.14.3 turns a key such as 3 into () before the store sees it; 0.15 refuses it here
            if not _is_nested_key(key):
                raise KeyTypeError(
                    "Only NestedKeys are supported: a key must be a string or a non-empty, possibly nested "
                    f"tuple of strings. Got key {key!r} for {self._where()}."
                )
            return TensorDictBase.set(self, key, item, *args, **kwargs)

        def popitem(self: TensorDictBase) -> tuple[NestedKey, CompatibleType]:
            keys = list(self.keys())
            if not keys:
                raise KeyError(f"popitem(): {self._where()} is empty")
            key = keys[-1]
            return key, self.pop(key)

    for _name, _value in list(vars(_Methods).items()):
        if not _name.startswith("__"):
            setattr(StoreCompat014, _name, _value)
    for _name in _INPLACE_MATH:
        setattr(StoreCompat014, _name, _inplace(_name))
    for _name in _ON_SNAPSHOT:
        setattr(StoreCompat014, _name, _on_snapshot(_name))
    for _name in _UNSUPPORTED:
        setattr(StoreCompat014, _name, _unsupported(_name))
