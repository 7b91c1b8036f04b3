"""The suite's fixtures stay in one module: ``tests/fixtures.py`` (docs/contributing.md, "Writing tests").

An AST scan of every test file (``tests/**/*.py`` but ``tests/fixtures.py``): none defines its
own store factory, process pool or race server again, and no new test picks a shared server
with ``request.getfixturevalue(f"{kind}_server")``, the second parametrisation mechanism that
``server``, ``real_server`` and ``race_server`` (parametrised by ``pytest_generate_tests``) replace.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
FIXTURES = TESTS / "fixtures.py"

#: fixtures that only tests/fixtures.py defines
SHARED = {"make", "_make", "stores", "store_factory", "make_store", "pool", "process_pool", "race_server"}
#: module-level helpers with a factory's name (tests/test_append_armed.py and tests/test_hostile.py had them)
FACTORY_NAMES = {"make", "_make"}
#: test files that still pick a session server by name from a parameter (written before the
#: rule; each runs a fixed list of servers, not the --backends selection). No new entry.
GETFIXTUREVALUE_BY_NAME = {"test_bench_server_cpu.py", "test_kill.py", "test_read_one_row.py"}


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p != FIXTURES)


def _is_fixture(decorator: ast.expr) -> bool:
    node = decorator.func if isinstance(decorator, ast.Call) else decorator
    if isinstance(node, ast.Attribute):
        return node.attr == "fixture"
    return isinstance(node, ast.Name) and node.id == "fixture"


def _fixture_name(func: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The fixture's name (``name=`` of the decorator, else the function's), None if no fixture."""
    for decorator in func.decorator_list:
        if _is_fixture(decorator):
            if isinstance(decorator, ast.Call):
                for keyword in decorator.keywords:
                    if keyword.arg == "name" and isinstance(keyword.value, ast.Constant):
                        return str(keyword.value.value)
            return func.name
    return None


def _calls(node: ast.AST, name: str) -> list[ast.Call]:
    found = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called == name:
                found.append(sub)
    return found


def _problems(path: Path) -> list[str]:
    return _problems_in(path.read_text(), path.relative_to(TESTS).as_posix())


def _problems_in(text: str, where: str) -> list[str]:
    tree = ast.parse(text, filename=where)
    problems = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        fixture = _fixture_name(node)
        if fixture in SHARED:
            problems.append(f"{where}:{node.lineno}: fixture {fixture!r} (use the one of tests/fixtures.py)")
        elif fixture is not None and _calls(node, "ProcessPoolExecutor"):
            problems.append(
                f"{where}:{node.lineno}: fixture {fixture!r} starts a process pool (use `pool` and a POOL = "
                "PoolSpec(...), or fixtures.process_pool)"
            )
    for node in tree.body:  # module-level helpers named like a factory
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in FACTORY_NAMES:
            if _fixture_name(node) is None:
                problems.append(f"{where}:{node.lineno}: function {node.name!r} (use the `stores` fixture)")
    if Path(where).name not in GETFIXTUREVALUE_BY_NAME:
        for call in _calls(tree, "getfixturevalue"):
            if call.args and isinstance(call.args[0], ast.JoinedStr):
                problems.append(
                    f"{where}:{call.lineno}: request.getfixturevalue(f\"...\") picks a server by name: take "
                    "`server`, `real_server` or `race_server` (parametrised over --backends) instead"
                )
    return problems


def test_fixtures_live_in_one_module() -> None:
    problems = [problem for path in _test_files() for problem in _problems(path)]
    assert not problems, "\n".join(problems)


def test_the_shared_fixtures_are_defined_in_tests_fixtures() -> None:
    tree = ast.parse(FIXTURES.read_text())
    defined = {
        _fixture_name(node) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    assert {"make", "stores", "pool", "race_server", "server", "real_server"} <= defined


def test_the_allowlist_has_no_stale_entry() -> None:
    """A file that no longer picks a server by name leaves the allowlist (so it stays that way)."""
    stale = [
        name
        for name in sorted(GETFIXTUREVALUE_BY_NAME)
        if not any(
            call.args and isinstance(call.args[0], ast.JoinedStr)
            for call in _calls(ast.parse((TESTS / name).read_text()), "getfixturevalue")
        )
    ]
    assert not stale, f"remove from GETFIXTUREVALUE_BY_NAME: {stale}"


@pytest.mark.parametrize(
    "source",
    [
        "@pytest.fixture\ndef make(server):\n    pass\n",
        "@pytest.fixture(scope='module')\ndef pool():\n    pass\n",
        "@pytest.fixture(name='race_server')\ndef _rs(request):\n    pass\n",
        "@pytest.fixture(scope='module')\ndef workers():\n    with ProcessPoolExecutor(2) as ex:\n        yield ex\n",
        "def _make(server):\n    pass\n",
        "def test_x(request, kind):\n    request.getfixturevalue(f'{kind}_server')\n",
    ],
)
def test_the_scan_finds_a_copy(source: str) -> None:
    text = "import pytest\nfrom concurrent.futures import ProcessPoolExecutor\n" + source
    problems = _problems_in(text, "test_probe.py")
    assert len(problems) == 1, problems
