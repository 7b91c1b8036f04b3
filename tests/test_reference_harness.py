"""A seeded differential harness: every case runs three ways and the answers are compared.

Each case (a public method with its arguments, an index form, a value) runs

* on a tdstore store (``tdstore.TensorDictStore`` / ``LazyStackedTensorDictStore``),
* on the in-memory ``TensorDict`` / ``LazyStackedTensorDict`` holding the same data (the
  *oracle*), and
* on ``tensordict.store.TensorDictStore`` (the *incumbent*, installed with tensordict) on the
  same server.

A case's outcome is its normalised result (types, dtypes, shapes and values) or its exception,
plus, for a write, the state of the whole store afterwards. tdstore must agree with the oracle:
the same result, or an exception that is an instance of the oracle's exception type, and after
an exception the store exactly as it was. Where the incumbent disagrees with the oracle, the
disagreement's family must be listed in :data:`DISAGREEMENTS` with the reference tdstore follows
and why; a new disagreement fails the run. The incumbent is then re-synchronised from the oracle,
so one disagreement does not cascade into the following cases.

Store kinds (one store of each per batch of cases, small tensors): dense 1-d and 2-d batches,
nested tensordicts (with more batch dims than the root), non-tensor entries, new keys written
through indices, chunked entries (``chunk_bytes=``, tdstore only) and lazy stacks.
The run prints ``harness cases on <server>: N`` and requires at least 3,000 per server.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from tdstore import TensorDictStore

MIN_CASES = 3000
#: the share of each batch's cases that runs (all of them would be ~4,000 per server)
KEEP = 0.8
SEED = 20261201

# --------------------------------------------------------------------------- the table
#: family -> (the reference tdstore follows, why). A family is the part of a case label before
#: the first ``:``. The incumbent may disagree with the oracle only on these families.
_NT_DIM0 = "the incumbent refuses non-tensor entries at an index that is not along dim 0 (TypeError)"
_RANGE_FIRST = (
    "the incumbent checks the index range before the dtypes (IndexError); TensorDict and torch check "
    "the dtypes first (RuntimeError)"
)
DISAGREEMENTS: dict[str, tuple[str, str]] = {
    "nested batch size read back": ("oracle", (
        "the incumbent reads nested tensordicts that have more batch dims than their parent back with "
        "the parent's batch size (reads and to_tensordict()); tdstore keeps them, as TensorDict does"
    )),
    "store unreadable afterwards": ("oracle", (
        "after a non-tensor value is written at an index of a store with 2 batch dims, every read of the "
        "incumbent's store raises RuntimeError (it cannot set a lazy stack's batch size); tdstore stays readable"
    )),
    "non-tensor read back as a raw value": ("oracle", (
        "the incumbent's indexed reads return a non-tensor entry's raw value; TensorDict a NonTensorData"
    )),
    "non-tensor entries differ": ("oracle", (
        "only non-tensor leaves differ: the incumbent's indexed read of a non-tensor entry that holds one "
        "value per row of a 2-d batch returns every row's value, unindexed (wrong data); and it keeps a "
        "non-tensor entry of a nested tensordict with more batch dims over the parent's batch dims only"
    )),
    "del_ missing": ("oracle", "the incumbent's del_ of a missing key returns; TensorDict raises KeyError"),
    "set_at_ missing key": ("oracle", "the incumbent's set_at_ of a missing key returns; TensorDict raises KeyError"),
    "get non-tensor": ("oracle", (
        "for a non-tensor entry that holds one value per row, the incumbent's get returns a list; "
        "TensorDict returns the NonTensorStack"
    )),
    "get_at non-tensor": ("oracle", "the incumbent's get_at of a non-tensor entry returns the raw value; TensorDict returns NonTensorData"),
    "lazy getitem index": ("oracle", (
        "the incumbent's lazy store returns a dense TensorDict for an index that keeps the stack dim; "
        "LazyStackedTensorDict returns a LazyStackedTensorDict"
    )),
    "lazy setitem element does not fit": ("oracle", (
        "the incumbent raises a plain RuntimeError; LazyStackedTensorDict raises tensordict's in-place "
        "write error (tdstore's ElementShapeError is both that and a SchemaError)"
    )),
    "set_ wrong feature shape": ("oracle", (
        "the incumbent's set_ accepts a value whose feature shape differs from the entry's; TensorDict "
        "raises its in-place write error (tdstore's InplaceWriteError is one)"
    )),
    "set_at_ non-tensor plain value": ("oracle", _NT_DIM0 + "; it also accepts an index that selects nothing, which TensorDict refuses"),
    "index range checked before the dtypes": ("oracle", _RANGE_FIRST),
    "setitem index td other dtype (state)": ("oracle", (
        "a refused indexed write (another dtype, advanced index) leaves the incumbent with the new keys it "
        "created on the way; TensorDict (restored here to its state before the case) and tdstore have none"
    )),
    "select()": ("oracle", "the incumbent refuses select (NotImplementedError: call to_tensordict() first)"),
    "select missing()": ("oracle", "the incumbent refuses select (NotImplementedError); TensorDict raises KeyError"),
    "exclude()": ("oracle", "the incumbent refuses exclude (NotImplementedError: call to_tensordict() first)"),
    "apply()": ("oracle", "the incumbent's apply passes non-tensor values to the function (AttributeError on a str)"),
    "values count()": ("oracle", "as items(): the incumbent counts non-tensor entries among the leaves"),
    "items()": ("oracle", (
        "the incumbent's items(leaves_only=True) yields non-tensor entries, as raw values; TensorDict leaves them out"
    )),
    "setitem index 0-d tensor": ("oracle", (
        "the incumbent refuses a tensor value at an index (TypeError); TensorDict writes it into every "
        "leaf, with torch's dtype rules"
    )),
    "setitem index nested non-tensor": ("oracle", _NT_DIM0),
    "setitem index td": ("oracle", _NT_DIM0),
    "setitem index td other dtype": ("oracle", _NT_DIM0),
    "setitem index td with non-tensor": ("oracle", _NT_DIM0),
    "setitem index new key": ("oracle", (
        "the incumbent sizes a key created through an index of several dims from the index; TensorDict "
        "from the batch size"
    )),
    "setitem index wrong batch": ("oracle", (
        "the incumbent accepts a value of another batch size at an index that selects nothing; TensorDict refuses it"
    )),
}


#: family -> why: where tdstore deliberately differs from the oracle; such a case runs its
#: ``expect`` on the oracle (what tdstore does instead) and tdstore must match that.
DEVIATIONS: dict[str, str] = {
    "lazy set_at_ feature": (
        "LazyStackedTensorDict.set_at_ raises IndexError for an index with more items than batch dims "
        "unless it holds `...`; tdstore indexes the leaf as TensorDict.set_at_ does (issue 15, section 3)"
    ),
    "lazy setitem element extra size-1 dims": (
        "LazyStackedTensorDict refuses a value with extra leading size-1 dims at an element; tdstore takes "
        "it as TensorDict and torch do (issue 15, section 4)"
    ),
}


def _incumbent() -> Any:
    """tensordict.store.TensorDictStore; its absence fails the run (never a skip)."""
    from tensordict.store import TensorDictStore as Incumbent

    return Incumbent


# --------------------------------------------------------------------------- outcomes
def norm(x: Any) -> Any:
    """A comparable, hashable-free description of a result: types, dtypes, shapes and values."""
    if isinstance(x, NonTensorData):
        return ("NonTensorData", tuple(x.batch_size), norm(x.data))
    if isinstance(x, NonTensorStack):
        flat = _flat(x.tolist())
        if flat and all(type(v) is type(flat[0]) and v == flat[0] for v in flat):
            # one value in every row: tdstore keeps it as one NonTensorData where TensorDict may
            # hold a stack of equal values (after copy_ or a write at every row); same content
            return ("NonTensorData", tuple(x.batch_size), norm(flat[0]))
        return ("NonTensorStack", tuple(x.batch_size), norm(x.tolist()))
    if isinstance(x, torch.Tensor):
        return ("tensor", str(x.dtype), tuple(x.shape), x.cpu().tolist())
    if isinstance(x, TensorDictBase):
        if isinstance(x, LazyStackedTensorDict):
            kind = "lazy"
        else:
            kind = "td"
            if hasattr(x, "to_tensordict") and not isinstance(x, TensorDict):
                # a store (or a view of one): its content; a lazy store counts as a lazy stack
                lazy = "Lazy" in type(x).__name__
                x = x.to_tensordict()
                kind = "lazy" if lazy or isinstance(x, LazyStackedTensorDict) else "td"
        items = {}
        for key in x.keys():
            try:
                items[key] = norm(x.get(key))
            except Exception as e:  # noqa: BLE001 - a ragged leaf of a lazy stack
                items[key] = ("unreadable", type(e).__name__)
        return (kind, tuple(x.batch_size), tuple(sorted(items.items())))
    if isinstance(x, dict):
        return ("dict", tuple(sorted((str(k), norm(v)) for k, v in x.items())))
    if isinstance(x, torch.Size):
        return ("size", tuple(x))
    if isinstance(x, (list, tuple)):
        return ("list" if isinstance(x, list) else "tuple", [norm(v) for v in x])
    if isinstance(x, (str, bytes, int, float, bool, type(None))):
        return x
    return ("other", type(x).__name__, repr(x))


def diff(a: Any, b: Any, where: str = "") -> str:
    """Where two normalised values first differ, shortly."""
    if a == b:
        return ""
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == 3 and len(b) == 3 and a[0] in ("td", "lazy") and b[0] in ("td", "lazy"):
        if a[:2] != b[:2]:
            return f"{where or 'root'}: {a[:2]} vs {b[:2]}"
        da, db = dict(a[2]), dict(b[2])
        if da.keys() != db.keys():
            return f"{where or 'root'}: keys {sorted(da)} vs {sorted(db)}"
        for k in da:
            d = diff(da[k], db[k], f"{where}.{k}" if where else str(k))
            if d:
                return d
    return f"{where or 'root'}: {str(a)[:200]} vs {str(b)[:200]}"


def _flat(values: Any) -> list[Any]:
    if isinstance(values, list):
        return [v for item in values for v in _flat(item)]
    return [values]


@dataclass
class Outcome:
    value: Any = None
    exc: BaseException | None = None

    def show(self) -> str:
        if self.exc is not None:
            return f"raised {type(self.exc).__name__}: {str(self.exc)[:160]}"
        return f"returned {str(self.value)[:300]}"


def attempt(fn: Callable[[Any], Any], target: Any, write: bool = False) -> Outcome:
    """Runs a case; a write's result (``self`` for most in-place methods) is not compared, its state is."""
    try:
        result = fn(target)
        return Outcome(value=None if write else norm(result))
    except Exception as e:  # noqa: BLE001 - every exception is an outcome to compare
        return Outcome(exc=e)


