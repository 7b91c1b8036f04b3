"""``benchmarks/bench_sharded.py --quick`` runs end to end, so the scale benchmark of issue 27 cannot rot."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_sharded_quick_prints_its_three_tables() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_sharded.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    for title in ("Server main-thread CPU per operation (part 1)", "(part 2)", "Projection: appends/s"):
        assert title in out, out
    # every master served appends and samples: a positive CPU per operation on each row of part 1
    per_op = re.findall(r"^\| master \d \(shard \d\)\s+\|\s+([\d.]+) \|\s+[\d.]+x \|\s+([\d.]+) \|", out, re.M)
    assert len(per_op) == 3 and all(float(a) > 0 and float(r) > 0 for a, r in per_op), out
    # part 2 appended rows on all three masters, and its spread line is there
    appended = re.findall(r"^\| master \d \|\s+[\d.]+ \| [\d.]+% \|\s+(\d+) \|", out, re.M)
    assert len(appended) == 3 and all(int(n) > 0 for n in appended), out
    assert re.search(r"spread \(max - min\) / mean = [\d.]+%", out), out
