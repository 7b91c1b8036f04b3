"""The public signatures of TensorDictStore match the API text (``tests/data/api/TensorDictStore.txt``).

The API text is the reference documentation of the class that tdstore is a drop-in for. Each
signature it shows (the constructor, ``from_dict``, ``from_tensordict``, ``from_schema``,
``from_store``, ``flatten_keys``...) must hold for ``inspect.signature`` of ours: every parameter
it names, of the same kind (positional or keyword-only), with the same default, in the same
order. Ours may add keyword-only parameters where the API text has ``**kwargs`` (they are
passed through there). The constructor keyword lists are therefore written out in each
signature (they are not shared through ``**kwargs``): this test is what keeps them so.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from tdstore import TensorDictStore

API_TEXT = Path(__file__).parent / "data" / "api" / "TensorDictStore.txt"

#: ``[classmethod ]name(params)[ → ret]#`` lines of the API text, and the class line
_SIGNATURE = re.compile(r"^(?:classmethod )?(?:class tensordict\.store\.)?(?P<name>\w+)\((?P<params>.*)\)(?: → .*)?#$")


def _api_signatures() -> dict[str, ast.arguments]:
    out: dict[str, ast.arguments] = {}
    for line in API_TEXT.read_text().splitlines():
        match = _SIGNATURE.match(line)
        if match is None:
            continue
        name = "__init__" if match["name"] == "TensorDictStore" else match["name"]
        out[name] = ast.parse(f"def f(self, {match['params']}): pass").body[0].args  # type: ignore[attr-defined]
    return out


API = _api_signatures()


def _expected(args: ast.arguments) -> tuple[list[tuple[str, str, Any]], bool]:
    """``(name, kind, default)`` of each parameter the API text shows (``self`` left out), and
    whether it ends in ``**kwargs``."""
    positional = args.posonlyargs + args.args
    pos_defaults: list[Any] = [inspect.Parameter.empty] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = []
    for arg, default in list(zip(positional, pos_defaults, strict=True))[1:]:
        out.append((arg.arg, "POSITIONAL_OR_KEYWORD", default))
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        out.append((arg.arg, "KEYWORD_ONLY", kw_default if kw_default is not None else inspect.Parameter.empty))
    return [
        (name, kind, d if d is inspect.Parameter.empty else ast.literal_eval(d)) for name, kind, d in out
    ], args.kwarg is not None


def test_the_api_text_lists_the_signatures() -> None:
    assert {"__init__", "from_dict", "from_tensordict", "from_schema", "from_store", "flatten_keys"} <= set(API)


@pytest.mark.parametrize("name", sorted(API))
def test_public_signature_matches_the_api_text(name: str) -> None:
    expected, var_keyword = _expected(API[name])
    ours = inspect.signature(getattr(TensorDictStore, name))
    params = [p for p in ours.parameters.values() if p.name not in ("self", "cls")]
    names = [p.name for p in params]
    where = f"TensorDictStore.{name}{ours} against the API text"
    for api_name, kind, default in expected:
        assert api_name in names, f"{where}: no parameter {api_name!r}"
        param = ours.parameters[api_name]
        assert param.kind.name == kind, f"{where}: {api_name!r} is {param.kind.name}, not {kind}"
        assert param.default == default or (param.default is None and default is None), (
            f"{where}: {api_name!r} defaults to {param.default!r}, not {default!r}"
        )
    order = [names.index(api_name) for api_name, _, _ in expected]
    assert order == sorted(order), f"{where}: the parameters are not in the API's order"
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params) == var_keyword, where
    extra = [p for p in params if p.name not in {n for n, _, _ in expected} and p.kind is not inspect.Parameter.VAR_KEYWORD]
    if not var_keyword:
        assert not extra, f"{where}: parameters the API text does not have: {[p.name for p in extra]}"
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extra), f"{where}: extra parameters must be keyword-only"
