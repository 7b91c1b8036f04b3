"""Every command tdstore sends goes out from ``tdstore/_backend/`` (issue 14: one I/O layer).

An AST walk of the package finds the calls of redis client methods outside the folders
allowed to send commands: ``_backend/`` (the I/O layer), ``server/`` (starting private
servers), ``testing/`` (fixtures), and ``cli/bench.py`` (its raw redis-py baseline measures
redis-py itself). The few known exceptions left are listed with their reason.
"""

from __future__ import annotations

import ast
import asyncio
import io
import pathlib
import threading

import redis
import redis.asyncio
import torch
from tensordict import TensorDict

import tdstore
from tdstore._backend.probe import DOCTOR_CONFIG, ServerFacts, probe_server
from tdstore.cli.doctor import _diagnose

PACKAGE = pathlib.Path(tdstore.__file__).parent
ALLOWED_DIRS = ("_backend/", "server/", "testing/")
ALLOWED_FILES = ("cli/bench.py",)
#: (file, method): calls outside the I/O layer that stay, and why
KNOWN: dict[tuple[str, str], str] = {}  # (store/ring.py's reads moved into _backend/append.py)
#: receivers that hold a client or pipeline by this codebase's naming
CLIENT_NAMES = {"c", "client", "pipe", "pipeline", "raw"}
#: closing a client sends nothing the server acts on
NOT_COMMANDS = {"close", "aclose"}

_METHODS = {n for n in dir(redis.Redis) if not n.startswith("_")} | {
    n for n in dir(redis.asyncio.Redis) if not n.startswith("_")
}
_EVERYDAY = (dict, list, set, str, bytes, torch.Tensor, TensorDict, io.IOBase, threading.Event, asyncio.AbstractEventLoop)
#: method names that are also everyday Python ones (dict.get, list.append, json.dump ...): flagged
#: only on a receiver named like a client
AMBIGUOUS = {n for n in _METHODS if any(hasattr(t, n) for t in _EVERYDAY)} | {
    "digest", "dump", "load", "save", "time", "sync", "wait", "lock", "type", "object", "echo", "client",
}