def agree(got: Outcome, want: Outcome) -> bool:
    """``got`` agrees with ``want``: the same value, or an instance of ``want``'s exception type."""
    if want.exc is not None:
        return got.exc is not None and isinstance(got.exc, type(want.exc))
    return got.exc is None and got.value == want.value


def state(target: Any) -> Any:
    """The whole content of a store or tensordict, normalised (a store is read in one snapshot);
    an exception when it cannot be read."""
    try:
        return _state(target)
    except Exception as e:  # noqa: BLE001 - an unreadable store is a state to compare
        return ("unreadable", type(e).__name__, str(e)[:200])


def _state(target: Any) -> Any:
    if isinstance(target, (TensorDict, LazyStackedTensorDict)):
        return norm(target.to_tensordict() if isinstance(target, LazyStackedTensorDict) and _dense(target) else target)
    return norm(target.to_tensordict())


def _dense(stack: LazyStackedTensorDict) -> bool:
    try:
        stack.to_tensordict()
    except RuntimeError:
        return False
    return True


def _leaves(st: Any, prefix: str = "") -> dict[str, Any]:
    """The leaves of a normalised state, without the nested batch sizes."""
    if isinstance(st, tuple) and len(st) == 3 and st[0] in ("td", "lazy"):
        out: dict[str, Any] = {}
        for k, v in st[2]:
            out.update(_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: st}


