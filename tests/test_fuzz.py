"""Hypothesis fuzz of index expressions and values, differential against an in-memory TensorDict.

Every example reads ``store[idx]`` or writes ``store[idx] = value`` and does the same on a
TensorDict mirror: both succeed with the same result (batch size, keys, dtypes, values, NaN
included), or both raise the same public exception type. On an error the server's keyspace
must be byte-for-byte unchanged. Indices mix valid and invalid components (out of range,
floats, wrong-length masks, zero or negative steps, too many dimensions); values mix exact
shapes, broadcastable ones, wrong shapes, other dtypes, NaN/inf and non-contiguous layouts.

Bounded for CI: ``max_examples`` per backend, ``derandomize=True`` (the same examples every
run), ``deadline=None``.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore.testing.counts import add_cases, record

BATCH = (5, 3)
#: per backend; TDSTORE_FUZZ_EXAMPLES=2000 for a deeper run outside CI
EXAMPLES = int(os.environ.get("TDSTORE_FUZZ_EXAMPLES", "100"))


def _public_type(exc: BaseException) -> type[BaseException]:
    for cls in type(exc).__mro__:
        if not cls.__name__.startswith("_"):
            return cls
    return type(exc)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if not a.numel():
            return True
        if a.dtype.is_floating_point:
            return bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())
        return torch.equal(a, b)
    ka = sorted(map(str, a.keys(True, True)))
    if ka != sorted(map(str, b.keys(True, True))) or tuple(a.batch_size) != tuple(b.batch_size):
        return False
    return all(_same(a.get(k), b.get(k)) for k in a.keys(True, True))


def _component(draw: Any, size: int, *, write: bool) -> Any:
    # mostly valid components, so that most examples get past validation and compare data
    kind = draw(st.sampled_from(["int", "slice", "list", "tensor", "mask"] * 3 + ["none", "float", "bad mask", "out"]))
    if kind == "int":
        return draw(st.integers(-size, size - 1))
    if kind == "out":
        return draw(st.sampled_from([size, size + 3, -size - 1]))
    if kind == "slice":
        start = draw(st.none() | st.integers(-size - 2, size + 2))
        stop = draw(st.none() | st.integers(-size - 2, size + 2))
        step = draw(st.none() | st.integers(-1, 3))
        return slice(start, stop, step)
    if kind in ("list", "tensor"):
        values = st.integers(-size, size - 1) if draw(st.integers(0, 9)) else st.integers(-size - 1, size)
        rows = draw(st.lists(values, min_size=0, max_size=size, unique=write))
        return rows if kind == "list" else torch.tensor(rows, dtype=torch.long)
    if kind == "mask":
        return torch.tensor(draw(st.lists(st.booleans(), min_size=size, max_size=size)))
    if kind == "bad mask":
        return torch.tensor(draw(st.lists(st.booleans(), min_size=1, max_size=size + 2)))
    if kind == "float":
        return draw(st.floats(-3, 3, allow_nan=False))
    return None


@st.composite
def indices(draw: Any, write: bool) -> Any:
    parts = []
    advanced = 0
    for dim in range(draw(st.sampled_from([1, 1, 2, 2, 2, 3]))):
        size = BATCH[dim] if dim < len(BATCH) else 1
        part = _component(draw, size, write=write)
        if isinstance(part, (list, torch.Tensor)):
            advanced += 1
            if write and advanced > 1:  # two advanced indices can select a row twice: torch leaves that unspecified
                part = slice(None)
        parts.append(part)
    if draw(st.booleans()) and len(parts) < 3:
        parts.insert(draw(st.integers(0, len(parts))), Ellipsis)
    return parts[0] if len(parts) == 1 and draw(st.booleans()) else tuple(parts)


VALUE_KINDS = ["exact", "broadcast row", "wrong shape", "other dtype", "nan inf", "non-contiguous", "scalar td"]


def _value(kind: str, sub: TensorDict, k: int) -> Any:
    bumped = sub.apply(lambda x: x + k)
    if kind == "exact":
        return bumped
    if kind == "broadcast row":
        return bumped[(0,) * sub.batch_dims] if sub.batch_dims and sub.batch_size.numel() else bumped
    if kind == "wrong shape":
        shape = [d + 1 for d in sub.batch_size] or [2]
        return TensorDict(a=torch.zeros(shape), batch_size=shape)
    if kind == "other dtype":
        return bumped.apply(lambda x: x.double() + 0.25)
    if kind == "nan inf":
        return bumped.apply(lambda x: torch.where(x > 2, math.nan, -math.inf) if x.dtype.is_floating_point else x)
    if kind == "non-contiguous":
        return bumped.apply(lambda x: x.mT.contiguous().mT if x.ndim >= 2 else x)
    return TensorDict(a=torch.tensor(float(k)), batch_size=[])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("server", ["fakeredis", "redis"], indirect=True)
def test_fuzz_index_expressions_and_values(server, wire, request):
    if server.kind not in str(request.config.getoption("--backends")).split(","):
        pytest.skip(f"{server.kind} backend excluded by --backends")
    gen = torch.Generator().manual_seed(0)
    mirror = TensorDict(
        a=torch.randn(*BATCH, generator=gen),
        b=torch.randint(-50, 50, (*BATCH, 2), generator=gen),
        batch_size=list(BATCH),
    )
    mirror["n", "c"] = torch.randn(*BATCH, generator=gen).double()
    store = TensorDictStore.from_tensordict(mirror, **server.connection_kwargs())
    counts = {"reads_equal": 0, "writes_equal": 0, "same_error": 0, "unchanged_wire": 0}
    state = {"dirty": False}

    @settings(
        max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
    )  # fmt: skip
    @given(data=st.data())
    def example(data: Any) -> None:
        nonlocal mirror
        if state["dirty"]:  # a failed example (hypothesis shrinking) may have left them apart
            store.update(mirror)
        state["dirty"] = True
        write = data.draw(st.booleans(), label="write")
        idx = data.draw(indices(write), label="index")
        before = wire(server)
        expected: Any = None
        value: Any = None
        mirror_error: BaseException | None = None
        trial = mirror.clone()
        try:
            expected = trial[idx]
        except Exception as exc:  # noqa: BLE001 - the mirror's error is the expectation
            mirror_error = exc
        if write and mirror_error is None:
            kind = data.draw(st.sampled_from(VALUE_KINDS), label="value")
            value = _value(kind, expected, data.draw(st.integers(1, 9), label="k"))
            # other dtypes follow torch's rules in the store as in TensorDict: cast for int, slice
            # and `...`, refused for list, tensor and mask indices (issue 15, section 5)
            try:
                trial[idx] = value
            except Exception as exc:  # noqa: BLE001
                mirror_error = exc
        try:
            if write:
                if value is None:
                    value = mirror[0]  # the index itself is invalid: any value
                store[idx] = value
                got = None
            else:
                got = store[idx]
        except Exception as exc:  # noqa: BLE001 - compared below
            assert mirror_error is not None, f"store raised {type(exc).__name__}: {exc}; TensorDict succeeded"
            assert isinstance(exc, _public_type(mirror_error)), (
                f"store raised {type(exc).__name__}: {exc}; TensorDict raised {type(mirror_error).__name__}: {mirror_error}"
            )
            assert str(exc).strip()
            assert wire(server) == before, "a refused call changed the server"
            counts["same_error"] += 1
            counts["unchanged_wire"] += 1
            state["dirty"] = False
            return
        assert mirror_error is None, f"store succeeded; TensorDict raised {type(mirror_error).__name__}: {mirror_error}"
        if write:
            mirror = trial
            assert _same(store.to_tensordict(), mirror), f"store[{idx!r}] = ... differs from TensorDict"
            counts["writes_equal"] += 1
        else:
            assert _same(got, expected), f"store[{idx!r}] differs from TensorDict"
            counts["reads_equal"] += 1
        state["dirty"] = False

    example()
    record(request, examples=sum(counts.values()) - counts["unchanged_wire"], **counts)
    add_cases(request, f"fuzz [{request.node.callspec.id}]", **{k: v for k, v in counts.items() if k != "unchanged_wire"})
    assert counts["same_error"] and counts["writes_equal"] and counts["reads_equal"]
    store.clear_redis()
    store.close()
