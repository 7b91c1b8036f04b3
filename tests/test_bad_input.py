"""Bad input matrix: every public method with wrong types, shapes, dtypes, devices, indices,
keys, values, batch sizes, td_ids, closed stores and decode_responses clients.

Each case ends in one of two ways, decided by a table:

- **a clear error**: the expected exception type (for keys and indices: the type an
  in-memory ``TensorDict`` raises for the same call), a message naming what was wrong, and a
  keyspace that is byte-for-byte unchanged (``wire`` snapshots before and after);
- **documented behaviour**: the value round-trips (NaN stays NaN, non-contiguous and
  strided values are accepted, keys with ``.``, ``:`` or braces are escaped...), checked
  against an in-memory ``TensorDict`` mirror that receives the same calls.

At the end the whole store must equal the mirror. Counts are printed in the "case counts"
section of the pytest summary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import redis
import redis.asyncio
import torch
from tensordict import NonTensorData, TensorDict

import tdstore
from tdstore import TensorDictStore
from tdstore.testing.counts import add_cases, record

N = 4
_MISSING = object()


@dataclass
class Case:
    """One row of the matrix.

    ``store`` runs the call on the store. ``mirror`` runs the same call on an in-memory
    TensorDict: when given, the store must do what the mirror does (same exception type,
    or success with the same resulting data). ``raises`` (with ``match``) is the expected
    error when there is no mirror to ask; ``check`` inspects a documented success.
    """

    name: str
    store: Callable[[Any], Any]
    mirror: Callable[[TensorDict], Any] | None = None
    raises: type[BaseException] | tuple[type[BaseException], ...] | None = None
    match: str | None = None
    names_store: bool = False
    check: Callable[[Any, Any], None] | None = None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype.is_floating_point or a.dtype.is_complex:
            if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                a, b = a.float(), b.float()
            return bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all()) if a.numel() else True
        return torch.equal(a, b)
    if hasattr(a, "keys") and hasattr(b, "keys"):
        ka = sorted(map(str, a.keys(True, True)))
        kb = sorted(map(str, b.keys(True, True)))
        if ka != kb or tuple(a.batch_size) != tuple(b.batch_size):
            return False
        return all(_same(a.get(k), b.get(k)) for k in a.keys(True, True))
    if isinstance(a, NonTensorData):
        a = a.data
    if isinstance(b, NonTensorData):
        b = b.data
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare are different
        return a is b


def _filled(conn: dict[str, Any]) -> tuple[TensorDictStore, TensorDict]:
    store = TensorDictStore(batch_size=[N], **conn)
    mirror = TensorDict(batch_size=[N])
    for target in (store, mirror):
        target["a"] = torch.arange(float(N))
        target["i"] = torch.arange(N, dtype=torch.int32)
        target["n", "b"] = torch.zeros(N, 2, dtype=torch.int64)
        target["s"] = "text"
    return store, mirror


def _lambda_value() -> Any:
    return lambda: 1


KEYS: list[Any] = [
    "", "a.b", "a:b", "{a}", "}x{", "%2E", "sp ace", "é", "x" * 5000, ("n", "c.d"), ("",),
    3, 3.5, ("a", 3), (), None, b"bytes", ("a", "x"), ("n",), object(),
]  # fmt: skip

VALUES: dict[str, Callable[[], Any]] = {
    "nan": lambda: torch.tensor([math.nan, 1.0, math.nan, -math.nan]),
    "inf": lambda: torch.tensor([math.inf, -math.inf, 0.0, -0.0]),
    "huge float64": lambda: torch.full((N,), 1e308, dtype=torch.float64),
    "int64 extremes": lambda: torch.tensor([2**63 - 1, -(2**63), 0, 1]),
    "uint8 255": lambda: torch.full((N, 3), 255, dtype=torch.uint8),
    "bool": lambda: torch.tensor([True, False, True, False]),
    "complex": lambda: torch.complex(torch.arange(8.0), -torch.arange(8.0)).reshape(N, 2),
    "bfloat16": lambda: torch.tensor([0.1, -2.5, 3e38, 1e-3]).to(torch.bfloat16),
    "float8": lambda: torch.tensor([0.1, -2.5, 448.0, 1e-3]).to(torch.float8_e4m3fn),
    "transposed": lambda: torch.arange(12.0).reshape(3, N).t(),
    "strided slice": lambda: torch.arange(40.0).reshape(N, 10)[:, ::3],
    "expanded (stride 0)": lambda: torch.ones(1, 5).expand(N, 5),
    "storage offset": lambda: torch.arange(23.0)[3:].reshape(N, 5),
    "requires_grad": lambda: torch.ones(N, 2, requires_grad=True),
    "zero-size": lambda: torch.ones(N, 0),
    "numpy": lambda: np.arange(N, dtype=np.float32),
    "python list": lambda: [1, 2, 3, 4],
    "ragged list": lambda: [[1], [1, 2], [], [3]],
    "string": lambda: "some text with ünïcode",
    "None": lambda: None,
    "bytes": lambda: b"\x00\xff\x00",
    "set": lambda: {1, 2},
    "dict": lambda: {"x": torch.ones(N), "y": {"z": torch.zeros(N, 2)}},
    "TensorDict": lambda: TensorDict(x=torch.ones(N, 3), batch_size=[N]),
    "scalar float": lambda: 3.5,
    "wrong batch": lambda: torch.zeros(N + 1),
    "TensorDict wrong batch": lambda: TensorDict(x=torch.ones(N + 1), batch_size=[N + 1]),
}

#: values a store refuses though an in-memory TensorDict takes them: (exception, message)
REFUSED_VALUES: dict[str, tuple[Callable[[], Any], type[BaseException], str]] = {
    "sparse": (lambda: torch.zeros(N).to_sparse(), TypeError, r"to_dense"),
    "sparse csr": (lambda: torch.zeros(N, 2).to_sparse_csr(), TypeError, r"to_dense"),
    "nested tensor": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3), torch.ones(1), torch.ones(2)]), (TypeError, RuntimeError), r"nested|batch"),
    "meta device": (lambda: torch.ones(N, device="meta"), TypeError, r"meta"),
    "quantized": (lambda: torch.quantize_per_tensor(torch.zeros(N), 0.1, 0, torch.quint8), TypeError, r"cannot be stored"),
    "unpicklable": (_lambda_value, TypeError, r"pickle"),
}

INDICES: list[Any] = [
    0, -1, 3, 10, -5, 1.5, slice(1, 3), slice(None, None, 2), slice(None, None, -1), slice(5, 9), (0, 0), (0, 0, 0),
    [0, 2], [[0, 1]], [], [True, False, True, False], [True, False], torch.tensor([True, False]), torch.zeros(N, dtype=torch.bool),
    torch.tensor([0.5]), torch.tensor([5]), torch.tensor([1, 3], dtype=torch.int32), torch.tensor(2), torch.tensor([], dtype=torch.long),
    torch.tensor([[0, 1], [2, 3]]), np.int64(1), np.array([0, 3]), None, (None, 0), (None, slice(0, 2)), ..., (..., 0), range(1, 3),
]  # fmt: skip


def _key_cases() -> list[Case]:
    cases = []
    for key in KEYS:
        label = repr(key)[:24]
        cases.append(Case(f"set key {label}", lambda s, k=key: s.__setitem__(k, torch.full((N,), 7.0)),
                          lambda t, k=key: t.__setitem__(k, torch.full((N,), 7.0))))
        cases.append(Case(f"get key {label}", lambda s, k=key: s[k], lambda t, k=key: t[k]))
        cases.append(Case(f"get default {label}", lambda s, k=key: s.get(k, "dflt"), lambda t, k=key: t.get(k, "dflt")))
        cases.append(Case(f"del_ key {label}", lambda s, k=key: s.del_(k), lambda t, k=key: t.del_(k)))
        cases.append(Case(f"rename to {label}", lambda s, k=key: s.rename_key_("i", k), lambda t, k=key: t.rename_key_("i", k)))
        cases.append(Case(f"set_ key {label}", lambda s, k=key: s.set_(k, torch.zeros(N)), lambda t, k=key: t.set_(k, torch.zeros(N))))
    return cases  # fmt: skip


def _value_cases() -> list[Case]:
    cases = []
    for name, make in VALUES.items():
        cases.append(Case(f"set value {name}", lambda s, m=make: s.__setitem__(("v", "w"), m()),
                          lambda t, m=make: t.__setitem__(("v", "w"), m())))
    for name, (make, exc, match) in REFUSED_VALUES.items():
        cases.append(Case(f"refuse value {name}", lambda s, m=make: s.__setitem__("r", m()), raises=exc, match=match))
        cases.append(Case(f"refuse in update {name}", lambda s, m=make: s.update({"a": torch.zeros(N), "r": m()}), raises=exc, match=match))
    # wrong dtype / shape for existing entries
    cases += [
        Case("set_ wrong shape", lambda s: s.set_("a", torch.zeros(N, 2)), lambda t: t.set_("a", torch.zeros(N, 2))),
        Case("set_ other dtype is cast", lambda s: s.set_("i", torch.full((N,), 2.7)), lambda t: t.set_("i", torch.full((N,), 2.7))),
        Case("update_ missing key", lambda s: s.update_({"a": torch.ones(N), "zz": torch.ones(N)}), raises=KeyError, match="zz"),
        Case("update non-mapping", lambda s: s.update(42), raises=TypeError, match="takes a dict or a TensorDict", names_store=True),
        Case("set_at_ wrong shape", lambda s: s.set_at_("a", torch.zeros(3), 1), lambda t: t.set_at_("a", torch.zeros(3), 1)),
        Case("set_at_ missing key", lambda s: s.set_at_("zz", torch.zeros(()), 1), lambda t: t.set_at_("zz", torch.zeros(()), 1)),
        Case("get_at out of range", lambda s: s.get_at("a", 9), lambda t: t.get_at("a", 9)),
        Case("fill_ nan", lambda s: s.fill_("a", math.nan), lambda t: t.fill_("a", math.nan)),
        Case("fill_ missing", lambda s: s.fill_("zz", 1.0), lambda t: t.fill_("zz", 1.0)),
        Case("apply_ broadcasts", lambda s: s.apply_(lambda x: x.sum(-1, keepdim=True) if x.ndim > 1 else x),
             lambda t: t.apply_(lambda x: x.sum(-1, keepdim=True) if x.ndim > 1 else x)),
        Case("apply_ raises", lambda s: s.apply_(lambda x: x.bad_attribute), raises=AttributeError, match="bad_attribute"),
        Case("batch_size too big", lambda s: setattr(s, "batch_size", [N + 1]), lambda t: setattr(t, "batch_size", [N + 1])),
        Case("batch_size not ints", lambda s: setattr(s, "batch_size", ["x"]), lambda t: setattr(t, "batch_size", ["x"])),
        Case("extend wrong keys", lambda s: s.extend(TensorDict(zz=torch.ones(2), batch_size=[2])), raises=tdstore.SchemaError,
             match="missing", names_store=True),
        Case("extend too many rows", lambda s: s.extend(TensorDict(a=torch.ones(N + 1), batch_size=[N + 1])),
             raises=tdstore.SchemaError, match="1 to 4 rows", names_store=True),
        Case("sample bad n", lambda s: s.sample(-1), raises=(ValueError, RuntimeError)),
        Case("view", lambda s: s.view(2, 2), raises=tdstore.UnsupportedOperationError, match="to_tensordict"),
        Case("unbind", lambda s: s.unbind(0), raises=tdstore.UnsupportedOperationError, match="to_tensordict"),
    ]  # fmt: skip
    return cases


def _index_cases() -> list[Case]:
    cases = []
    for idx in INDICES:
        label = repr(idx).replace("\n", "")[:28]

        probe = TensorDict(a=torch.arange(10.0, 10.0 + N), i=torch.arange(N, dtype=torch.int32) + 5, batch_size=[N])
        probe["n", "b"] = torch.arange(2 * N).reshape(N, 2) + 7
        cases.append(Case(f"read idx {label}", lambda s, i=idx: s[i].exclude("s"), lambda t, i=idx: t[i].exclude("s")))
        try:
            value = probe[idx]
        except Exception as exc:  # noqa: BLE001 - an invalid index: the store must refuse it the same way
            cases.append(Case(f"write idx {label}", lambda s, i=idx, p=probe: s.__setitem__(i, p[0]), raises=_public_type(exc)))
        else:
            cases.append(Case(f"write idx {label}", lambda s, i=idx, v=value: s.__setitem__(i, v),
                              lambda t, i=idx, v=value: t.__setitem__(i, v)))  # fmt: skip
        cases.append(Case(f"get_at idx {label}", lambda s, i=idx: s.get_at("a", i), lambda t, i=idx: t.get_at("a", i)))
    # values of the wrong shape or dtype at a valid index
    cases += [
        Case("idx value wrong batch", lambda s: s.__setitem__(slice(0, 2), TensorDict(a=torch.zeros(3), batch_size=[3])),
             lambda t: t.__setitem__(slice(0, 2), TensorDict(a=torch.zeros(3), batch_size=[3]))),
        Case("idx value wrong feature", lambda s: s.__setitem__(slice(0, 2), TensorDict(n=TensorDict(b=torch.zeros(2, 5), batch_size=[2]), batch_size=[2])),
             lambda t: t.__setitem__(slice(0, 2), TensorDict(n=TensorDict(b=torch.zeros(2, 5), batch_size=[2]), batch_size=[2]))),
        Case("idx value float into int", lambda s: s.__setitem__(1, TensorDict(i=torch.tensor(9.9), batch_size=[])),
             lambda t: t.__setitem__(1, TensorDict(i=torch.tensor(9.9), batch_size=[]))),
        Case("idx value nan", lambda s: s.__setitem__([0, 3], TensorDict(a=torch.tensor([math.nan, math.inf]), batch_size=[2])),
             lambda t: t.__setitem__([0, 3], TensorDict(a=torch.tensor([math.nan, math.inf]), batch_size=[2]))),
        Case("idx value non-contiguous", lambda s: s.__setitem__(slice(0, 2), TensorDict(n=TensorDict(b=torch.arange(4).reshape(2, 2).t(), batch_size=[2]), batch_size=[2])),
             lambda t: t.__setitem__(slice(0, 2), TensorDict(n=TensorDict(b=torch.arange(4).reshape(2, 2).t(), batch_size=[2]), batch_size=[2]))),
        Case("idx value sparse", lambda s: s.__setitem__(slice(0, 2), TensorDict(a=torch.ones(2).to_sparse(), batch_size=[2])),
             raises=(TypeError, RuntimeError), match="dense|sparse|layout"),
        Case("idx value meta device", lambda s: s.__setitem__(slice(0, 2), TensorDict(a=torch.ones(2, device="meta"), batch_size=[2])),
             raises=TypeError, match="meta"),
        Case("idx value not a tensordict", lambda s: s.__setitem__(0, 42), lambda t: t.__setitem__(0, 42)),
    ]  # fmt: skip
    return cases


def _store_level_cases(conn: dict[str, Any]) -> list[Case]:
    def make(**kw: Any) -> Callable[[Any], Any]:
        return lambda s: TensorDictStore(**{**conn, **kw})

    def schema(spec: Any, **kw: Any) -> Callable[[Any], Any]:
        return lambda s: TensorDictStore.from_schema(spec, **{**conn, "batch_size": [2], **kw})

    decode_async = redis.asyncio.Redis(decode_responses=True)
    return [
        Case("batch_size negative", make(batch_size=[-1]), raises=(ValueError, RuntimeError)),
        Case("batch_size float", make(batch_size=[2.5]), raises=(TypeError, ValueError)),
        Case("batch_size str", make(batch_size="ab"), raises=(TypeError, ValueError)),
        Case("names mismatch", make(batch_size=[2], names=["x", "y"]), raises=ValueError, match="names"),
        Case("td_id malformed", make(td_id="bad id"), raises=ValueError, match="td_id"),
        Case("td_id empty", make(td_id=""), raises=ValueError, match="td_id"),
        Case("td_id braces", make(td_id="a{b}"), raises=ValueError, match="td_id"),
        Case("td_id too long", make(td_id="x" * 201), raises=ValueError, match="td_id"),
        Case("td_id not str", make(td_id=5), raises=(TypeError, ValueError), match="td_id"),
        Case("prefix braces", make(prefix="p{x}"), raises=ValueError, match="prefix"),
        Case("from_store unknown td_id", lambda s: TensorDictStore.from_store(td_id="no-such-store", **conn),
             raises=tdstore.StoreNotFoundError, match="no-such-store"),
        Case("from_store malformed td_id", lambda s: TensorDictStore.from_store(td_id="bad id", **conn), raises=ValueError, match="td_id"),
        Case("existing td_id other batch", lambda s: TensorDictStore(td_id=s.td_id, batch_size=[N + 1], **conn),
             raises=tdstore.SchemaError, match="batch_size", names_store=True),
        Case("from_schema negative dim", schema({"x": ([-1], torch.float32)}), raises=tdstore.SchemaError, match="x"),
        Case("from_schema dtype str", schema({"x": ([2], "float32")}), raises=tdstore.SchemaError, match="dtype"),
        Case("from_schema shape int", schema({"x": (2, torch.float32)}), raises=tdstore.SchemaError, match="shape"),
        Case("from_schema spec short", schema({"x": ([2],)}), raises=tdstore.SchemaError, match="x"),
        Case("from_schema not mapping", schema([("x", ([2], torch.float32))]), raises=tdstore.SchemaError, match="mapping"),
        Case("from_schema quantized", schema({"x": ([2], torch.quint8)}), raises=tdstore.SchemaError, match="x"),
        Case("from_schema parent and leaf", schema({"x": ([2], torch.float32), ("x", "y"): ([2], torch.float32)}),
             raises=tdstore.SchemaError, match="parent"),
        Case("from_schema batch negative", schema({"x": ([2], torch.float32)}, batch_size=[-2]), raises=(ValueError, tdstore.SchemaError)),
        Case("from_tensordict not a td", lambda s: TensorDictStore.from_tensordict(42, **conn), raises=TypeError),
        Case("from_tensordict sparse", lambda s: TensorDictStore.from_tensordict(TensorDict(x=torch.zeros(2).to_sparse(), batch_size=[2]), **conn),
             raises=TypeError, match="to_dense"),
        Case("from_dict bad batch", lambda s: TensorDictStore.from_dict({"x": torch.zeros(3)}, batch_size=[2], **conn), raises=RuntimeError),
        Case("device invalid", make(device="not-a-device"), raises=RuntimeError, match="not-a-device"),
        Case("device unavailable read", lambda s: _unavailable_device_read(conn), raises=RuntimeError, match="from_store"),
        Case("decode_responses kwarg", make(decode_responses=True), raises=tdstore.ClientConfigError, match="decode_responses"),
        Case("decode_responses client", make(client=decode_async), raises=tdstore.ClientConfigError, match="decode_responses"),
        Case("sync client", make(client=redis.Redis()), raises=tdstore.ClientConfigError, match="redis.asyncio"),
        Case("retry wrong type", make(retry="often"), raises=TypeError, match="retry"),
        Case("timeout negative", make(timeout=-1), raises=ValueError, match="timeout"),
    ]  # fmt: skip


def _unavailable_device_read(conn: dict[str, Any]) -> Any:
    """A store whose device this process lacks (cuda without CUDA, or an absent GPU index) can be
    created (for other processes) but not read here: a clear RuntimeError, nothing written."""
    device = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU: never available
    other = TensorDictStore.from_store(td_id=_unavailable_device_read.td_id, device=device, **conn)
    try:
        return other["a"]
    finally:
        other.close()


CLOSED_CALLS: dict[str, Callable[[Any], Any]] = {
    "get": lambda s: s["a"],
    "set": lambda s: s.__setitem__("a", torch.zeros(N)),
    "read idx": lambda s: s[0],
    "write idx": lambda s: s.__setitem__(0, TensorDict(a=torch.tensor(1.0), batch_size=[])),
    "update": lambda s: s.update({"a": torch.zeros(N)}),
    "del_": lambda s: s.del_("a"),
    "rename": lambda s: s.rename_key_("a", "b"),
    "keys": lambda s: list(s.keys()),
    "to_tensordict": lambda s: s.to_tensordict(),
    "clear_redis": lambda s: s.clear_redis(),
    "lock_": lambda s: s.lock_(),
    "apply_": lambda s: s.apply_(lambda x: x),
    "extend": lambda s: s.extend(TensorDict(a=torch.ones(1), batch_size=[1])),
    "nested": lambda s: s["n"]["b"],
}


deviations: list[str] = []


def _run_case(case: Case, store: Any, mirror: TensorDict, server: Any, wire: Any, td_id: str) -> tuple[str, str | None]:
    """Runs one case; returns (outcome, failure message or None)."""
    before = wire(server)
    mirror_try = mirror.clone()
    expected_exc: BaseException | None = None
    expected_result: Any = _MISSING
    if case.mirror is not None:
        try:
            expected_result = case.mirror(mirror_try)
        except Exception as exc:  # noqa: BLE001 - the mirror's error is the expectation
            expected_exc = exc
    try:
        result = case.store(store)
    except Exception as exc:  # noqa: BLE001 - compared with the expectation below
        if isinstance(exc, tdstore.StoreClosedError) and "closed" not in case.name:
            return "error", f"{case.name}: the store was closed"
        wanted = _public_type(expected_exc) if expected_exc is not None else case.raises
        if case.name in DEVIATIONS:
            wanted = DEVIATIONS[case.name][0]
            deviations.append(case.name)
        if wanted is None:
            return "error", f"{case.name}: raised {type(exc).__name__}: {exc} but the mirror succeeded"
        if not isinstance(exc, wanted):
            return "error", f"{case.name}: raised {type(exc).__name__}: {exc}; expected {wanted}"
        if case.match is not None and not __import__("re").search(case.match, str(exc)):
            return "error", f"{case.name}: message {str(exc)[:200]!r} does not match {case.match!r}"
        if case.names_store and td_id not in str(exc):
            return "error", f"{case.name}: message {str(exc)[:200]!r} does not name the store"
        if not str(exc).strip():
            return "error", f"{case.name}: {type(exc).__name__} with an empty message"
        if wire(server) != before:
            return "error", f"{case.name}: raised {type(exc).__name__} but changed the server's keys"
        return "clear_error", None
    if expected_exc is not None or (case.mirror is None and case.raises is not None):
        want = type(expected_exc).__name__ if expected_exc is not None else case.raises
        return "error", f"{case.name}: succeeded, expected {want} ({expected_exc})"
    if isinstance(result, TensorDictStore) and result is not store and case.mirror is None:
        result.close()
    if expected_result is not _MISSING and expected_result is not mirror_try:
        got = result.to_tensordict() if isinstance(result, TensorDictStore) else result
        if not (got is store or _same(got, expected_result)):
            return "error", f"{case.name}: returned {got!r:.200} instead of {expected_result!r:.200}"
    for key in list(mirror.keys()):
        mirror.del_(key)
    for key, value in mirror_try.items():
        mirror.set(key, value)
    if case.check is not None:
        case.check(store, mirror)
    return "documented", None


#: Cases where the store deliberately raises another type than an in-memory TensorDict, and why.
DEVIATIONS: dict[str, tuple[type[BaseException], str]] = {
    "del_ key ('a', 'x')": (KeyError, "a path through a leaf is a missing key: EntryNotFoundError names the store"),
    "set_ wrong shape": (RuntimeError, "tensordict's _InplaceWriteError is a RuntimeError too; the store names entry and store"),
}


def _public_type(exc: BaseException) -> type[BaseException]:
    """The first public class of an exception (tensordict raises private subclasses of RuntimeError...)."""
    for cls in type(exc).__mro__:
        if not cls.__name__.startswith("_"):
            return cls
    return type(exc)


def _closed_calls(server: Any, wire: Any, conn: dict[str, Any], failures: list[str]) -> int:
    """Every method of a closed store raises StoreClosedError naming the store; returns the count."""
    store = TensorDictStore(batch_size=[N], **conn)
    store["a"] = torch.zeros(N)
    store["n", "b"] = torch.zeros(N)
    td_id = store.td_id
    store.close()
    before = wire(server)
    ok = 0
    for name, call in CLOSED_CALLS.items():
        try:
            call(store)
        except tdstore.StoreClosedError as exc:
            if td_id not in str(exc) or "from_store" not in str(exc):
                failures.append(f"closed {name}: unclear message {exc}")
            else:
                ok += 1
        except Exception as exc:  # noqa: BLE001
            failures.append(f"closed {name}: raised {type(exc).__name__}: {exc}")
        else:
            failures.append(f"closed {name}: succeeded on a closed store")
    if wire(server) != before:
        failures.append("a call on a closed store changed the server")
    return ok


@pytest.mark.timeout(300)
@pytest.mark.parametrize("server", ["fakeredis", "redis", "valkey"], indirect=True)  # redis6: as redis here
def test_bad_input_matrix(server, wire, request):
    if server.kind not in str(request.config.getoption("--backends")).split(","):
        pytest.skip(f"{server.kind} backend excluded by --backends")
    conn = server.connection_kwargs()
    groups = {
        "keys": _key_cases(), "values": _value_cases(), "indices": _index_cases(), "stores": _store_level_cases(conn),
    }  # fmt: skip
    outcomes: dict[str, int] = {"clear_error": 0, "documented": 0}
    failures: list[str] = []
    total = 0
    for cases in groups.values():
        store, mirror = _filled(conn)
        _unavailable_device_read.td_id = store.td_id  # type: ignore[attr-defined]
        for case in cases:
            total += 1
            outcome, failure = _run_case(case, store, mirror, server, wire, store.td_id)
            if failure is not None:
                failures.append(failure)
                continue
            outcomes[outcome] += 1
            if outcome == "documented" and not _same(store.to_tensordict(), mirror):
                failures.append(f"{case.name}: the store no longer equals the in-memory mirror")
                break
        if not _same(store.to_tensordict(), mirror):
            failures.append("the store and the mirror differ at the end of the group")
        store.clear_redis()
        store.close()
    outcomes["clear_error"] += _closed_calls(server, wire, conn, failures)
    total += len(CLOSED_CALLS)
    add_cases(request, f"bad input matrix [{request.node.callspec.id}]", clear_errors=outcomes["clear_error"],
              documented=outcomes["documented"], failed=len(failures))  # fmt: skip
    record(request, cases=total, clear_errors=outcomes["clear_error"], documented=outcomes["documented"],
           unchanged_wire_checks=outcomes["clear_error"], failed=len(failures))  # fmt: skip
    assert not failures, f"{len(failures)} of {total} cases failed:\n" + "\n".join(failures)