def _state_family(theirs: Any, ref: Any, family: str) -> str:
    """The family of an incumbent disagreement on a value or a state: the incumbent's nested batch
    sizes and its unreadable stores are one family each (they follow every later case), any other
    is the case's."""
    if isinstance(theirs, tuple) and theirs[:1] == ("unreadable",):
        return "store unreadable afterwards"
    if isinstance(theirs, tuple) and isinstance(ref, tuple) and theirs[:1] != ref[:1]:
        return family + " (state)"  # another kind of result (a dense TensorDict for a lazy stack, ...)
    mine, other = _leaves(theirs), _leaves(ref)
    if mine == other:
        return "nested batch size read back"
    if mine.keys() == other.keys() and all(
        a == b or (isinstance(b, tuple) and b[:1] == ("NonTensorData",) and a == b[2]) for a, b in zip(
            (mine[k] for k in other), other.values(), strict=True)
    ):
        return "non-tensor read back as a raw value"
    if mine.keys() == other.keys() and all(
        mine[k] == v or (isinstance(v, tuple) and v[:1] in (("NonTensorData",), ("NonTensorStack",))) for k, v in other.items()
    ):
        return "non-tensor entries differ"
    return family + " (state)"


def _leaf_diff(theirs: Any, ref: Any) -> str:
    mine, other = _leaves(theirs), _leaves(ref)
    for k in sorted(set(mine) | set(other)):
        if mine.get(k) != other.get(k):
            return f"leaf {k}: {str(mine.get(k))[:300]} vs {str(other.get(k))[:300]}"
    return ""


# --------------------------------------------------------------------------- cases
@dataclass
class Case:
    label: str  # "family: details"
    fn: Callable[[Any], Any]
    write: bool = False
    #: run on the oracle instead of ``fn`` where tdstore deliberately differs (family in DEVIATIONS)
    expect: Callable[[Any], Any] | None = None

    @property
    def family(self) -> str:
        return self.label.split(":", 1)[0]


@dataclass
class Tally:
    cases: int = 0
    by_family: Counter = field(default_factory=Counter)
    seen_disagreements: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)


