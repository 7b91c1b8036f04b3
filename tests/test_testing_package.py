"""``pytest --pyargs tdstore.testing --server-url URL``: the shipped conformance suite on a given server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tdstore.server import ServerHandle

ROOT = Path(__file__).resolve().parents[1]


def _run_suite(cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``pytest --pyargs tdstore.testing ARGS`` from a folder outside the repository, as a user runs it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "tdstore.testing", "-q", "-p", "no:cacheprovider", *args],
        capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env,
    )


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_suite_runs_against_a_server_given_by_url(redis_server: ServerHandle, tmp_path: Path) -> None:
    done = _run_suite(tmp_path, "--server-url", redis_server.url)
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    passed = int(re.search(r"(\d+) passed", done.stdout).group(1))
    assert passed > 100, tail  # the whole suite ran, not a corner of it


def test_suite_refuses_a_database_that_holds_keys(redis_server: ServerHandle, tmp_path: Path) -> None:
    client = redis_server.sync_client()
    client.set("someone-elses-key", b"x")
    done = _run_suite(tmp_path, "--server-url", redis_server.url, timeout=120)
    assert done.returncode != 0
    assert "holds 1 keys" in done.stdout + done.stderr and "empty" in done.stdout + done.stderr
    assert client.get("someone-elses-key") == b"x"  # untouched


def test_suite_needs_a_url(tmp_path: Path) -> None:
    done = _run_suite(tmp_path, timeout=120)
    assert done.returncode != 0
    assert "--server-url" in done.stdout + done.stderr
