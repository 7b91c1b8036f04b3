"""Every ``>>>`` example of the docs, the README, the tdstore docstrings and the API text runs.

The examples are written for a server on the default ``localhost:6379``. Each test sets
``TDSTORE_URL`` to a private server of the session (Redis and Valkey, one test id per
server) so that stores created with the default host and port go there instead (see
``connection_defaults`` in ``tdstore/_backend/settings.py``).

Test ids:

* ``test_doc_file[<server>-README.md]``, ``test_doc_file[<server>-docs/guide.md]``, ...:
  one per Markdown file (code fences are blanked out before parsing);
* ``test_docstring[<server>-tdstore.store.core.TensorDictStore]``, ...: one per docstring
  with examples in any module of the package (found by walking it, not from a list);
* ``test_api_text[<server>-from_schema]``, ...: one per method of the fixed API text
  (``tests/data/api/TensorDictStore.txt``, a copy kept in the repository), whose examples import
  ``from tensordict.store import TensorDictStore``; they run with that line replaced by
  ``from tdstore import TensorDictStore``, and nothing else changed.

A failing example fails its test with the doctest report. An example set that leaves
keys on the server fails too: the docs teach ``clear_redis()``.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

import tdstore
from tdstore.server import ServerHandle

ROOT = Path(__file__).resolve().parents[1]
API_TEXT = ROOT / "tests" / "data" / "api" / "TensorDictStore.txt"
API_IMPORT = "from tensordict.store import TensorDictStore"
OUR_IMPORT = "from tdstore import TensorDictStore"
FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
#: Modules that import an optional dependency (module -> what it needs): their docstrings run in
#: the environment that has it (tdstore.torchrl: the tensordict 0.14.3 + TorchRL step of .ci/run).
OPTIONAL_MODULES = {"tdstore.torchrl": "torchrl"}

# Markdown files that must hold examples (a file that loses all of them fails).
MUST_HAVE_EXAMPLES = {"README.md", "docs/guide.md", "docs/api.md", "docs/guarantees.md", "docs/limits.md"}

_FENCE_RE = re.compile(r"^[ \t]*(```|~~~).*$", re.M)
_HEADER_RE = re.compile(r"^(?:class |classmethod )?(?:[\w.]+\.)?(\w+)\(.*#\s*$")


# --------------------------------------------------------------------------- collection
def _markdown_files() -> list[str]:
    files = ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))
    return [f for f in files if (ROOT / f).is_file()] or ["README.md"]


def _package_modules() -> list[ModuleType]:
    """Every module of the tdstore package (an optional dependency that is missing skips its module)."""
    modules = [tdstore]
    for info in pkgutil.walk_packages(tdstore.__path__, "tdstore."):
        try:
            modules.append(importlib.import_module(info.name))
        except ImportError as exc:
            needs = next(
                (dep for mod, dep in OPTIONAL_MODULES.items() if info.name == mod or info.name.startswith(mod + ".")),
                None,
            )
            if needs is None or needs not in str(exc):
                raise
    return modules


def _docstring_tests() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests: list[doctest.DocTest] = []
    for module in _package_modules():
        tests.extend(t for t in finder.find(module) if t.examples)
    return sorted(tests, key=lambda t: t.name)


@dataclass
class ApiSection:
    name: str
    lineno: int
    text: str


def _api_sections() -> list[ApiSection]:
    """The API text cut into one piece per method header (a line ending in ``#``)."""
    if not API_TEXT.is_file():
        return []
    lines = API_TEXT.read_text().splitlines(keepends=True)
    sections: list[ApiSection] = []
    name, start = "preamble", 0
    for i, line in enumerate(lines):
        match = _HEADER_RE.match(line)
        if match:
            sections.append(ApiSection(name, start, "".join(lines[start:i])))
            name, start = match.group(1), i
    sections.append(ApiSection(name, start, "".join(lines[start:])))
    return [s for s in sections if ">>>" in s.text]


DOCSTRING_TESTS = {t.name: t for t in _docstring_tests()}
API_SECTIONS = {s.name: s for s in _api_sections()}


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(params=["redis_server", "valkey_server"], ids=["redis", "valkey"])
def doc_server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerHandle]:
    """A session server (Redis or Valkey) with ``TDSTORE_URL`` pointing at it."""
    handle: ServerHandle = request.getfixturevalue(request.param)
    _flushall(handle)
    monkeypatch.setenv("TDSTORE_URL", handle.url)
    try:
        yield handle
    finally:
        _flushall(handle)  # also after a failed example that could not clean up


def _flushall(handle: ServerHandle) -> None:
    client = handle.sync_client(socket_timeout=30)
    try:
        client.flushall()
    finally:
        client.close()


def _leftover_keys(handle: ServerHandle) -> list[bytes]:
    client = handle.sync_client(socket_timeout=30)
    try:
        return sorted(client.scan_iter(count=1000))
    finally:
        client.close()


# --------------------------------------------------------------------------- running
def _run(test: doctest.DocTest, handle: ServerHandle, *, clear_globs: bool = True) -> None:
    """Runs one doctest; fails with the doctest report or if it left keys behind."""
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=FLAGS, verbose=False)
    result = runner.run(test, out=report.append, clear_globs=clear_globs)
    if result.failed:
        pytest.fail(
            f"{result.failed} of {result.attempted} examples of {test.name} failed on "
            f"{handle.kind} {handle.version}:\n" + "".join(report),
            pytrace=False,
        )
    left = _leftover_keys(handle)
    if left:
        pytest.fail(
            f"the examples of {test.name} passed but left {len(left)} keys on the server "
            f"(end them with store.clear_redis()): {left[:10]}",
            pytrace=False,
        )


