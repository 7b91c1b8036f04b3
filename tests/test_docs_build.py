"""The documentation site builds: ``mkdocs build --strict`` with every page of docs/ in the nav.

The examples on the pages run in ``tests/test_docs.py``; this file checks the site itself:
the nav lists every ``docs/*.md`` (a new page cannot be forgotten) and only pages that
exist, the strict build (broken links, unknown anchors, docstring problems fail it) goes
through into a temporary directory, and the API reference generated from the docstrings
holds the public API.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BUILD_TIMEOUT = 300

sys.path.insert(0, str(ROOT / "tools"))
from mkdocs_hooks import wrap_doctest_blocks  # noqa: E402


def _nav_pages(nav: Any) -> list[str]:
    pages: list[str] = []
    if isinstance(nav, str):
        pages.append(nav)
    elif isinstance(nav, list):
        for item in nav:
            pages.extend(_nav_pages(item))
    elif isinstance(nav, dict):
        for value in nav.values():
            pages.extend(_nav_pages(value))
    return pages


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    with open(ROOT / "mkdocs.yml") as fh:
        return yaml.safe_load(fh)


def test_nav_lists_every_page_once(config: dict[str, Any]) -> None:
    assert config.get("docs_dir", "docs") == "docs"
    pages = _nav_pages(config["nav"])
    assert len(pages) == len(set(pages)), f"a page is in the nav twice: {pages}"
    on_disk = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    missing = sorted(set(on_disk) - set(pages))
    assert not missing, f"pages not in the nav of mkdocs.yml (add them): {missing}"
    absent = sorted(set(pages) - set(on_disk))
    assert not absent, f"the nav of mkdocs.yml names pages that do not exist: {absent}"
    assert pages[0] == "index.md"


def test_bare_doctest_blocks_are_fenced_for_rendering() -> None:
    text = "intro\n\n>>> x = [1]\n>>> x[0]\n1\n\nafter\n\n```python\n>>> y = 2\n```\n>>> z\n"
    assert wrap_doctest_blocks(text) == (
        "intro\n\n```pycon\n>>> x = [1]\n>>> x[0]\n1\n```\n\nafter\n\n```python\n>>> y = 2\n```\n"
        "```pycon\n>>> z\n```\n"
    )
    assert wrap_doctest_blocks("no examples\n") == "no examples\n"


@pytest.mark.slow
@pytest.mark.timeout(BUILD_TIMEOUT + 60)
def test_mkdocs_build_strict(tmp_path: Path, config: dict[str, Any]) -> None:
    for module in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python"):
        assert importlib.util.find_spec(module) is not None, f"{module} is missing: pip install -e '.[docs]'"
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        capture_output=True, text=True, timeout=BUILD_TIMEOUT, cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    for page in _nav_pages(config["nav"]):
        html = site / ("index.html" if page == "index.md" else f"{page[:-3]}/index.html")
        assert html.is_file(), f"{page} was not rendered"
    reference = (site / "api-reference" / "index.html").read_text()
    for anchor in (
        "tdstore.TensorDictStore",
        "tdstore.TensorDictStore.from_schema",
        "tdstore.TensorDictStore.from_store",
        "tdstore.TensorDictStore.clear_redis",
        "tdstore.errors.StoreNotFoundError",
        "tdstore.server.ServerHandle",
        "tdstore.server.start.start_server",
        "tdstore.cli.main",
    ):
        assert f'id="{anchor}"' in reference, f"{anchor} is missing from the API reference"
    # bare doctest blocks come out as code, not as paragraphs with reference links
    guide = (site / "guide" / "index.html").read_text()
    assert "&gt;&gt;&gt;" in guide and "<code" in guide
