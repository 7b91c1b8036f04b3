"""Violation and case counts of the race, fault and property tests, printed at the end of the run
(by ``pytest_terminal_summary`` in the repository's ``tests/conftest.py``)."""

from __future__ import annotations

import pytest

COUNTS = pytest.StashKey[list]()


def record(request: pytest.FixtureRequest, **counts: object) -> None:
    """Records ``name=value`` counts of a test; conftest prints them in the summary."""
    text = " ".join(f"{k}={v}" for k, v in counts.items())
    request.config.stash.setdefault(COUNTS, []).append(f"{request.node.name}: {text}")
    print(text)


TOTALS = pytest.StashKey[dict]()


def add_cases(request: pytest.FixtureRequest, label: str, **counts: int) -> None:
    """Adds counts to a per-label total; conftest prints the totals in the summary."""
    totals = request.config.stash.setdefault(TOTALS, {})
    entry = totals.setdefault(label, {})
    for name, value in counts.items():
        entry[name] = entry.get(name, 0) + value