class Trio:
    """One oracle, one tdstore store and one incumbent store holding the same data."""

    def __init__(self, server: Any, oracle: TensorDictBase, tally: Tally, *, chunk_bytes: int | None = None) -> None:
        self.server = server
        self.oracle = oracle
        self.tally = tally
        kw: dict[str, Any] = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
        self.ours = TensorDictStore.from_tensordict(oracle, **server.connection_kwargs(), **kw)
        self.theirs: Any = None
        self._sync_theirs()

    def _sync_theirs(self) -> None:
        if self.theirs is not None:
            try:
                self.theirs.clear_redis()
            finally:
                self.theirs.close()
        self.theirs = _incumbent().from_tensordict(self.oracle.clone(), **self.server.connection_kwargs())

    def close(self) -> None:
        for store in (self.ours, self.theirs):
            try:
                store.clear_redis()
            finally:
                store.close()

    def run(self, case: Case) -> None:
        tally = self.tally
        tally.cases += 1
        tally.by_family[case.family] += 1
        before = self.oracle.clone() if case.write else None
        if case.expect is not None:
            assert case.family in DEVIATIONS, case.family
        want = attempt(case.expect or case.fn, self.oracle, case.write)
        got = attempt(case.fn, self.ours, case.write)
        theirs = attempt(case.fn, self.theirs, case.write)
        if want.exc is not None and before is not None:
            self.oracle = before  # TensorDict may have written part of a refused value
        follow = DISAGREEMENTS.get(case.family, ("oracle", ""))[0]
        expected = theirs if follow == "incumbent" else want
        if not agree(got, expected):
            detail = diff(got.value, expected.value) if got.exc is None and expected.exc is None else ""
            tally.failures.append(f"{case.label}: tdstore {got.show()}; {follow} {expected.show()} {detail}")
        if not agree(theirs, want):
            family = case.family
            if isinstance(theirs.exc, IndexError) and isinstance(want.exc, RuntimeError) and "dtypes match" in str(want.exc):
                family = "index range checked before the dtypes"
            elif theirs.exc is None and want.exc is None:
                family = _state_family(theirs.value, want.value, case.family)
                family = case.family if family.endswith(" (state)") else family
            tally.seen_disagreements[family] += 1
            if family not in DISAGREEMENTS:
                detail = diff(theirs.value, want.value) if theirs.exc is None and want.exc is None else ""
                tally.failures.append(
                    f"NEW DISAGREEMENT {case.label}: oracle {want.show()}; incumbent {theirs.show()} {detail}"
                )
        if not case.write:
            return
        ref_state = state(self.oracle)
        our_state = state(self.ours)
        if our_state != ref_state:
            what = "after an error the store changed" if want.exc is not None else "the store differs from the oracle"
            tally.failures.append(f"{case.label}: {what} (tdstore vs oracle): {diff(our_state, ref_state)}")
            # carry on from the oracle's state
            self.ours.clear_redis()
            self.ours.close()
            self.ours = TensorDictStore.from_tensordict(self.oracle, **self.server.connection_kwargs())
        their_state = state(self.theirs) if agree(theirs, want) else None
        if their_state is not None and their_state != ref_state:
            family = _state_family(their_state, ref_state, case.family)
            tally.seen_disagreements[family] += 1
            if family not in DISAGREEMENTS:
                tally.failures.append(
                    f"NEW DISAGREEMENT {case.label}: incumbent state after the case differs (incumbent vs oracle): "
                    f"{diff(their_state, ref_state)}; {_leaf_diff(their_state, ref_state)}"
                )
            if family != "nested batch size read back":  # its leaves are right: nothing to repair
                self._sync_theirs()
        elif not agree(theirs, want):
            self._sync_theirs()