def _tdstore_module_aliases(tree: ast.Module) -> set[str]:
    """The names a file binds to tdstore modules (``from tdstore.store import ring as _ring``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tdstore":
            for alias in node.names:
                parts = [*(node.module or "").split(".")[1:], alias.name]
                if (PACKAGE.joinpath(*parts).with_suffix(".py")).is_file() or (PACKAGE.joinpath(*parts) / "__init__.py").is_file():
                    out.add(alias.asname or alias.name)
    return out


def _calls_outside() -> list[tuple[str, int, str]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(ALLOWED_DIRS) or rel in ALLOWED_FILES:
            continue
        tree = ast.parse(path.read_text(), rel)
        modules = _tdstore_module_aliases(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name = node.func.attr
            if name not in _METHODS or name in NOT_COMMANDS:
                continue
            if isinstance(node.func.value, ast.Name) and node.func.value.id in modules:
                continue  # a function of a tdstore module (``_lifetime.expire(store, s)``), not a client's
            on_client = isinstance(node.func.value, ast.Name) and node.func.value.id in CLIENT_NAMES
            if name not in AMBIGUOUS or on_client:
                found.append((rel, node.lineno, name))
    return found


def test_no_command_is_sent_outside_the_io_layer():
    unexpected = [f"{rel}:{line} .{name}()" for rel, line, name in _calls_outside() if (rel, name) not in KNOWN]
    assert unexpected == [], "server commands outside tdstore/_backend/: " + ", ".join(unexpected)


def test_the_walk_finds_what_it_looks_for():
    """The walk sees the known exceptions, and would see a doctor that pinged the server itself."""
    seen = {(rel, name) for rel, _, name in _calls_outside()}
    assert set(KNOWN) <= seen
    tree = ast.parse("def f(client, conn):\n    client.ping()\n    conn.config_get('x')\n    d.get(1)\n")
    calls = [n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    assert [c for c in calls if c in _METHODS and c not in AMBIGUOUS] == ["ping", "config_get"]


def _tdstore_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """Every tdstore module ``path`` imports, at any level (module top, functions, TYPE_CHECKING)."""
    root = pathlib.Path(tdstore.__file__).parent
    package = ".".join(("tdstore", *path.relative_to(root).with_suffix("").parts[:-1]))
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "tdstore"]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolved against the package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            if module.split(".")[0] == "tdstore":
                out += [(node.lineno, module if module != "tdstore" else f"tdstore.{a.name}") for a in node.names]
    return out


def test_core_imports_only_core_and_errors():
    """``tdstore._core`` is pure: no I/O layer, no store (issue 25, item 4)."""
    root = pathlib.Path(tdstore.__file__).parent
    found = [
        f"{path.relative_to(root)}:{line}: {module}"
        for path in sorted((root / "_core").rglob("*.py"))
        for line, module in _tdstore_imports(path)
        if not (module == "tdstore._core" or module.startswith("tdstore._core.") or module == "tdstore.errors")
    ]
    assert found == []


def _run_time_imports(module: str, source: str, modules: set[str], *, package: bool) -> dict[str, list[int]]:
    """The tdstore modules that ``module`` imports when it runs, with the lines: imports at the
    module's top and inside functions (they run when the function is called), not those under
    ``if TYPE_CHECKING:`` (never run; they name types only). ``from P import name`` is an import
    of ``P.name`` when that is a module, else of ``P``. Importing ``P.m`` also runs the package
    ``P``'s ``__init__``: that implicit edge is Python's own and not counted."""
    here = module if package else module.rpartition(".")[0]
    tree = ast.parse(source)
    type_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    out: dict[str, list[int]] = {}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            if target in modules and target != module:
                out.setdefault(target, []).append(node.lineno)
    return out


def _cycles(edges: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = [stack.pop()]
            while component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _import_graph() -> dict[str, dict[str, list[int]]]:
    root = pathlib.Path(tdstore.__file__).parent
    paths = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(("tdstore", *parts[:-1])) if parts[-1] == "__init__" else ".".join(("tdstore", *parts))
        paths[name] = path
    return {
        name: _run_time_imports(name, path.read_text(), set(paths), package=path.name == "__init__.py")
        for name, path in paths.items()
    }


def test_no_import_cycles():
    """No two tdstore modules import each other, directly or around a loop, at any level that
    runs, function-level imports included (issue 25, item 4): each layer builds on the ones below.
    ``if TYPE_CHECKING:`` imports are not counted (they never run); the mixins' self types use
    them."""
    graph = _import_graph()
    report = [
        " <-> ".join(cycle) + ": " + "; ".join(
            f"{a} imports {b} (line {', '.join(map(str, graph[a][b]))})" for a in cycle for b in graph[a] if b in cycle
        )
        for cycle in _cycles(graph)
    ]
    assert report == []


def test_the_import_walk_sees_function_level_imports_and_cycles():
    modules = {"tdstore.a", "tdstore.b", "tdstore.c", "tdstore.pkg", "tdstore.pkg.m"}
    source = (
        "from typing import TYPE_CHECKING\n"
        "import tdstore.c\n"
        "from tdstore.pkg import m, name\n"
        "if TYPE_CHECKING:\n    from tdstore import a\n"
        "def f():\n    from tdstore.b import thing\n"
    )
    edges = _run_time_imports("tdstore.x", source, modules, package=False)
    assert edges == {"tdstore.c": [2], "tdstore.pkg.m": [3], "tdstore.pkg": [3], "tdstore.b": [7]}
    assert _cycles({"tdstore.a": {"tdstore.b": [1]}, "tdstore.b": {"tdstore.c": [1]}, "tdstore.c": {"tdstore.a": [1]}}) == [
        ["tdstore.a", "tdstore.b", "tdstore.c"]
    ]
    assert _cycles({"tdstore.a": {"tdstore.b": [1]}, "tdstore.b": {}}) == []
    backend = pathlib.Path(tdstore.__file__).parent / "_backend" / "connection.py"
    assert any(m.startswith("tdstore._backend.") for _, m in _tdstore_imports(backend))


def test_probe_returns_the_facts_doctor_judges(real_server):
    facts = probe_server(real_server.connection_kwargs(), pings=3)
    assert facts.info.get("redis_version") and facts.info_refused is None
    assert facts.eval_refused is None and facts.lua and facts.lua.startswith("Lua 5.")
    assert set(facts.config) == set(DOCTOR_CONFIG)
    policy = real_server.sync_client().config_get("maxmemory-policy")["maxmemory-policy"]
    assert facts.config["maxmemory-policy"] == (policy.decode() if isinstance(policy, bytes) else policy)
    assert len(facts.ping_times) == 3 and all(t > 0 for t in facts.ping_times)


class _Opts:
    cluster = False
    unix_socket_path = None
    ssl = False
    host = "127.0.0.1"
    port = 1


def test_doctor_judges_facts_without_a_server(monkeypatch):
    """doctor's verdicts come from the facts alone: a server refusing EVAL and CONFIG."""
    monkeypatch.setattr("tdstore.cli.doctor._largest_entry", lambda opts: (0, None, 0))  # no store listing
    facts = ServerFacts(
        info={"redis_version": "7.2.0", "used_memory": "1000", "aof_enabled": "0"},
        eval_refused="NOPERM this user has no permissions to run the 'eval' command",
        config=dict.fromkeys(DOCTOR_CONFIG),
        ping_times=[0.001, 0.002, 0.003],
    )
    items = {item["name"]: item for item in _diagnose(facts, _Opts())}
    assert items["scripts"]["status"] == "fail" and "NOPERM" in items["scripts"]["detail"]
    assert "lua" not in items
    assert items["eviction"]["status"] == "warn"  # the server does not say its policy
    assert items["proto-max-bulk-len"]["status"] == "warn"
    assert items["latency"]["value"] == 2.0


def test_nothing_outside_the_backend_uses_a_private_member_of_a_connection():
    """The store classes, torchrl.py and the rest call the public methods of a handle's
    ``Connection`` (``run``, ``read``, ``append``, ``write_rows``...), never its private members
    (issue 25, item 3): ``store._conn._direct_call`` and the like are the backend's business."""
    root = pathlib.Path(tdstore.__file__).parent
    source = (root / "_backend" / "connection.py").read_text()
    connection = next(
        n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Connection"
    )
    names: set[str] = set()
    for node in ast.walk(connection):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
    private = {n for n in names if n.startswith("_") and not n.startswith("__")}
    assert "_direct_call" in private and "_client" in private  # (the walk finds them)

    def is_connection(value: ast.expr) -> bool:
        return (isinstance(value, ast.Attribute) and value.attr == "_conn") or (
            isinstance(value, ast.Name) and value.id in ("conn", "_conn", "connection")
        )

    found = [
        f"{path.relative_to(root)}:{node.lineno}: .{node.attr}"
        for path in sorted(root.rglob("*.py"))
        if path.parent.name != "_backend"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in private and is_connection(node.value)
    ]
    assert found == []
