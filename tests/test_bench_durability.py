"""``benchmarks/bench_durability.py --quick`` runs end to end (the price of durability=, issue 27)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_durability_quick_prints_every_case() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_durability.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "The price of durability=" in out, out
    rows = re.findall(r"^\| (extend|indexed)\s+\| (default|replicas:1|fsync)\s+\|\s+(\d+) \|\s+([\d.]+) \|", out, re.M)
    assert len(rows) == 6, out
    assert all(int(wall) > 0 for _op, _mode, wall, _cpu in rows), out