# --------------------------------------------------------------------------- data
def _rand(rng: random.Random, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randint(-50, 50, shape, generator=g).to(dtype) / 4
    lo = 0 if dtype == torch.uint8 else -50
    return torch.randint(lo, 50, shape, generator=g).to(dtype)


def dense_td(rng: random.Random, batch: tuple[int, ...], *, nested: bool = False, nontensor: bool = False) -> TensorDict:
    td = TensorDict(
        {
            "obs": _rand(rng, batch + (3,), torch.float32),
            "r": _rand(rng, batch, torch.float32),
            "act": _rand(rng, batch, torch.int64),
            "m": _rand(rng, batch + (2, 2), torch.uint8),
        },
        batch_size=batch,
    )
    if nested:
        td["sub"] = TensorDict(
            {"x": _rand(rng, batch + (2,), torch.float64), "deep": TensorDict(
                {"y": _rand(rng, batch + (3, 2), torch.int32)}, batch_size=batch + (3,))},
            batch_size=batch,
        )
    if nontensor:
        td["label"] = "a"
    return td


def lazy_td(rng: random.Random, n: int) -> LazyStackedTensorDict:
    return LazyStackedTensorDict(
        *[TensorDict({"m": _rand(rng, (3, 2), torch.float32), "r": _rand(rng, (), torch.float32),
                      "k": _rand(rng, (2,), torch.int64)}) for _ in range(n)],
        stack_dim=0,
    )


def index_forms(rng: random.Random, batch: tuple[int, ...]) -> list[tuple[str, Any]]:
    """(name, index) over the batch dims: every form TensorDict accepts, and some it refuses."""
    n = batch[0]
    forms: list[tuple[str, Any]] = [
        ("int", rng.randrange(n)),
        ("negative int", -1),
        ("slice", slice(1, n)),
        ("step slice", slice(0, None, 2)),
        ("empty slice", slice(n, n)),
        ("list", sorted(rng.sample(range(n), 2))),
        ("long tensor", torch.tensor(rng.sample(range(n), 2))),
        ("mask", torch.tensor([j % 2 == 0 for j in range(n)])),
        ("ellipsis", ...),
        ("range", range(0, n, 2)),
    ]
    if len(batch) > 1:
        m = batch[1]
        forms += [
            ("int pair", (rng.randrange(n), rng.randrange(m))),
            ("int, slice", (rng.randrange(n), slice(0, m - 1))),
            ("slice, list", (slice(None), [0, m - 1])),
            ("ellipsis, int", (..., rng.randrange(m))),
            ("2-d mask", torch.rand(n, m, generator=torch.Generator().manual_seed(rng.randrange(99))) > 0.5),
        ]
    return forms


def bad_index_forms(batch: tuple[int, ...]) -> list[tuple[str, Any]]:
    n = batch[0]
    return [("int out of range", n + 3), ("list out of range", [0, n + 1]), ("too many ints", (0,) * (len(batch) + 4))]


def _like(rng: random.Random, sub: Any, dtype: torch.dtype | None = None) -> Any:
    """A new value of the same structure as ``sub`` (an indexed tensordict or tensor)."""
    if isinstance(sub, torch.Tensor):
        return _rand(rng, tuple(sub.shape), dtype or sub.dtype)
    return sub.apply(lambda t: _rand(rng, tuple(t.shape), dtype or t.dtype))


# --------------------------------------------------------------------------- case lists
def _leaf_keys(td: TensorDictBase) -> list[Any]:
    return [k for k in td.keys(True, True) if isinstance(td.get(k), torch.Tensor)]


def _show(index: Any) -> str:
    return index.tolist().__repr__() if isinstance(index, torch.Tensor) else repr(index)


def dense_cases(rng: random.Random, td: TensorDict, *, numbers: bool = True) -> list[Case]:
    """Reads and writes over every index form and leaf of a dense tensordict."""
    batch = tuple(td.batch_size)
    forms = index_forms(rng, batch)
    keys = _leaf_keys(td)
    cases: list[Case] = [
        Case("batch_size", lambda t: t.batch_size),
        Case("keys", lambda t: sorted(map(str, t.keys(True)))),
        Case("len", lambda t: len(t)),
        Case("contains", lambda t: ("obs" in t.keys(), "nope" in t.keys())),
        Case("getitem missing key", lambda t: t["nope"]),
        Case("get missing key", lambda t: t.get("nope", None)),
        Case("set_at_ missing key", lambda t: t.set_at_("nope", torch.zeros(()), 0), write=True),
        Case("set_ missing key", lambda t: t.set_("nope", torch.zeros(batch)), write=True),
    ]
    for name, idx in forms + bad_index_forms(batch):
        cases.append(Case(f"getitem index: {name} {_show(idx)}", lambda t, idx=idx: t[idx]))
    for key in keys:
        cases.append(Case(f"getitem key: {key}", lambda t, key=key: t[key]))
        cases.append(Case(f"get: {key}", lambda t, key=key: t.get(key)))
        leaf = td.get(key)
        for name, idx in forms + bad_index_forms(batch):
            cases.append(Case(f"get_at: {key} {name} {_show(idx)}", lambda t, key=key, idx=idx: t.get_at(key, idx)))
            try:
                sub = leaf[idx]
            except (IndexError, RuntimeError):
                sub = torch.zeros(())
            value = _rand(rng, tuple(sub.shape), leaf.dtype)
            cases.append(Case(f"set_at_: {key} {name} {_show(idx)}", lambda t, key=key, idx=idx, v=value: t.set_at_(key, v, idx), write=True))
            other = torch.float64 if leaf.dtype != torch.float64 else torch.int32
            value = _rand(rng, tuple(sub.shape), other)
            cases.append(Case(f"set_at_ other dtype: {key} {name} {_show(idx)}", lambda t, key=key, idx=idx, v=value: t.set_at_(key, v, idx), write=True))
            v = _like(rng, sub)
            cases.append(Case(f"update_at_: {key} {name} {_show(idx)}", lambda t, key=key, idx=idx, v=v: t.update_at_({key: v}, idx), write=True))
        feat = leaf.dim() - len(batch)
        if feat:
            for fidx in [(0,) * (len(batch) + 1), (..., 0), (..., -1), (slice(None),) * len(batch) + (1 % leaf.shape[len(batch)],),
                         (0,) * len(batch) + (slice(0, 1),), (..., [0])]:
                want = leaf[fidx]
                cases.append(Case(f"get_at feature: {key} {fidx!r}", lambda t, key=key, i=fidx: t.get_at(key, i)))
                v = _like(rng, want)
                cases.append(Case(f"set_at_ feature: {key} {fidx!r}", lambda t, key=key, i=fidx, v=v: t.set_at_(key, v, i), write=True))
                cases.append(Case(f"set_at_ feature scalar: {key} {fidx!r}", lambda t, key=key, i=fidx, dt=leaf.dtype: t.set_at_(key, torch.tensor(1, dtype=dt), i), write=True))
        v = _like(rng, leaf)
        cases.append(Case(f"set_: {key}", lambda t, key=key, v=v: t.set_(key, v), write=True))
        v = _rand(rng, batch + (7,), leaf.dtype)
        cases.append(Case(f"set_ wrong feature shape: {key}", lambda t, key=key, v=v: t.set_(key, v), write=True))
        v = _like(rng, leaf)
        cases.append(Case(f"update_: {key}", lambda t, key=key, v=v: t.update_({key: v}), write=True))
        v = _like(rng, leaf)
        cases.append(Case(f"set: {key}", lambda t, key=key, v=v: t.set(key, v), write=True))
        v = _rand(rng, (batch[0] + 1,), leaf.dtype)
        cases.append(Case(f"set wrong batch: {key}", lambda t, key=key, v=v: t.set(key, v), write=True))
    for name, idx in forms:
        sub = td[idx]
        value = _like(rng, sub.exclude(*[k for k in sub.keys(True, True) if not isinstance(sub.get(k), torch.Tensor)]))
        cases.append(Case(f"setitem index td: {name} {_show(idx)}", lambda t, idx=idx, v=value: t.__setitem__(idx, v), write=True))
        v = _like(rng, value, torch.float64)
        cases.append(Case(f"setitem index td other dtype: {name} {_show(idx)}", lambda t, idx=idx, v=v: t.__setitem__(idx, v), write=True))
        if numbers:
            # tdstore leaves non-tensor entries unchanged here, TensorDict writes the number into them
            # (docs/migrating.md): cases on stores without non-tensor entries only
            cases.append(Case(f"setitem index 0-d tensor: {name} {_show(idx)}", lambda t, idx=idx: t.__setitem__(idx, torch.tensor(2.0)), write=True))
            cases.append(Case(f"setitem index number: {name} {_show(idx)}", lambda t, idx=idx: t.__setitem__(idx, 3), write=True))
        bad = TensorDict({"r": _rand(rng, (batch[0] + 2,), torch.float32)}, batch_size=[batch[0] + 2])
        cases.append(Case(f"setitem index wrong batch: {name} {_show(idx)}", lambda t, idx=idx, v=bad: t.__setitem__(idx, v), write=True))
        sub_shape = tuple(sub.batch_size)
        new = TensorDict({"fresh": _rand(rng, sub_shape + (2,), torch.float32)}, batch_size=sub_shape)
        cases.append(Case(f"setitem index new key: {name} {_show(idx)}", lambda t, idx=idx, v=new: t.__setitem__(idx, v), write=True))
    i = rng.randrange(batch[0])
    if len(batch) == 1:
        cases.append(Case("setitem index extra size-1 dims: int", lambda t: t.__setitem__(i, TensorDict(r=torch.tensor([3.0]))), write=True))
    for j in range(3):
        v = _rand(rng, batch + (j,), torch.float32)
        cases.append(Case(f"set new key: new{j}", lambda t, j=j, v=v: t.set(f"new{j}", v), write=True))
    cases += method_cases(rng, td, numbers=numbers)
    rng.shuffle(cases)
    # structure changes last: the cases above were made for the initial keys
    cases.append(Case("pop()", lambda t: t.pop("r"), write=True))
    cases.append(Case("pop missing()", lambda t: t.pop("nope"), write=True))
    cases.append(Case("pop missing default()", lambda t: t.pop("nope", None), write=True))
    cases.append(Case("rename_key_: act", lambda t: t.rename_key_("act", "act2"), write=True))
    cases.append(Case("rename_key_ onto existing: obs", lambda t: t.rename_key_("obs", "r"), write=True))
    cases.append(Case("del_: m", lambda t: t.del_("m"), write=True))
    cases.append(Case("del_ missing", lambda t: t.del_("nope"), write=True))
    if numbers:
        cases.append(Case("zero_", lambda t: t.zero_(), write=True))
    return cases


def method_cases(rng: random.Random, td: TensorDict, *, numbers: bool) -> list[Case]:
    """The other public methods, once each per batch: reads, then in-place writes."""
    batch = tuple(td.batch_size)
    mask = torch.tensor([j % 2 == 1 for j in range(batch[0])])
    upd = _rand(rng, batch + (2,), torch.float32)
    upd_bad = _rand(rng, (batch[0] + 1,), torch.float32)
    other = td.clone().apply(lambda x: x + 1 if x.is_floating_point() else x)
    cases = [
        Case("select()", lambda t: t.select("obs", "r")),
        Case("exclude()", lambda t: t.exclude("obs")),
        Case("select missing()", lambda t: t.select("nope")),
        Case("clone to memory()", lambda t: t.to_tensordict().clone()),
        Case("numel()", lambda t: t.numel()),
        Case("ndim()", lambda t: (t.ndim, t.batch_dims, t.shape)),
        Case("is_empty()", lambda t: t.is_empty()),
        Case("get_item_shape()", lambda t: t.get_item_shape("obs")),
        Case("flatten_keys()", lambda t: t.flatten_keys()),
        Case("items()", lambda t: sorted((str(k), norm(v)) for k, v in t.items(True, True))),
        Case("values count()", lambda t: len(list(t.values(True, True)))),
        Case("apply()", lambda t: t.apply(lambda x: x * 2 if x.is_floating_point() else x)),
        Case("masked_select to memory()", lambda t: t.to_tensordict()[mask]),
        Case("get default()", lambda t: t.get("nope", torch.zeros(1))),
        Case("fill_()", lambda t: t.fill_("r", 2.5), write=True),
        Case("fill_ missing()", lambda t: t.fill_("nope", 2.5), write=True),
        Case("setdefault existing()", lambda t: t.setdefault("r", torch.zeros(batch)), write=True),
        Case("setdefault new()", lambda t: t.setdefault("sd", torch.ones(batch)), write=True),
        Case("update()", lambda t: t.update({"upd": upd, "r": torch.ones(batch)}), write=True),
        Case("update wrong batch()", lambda t: t.update({"upd2": upd_bad}), write=True),
        Case("copy_()", lambda t: t.copy_(other), write=True),
    ]
    if numbers:
        # (to_dict on non-tensor stores: a non-tensor entry with one value in every row is that value
        # in tdstore, a list of copies in TensorDict after some writes; see _flat above)
        cases += [
            Case("to_dict()", lambda t: t.to_dict()),
            Case("masked_fill_()", lambda t: t.masked_fill_(mask, 1), write=True),
            Case("add_()", lambda t: t.add_(1), write=True),
            Case("mul_()", lambda t: t.mul_(2), write=True),
            Case("apply_()", lambda t: t.apply_(lambda x: x - 1), write=True),
        ]
    return cases


def nontensor_cases(rng: random.Random, td: TensorDict) -> list[Case]:
    batch = tuple(td.batch_size)
    forms = index_forms(rng, batch)
    cases: list[Case] = [
        Case("getitem non-tensor", lambda t: t["label"]),
        Case("get non-tensor", lambda t: t.get("label")),
    ]
    for name, idx in forms:
        cases.append(Case(f"get_at non-tensor: {name} {_show(idx)}", lambda t, idx=idx: t.get_at("label", idx)))
        cases.append(Case(f"set_at_ non-tensor plain value: {name} {_show(idx)}", lambda t, idx=idx: t.set_at_("label", "z", idx), write=True))
        sub_shape = tuple(td[idx].batch_size)
        value = TensorDict({"r": _rand(rng, sub_shape, torch.float32), "label": "q"}, batch_size=sub_shape)
        cases.append(Case(f"setitem index td with non-tensor: {name} {_show(idx)}", lambda t, idx=idx, v=value: t.__setitem__(idx, v), write=True))
        if "sub" in td.keys():
            deep = TensorDict({"y": _rand(rng, sub_shape + (3, 2), torch.int32), "tag": "w"}, batch_size=sub_shape + (3,))
            value = TensorDict({"sub": TensorDict({"deep": deep}, batch_size=sub_shape)}, batch_size=sub_shape)
            cases.append(Case(f"setitem index nested non-tensor: {name} {_show(idx)}", lambda t, idx=idx, v=value: t.__setitem__(idx, v), write=True))
    rng.shuffle(cases)
    return cases


def _dense_then_update(stack: LazyStackedTensorDict, op: Callable[[TensorDict], Any]) -> None:
    """Runs ``op`` on the stack as a dense TensorDict and writes the result back into the stack."""
    dense = stack.to_tensordict()
    op(dense)
    stack.update_(dense)


def lazy_cases(rng: random.Random, stack: LazyStackedTensorDict) -> list[Case]:
    n = stack.batch_size[0]
    forms = [f for f in index_forms(rng, (n,)) if f[0] not in ("empty slice",)]
    cases: list[Case] = [
        Case("lazy batch_size", lambda t: t.batch_size),
        Case("lazy keys", lambda t: sorted(t.keys())),
        Case("lazy getitem missing key", lambda t: t["nope"]),
    ]
    for key in ("m", "r", "k"):
        leaf = stack.get(key)
        cases.append(Case(f"lazy getitem key: {key}", lambda t, key=key: t[key]))
        for name, idx in forms:
            cases.append(Case(f"lazy get_at: {key} {name} {_show(idx)}", lambda t, key=key, idx=idx: t.get_at(key, idx)))
            v = _like(rng, leaf[idx])
            cases.append(Case(f"lazy set_at_: {key} {name} {_show(idx)}", lambda t, key=key, idx=idx, v=v: t.set_at_(key, v, idx), write=True))
        for fidx in [(..., 0), (..., -1), (0, ..., 1), (slice(None), 0)] if leaf.dim() > 1 else [(..., 0)]:
            cases.append(Case(f"lazy get_at feature: {key} {fidx!r}", lambda t, key=key, i=fidx: t.get_at(key, i)))
            v = _like(rng, leaf[fidx])
            cases.append(Case(
                f"lazy set_at_ feature: {key} {fidx!r}", lambda t, key=key, i=fidx, v=v: t.set_at_(key, v, i), write=True,
                expect=lambda t, key=key, i=fidx, v=v: _dense_then_update(t, lambda d: d.set_at_(key, v, i)),
            ))
    for name, idx in forms:
        cases.append(Case(f"lazy getitem index: {name} {_show(idx)}", lambda t, idx=idx: t[idx]))
        sub = stack[idx]
        v = _like(rng, sub)
        cases.append(Case(f"lazy setitem index td: {name} {_show(idx)}", lambda t, idx=idx, v=v: t.__setitem__(idx, v), write=True))
    j = rng.randrange(n)
    extra = TensorDict(r=torch.tensor([3.0]), m=torch.ones(1, 3, 2), k=torch.ones(2, dtype=torch.int64))
    cases.append(Case(
        "lazy setitem element extra size-1 dims", lambda t: t.__setitem__(j, extra), write=True,
        expect=lambda t: _dense_then_update(t, lambda d: d.__setitem__(j, extra)),
    ))
    cases.append(Case("lazy setitem element does not fit", lambda t: t.__setitem__(j, TensorDict(m=torch.ones(3, 5))), write=True))
    rng.shuffle(cases)
    return cases


# --------------------------------------------------------------------------- the run
def batches(rng: random.Random) -> list[tuple[str, Callable[[], TensorDictBase], Callable[[TensorDictBase], list[Case]], dict[str, Any]]]:
    """(kind, make the oracle, make its cases, store options): one store per batch."""
    def dense(batch: tuple[int, ...], **kw: Any) -> Callable[[], TensorDictBase]:
        return lambda: dense_td(rng, batch, **kw)

    out: list[Any] = []
    for batch in [(5,), (4, 3)]:
        out.append(("dense", dense(batch), lambda td: dense_cases(rng, td), {}))
        out.append(("nested", dense(batch, nested=True), lambda td: dense_cases(rng, td), {}))
        out.append(("chunked", dense(batch), lambda td: dense_cases(rng, td), {"chunk_bytes": 16}))
        out.append(("non-tensor", dense(batch, nontensor=True), lambda td: nontensor_cases(rng, td) + dense_cases(rng, td, numbers=False), {}))
        out.append(("nested non-tensor", lambda batch=batch: _nested_nt(rng, batch), lambda td: nontensor_cases(rng, td), {}))
    out.append(("lazy", lambda: lazy_td(rng, 3), lambda td: lazy_cases(rng, td), {}))
    out.append(("lazy", lambda: lazy_td(rng, 4), lambda td: lazy_cases(rng, td), {}))
    return out


def _nested_nt(rng: random.Random, batch: tuple[int, ...]) -> TensorDict:
    td = dense_td(rng, batch, nested=True, nontensor=True)
    td["sub", "deep", "tag"] = "t"
    return td


def test_reference_harness(server, request) -> None:
    """>= 3,000 seeded cases on this server: tdstore agrees with the oracle, the incumbent's
    disagreements are all in DISAGREEMENTS."""
    rng = random.Random(SEED)
    tally = Tally()
    start = time.perf_counter()
    rounds = 0
    while tally.cases < MIN_CASES:
        for _kind, make, cases_of, options in batches(rng):
            oracle = make()
            trio = Trio(server, oracle, tally, **options)
            try:
                for case in cases_of(oracle):
                    if rng.random() >= KEEP:
                        continue
                    trio.run(case)
            finally:
                trio.close()
        rounds += 1
    elapsed = time.perf_counter() - start
    print(f"\nharness cases on {request.node.callspec.id}: {tally.cases} in {elapsed:.1f} s ({rounds} rounds); "
          f"incumbent disagreements by family: {dict(tally.seen_disagreements)}")
    dump = os.environ.get("TDSTORE_HARNESS_DUMP")
    if dump:  # every failure, for debugging
        Path(dump).write_text("\n=====\n".join(tally.failures))
    shown: Counter = Counter()
    lines = []
    for line in tally.failures:  # the first three of each family
        fam = line.split(":", 1)[0]
        shown[fam] += 1
        if shown[fam] <= 3:
            lines.append(line)
    assert not tally.failures, f"{len(tally.failures)} failures:\n" + "\n".join(lines)