def _parse(text: str, name: str, filename: str, lineno: int = 0) -> doctest.DocTest:
    return doctest.DocTestParser().get_doctest(text, {"__name__": "__main__"}, name, filename, lineno)


def markdown_doctest(relpath: str) -> doctest.DocTest:
    """The doctest of a Markdown file; fence lines are blanked (line numbers kept)."""
    path = ROOT / relpath
    text = _FENCE_RE.sub("", path.read_text())
    return _parse(text, relpath, str(path))


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("relpath", _markdown_files())
def test_doc_file(relpath: str, doc_server: ServerHandle) -> None:
    path = ROOT / relpath
    assert path.is_file(), f"{relpath} is missing"
    test = markdown_doctest(relpath)
    if relpath in MUST_HAVE_EXAMPLES:
        assert test.examples, f"{relpath} has no >>> examples"
    _run(test, doc_server)


@pytest.mark.parametrize("name", sorted(DOCSTRING_TESTS) or ["<none>"])
def test_docstring(name: str, doc_server: ServerHandle) -> None:
    assert DOCSTRING_TESTS, "no docstring of tdstore, tdstore.store or tdstore.store.core has an example"
    test = DOCSTRING_TESTS[name]
    # a fresh copy each run: DocTestRunner clears the globals it ran with
    fresh = doctest.DocTest(test.examples, dict(test.globs), test.name, test.filename, test.lineno, test.docstring)
    _run(fresh, doc_server)


@pytest.mark.parametrize("section", sorted(API_SECTIONS) or ["<missing>"])
def test_api_text(section: str, doc_server: ServerHandle) -> None:
    assert API_TEXT.is_file(), f"the API text {API_TEXT} is missing"
    assert section in API_SECTIONS, f"the API text {API_TEXT} has no >>> examples"
    part = API_SECTIONS[section]
    assert API_IMPORT in part.text, f"the examples of {section} no longer import {API_IMPORT!r}"
    test = _parse(part.text.replace(API_IMPORT, OUR_IMPORT), f"api:{section}", str(API_TEXT), part.lineno)
    assert all("tensordict.store" not in ex.source for ex in test.examples)
    _run(test, doc_server, clear_globs=False)
    # the examples ran against tdstore, not against tensordict's own module of that name
    assert test.globs.get("TensorDictStore") is tdstore.TensorDictStore
    test.globs.clear()


def test_api_text_sections_are_all_collected() -> None:
    """The API text exists and its example sections are the ones this module runs."""
    assert API_TEXT.is_file(), f"the API text {API_TEXT} is missing"
    text = API_TEXT.read_text()
    total = len(_parse(text, "api", str(API_TEXT)).examples)
    collected = sum(len(_parse(s.text, s.name, str(API_TEXT)).examples) for s in API_SECTIONS.values())
    assert total == collected > 0
    assert {"TensorDictStore", "from_dict", "from_schema", "from_tensordict"} <= set(API_SECTIONS)


def test_markdown_fences_are_blanked() -> None:
    """The parser sees no fence line as expected output (a closing fence would be one)."""
    text = "intro\n\n```python\n>>> 1 + 1\n2\n```\n\nmore\n"
    test = _parse(_FENCE_RE.sub("", text), "t", "t.md")
    assert [ex.want for ex in test.examples] == ["2\n"]


def test_every_exported_exception_is_a_tdstore_error_of_tdstore_errors() -> None:
    """Each exception class that tdstore, tdstore.errors, tdstore.server or tdstore.cli exports is a
    TDStoreError, defined in (so importable from, and documented with) tdstore.errors."""
    import importlib

    import redis.exceptions

    import tdstore.errors

    found: dict[str, type[BaseException]] = {}
    for module_name in ("tdstore", "tdstore.errors", "tdstore.server", "tdstore.cli"):
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", []):
            value = getattr(module, name)
            if isinstance(value, type) and issubclass(value, BaseException):
                found[f"{module_name}.{name}"] = value
    assert len(found) >= 30, sorted(found)
    for where, cls in found.items():
        assert issubclass(cls, tdstore.errors.TDStoreError), f"{where} is not a TDStoreError"
        assert cls.__module__ == "tdstore.errors", f"{where} is defined in {cls.__module__}, not tdstore.errors"
        assert getattr(tdstore.errors, cls.__name__) is cls and cls.__name__ in tdstore.errors.__all__, where
    # the moved classes keep their builtin bases (and stay importable where they were)
    from tdstore._backend.retry import OutcomeUnknownError, ServerUnavailableError
    from tdstore._core.keys import KeyTypeError
    from tdstore.cli import CliError
    from tdstore.server import ServerNotFoundError

    assert ServerUnavailableError is tdstore.errors.ServerUnavailableError
    assert issubclass(ServerUnavailableError, redis.exceptions.ConnectionError)
    assert issubclass(OutcomeUnknownError, ServerUnavailableError)
    assert issubclass(KeyTypeError, TypeError) and issubclass(KeyTypeError, KeyError)
    assert str(KeyTypeError("a key must be a str")) == "a key must be a str"
    assert issubclass(ServerNotFoundError, RuntimeError)
    assert CliError("tdstore: bad", 2).code == 2 and issubclass(CliError, tdstore.errors.TDStoreError)
    assert {"ServerUnavailableError", "OutcomeUnknownError", "KeyTypeError", "ServerNotFoundError", "CliError"} <= set(
        tdstore.errors.__all__
    )
