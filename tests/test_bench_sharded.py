"""``benchmarks/bench_sharded.py --quick`` runs end to end, so the scale benchmark of issue 27 cannot rot."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_sharded_quick_prints_its_tables() -> None:
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
    for title in (
        "CPU per append (part 1)",
        "CPU per sampled row of sample(256) (part 1)",
        "(part 2)",
        "Projection: appends/s",
    ):
        assert title in out, out
    # every master served appends (pinned, and in turn) and samples: a positive CPU per operation on each
    for case in ("pinned", "in turn", ""):
        per_op = re.findall(rf"^\| master \d \(shard \d\){' ' + case if case else ''}\s+\|\s+([\d.]+) \|", out, re.M)
        assert len(per_op) == 3 and all(float(v) > 0 for v in per_op), (case, out)
    # the baselines ran too: one server alone, three taken in turn and three sampled in parallel
    assert re.search(r"^\| one server, alone\s+\|\s+[\d.]+ \|\s+1\.00x", out, re.M), out
    assert (
        len(re.findall(r"^\| server \d of 3 (taken in turn|sampled in parallel)\s+\|\s+[\d.]+ \|", out, re.M)) == 6
    ), out
    # part 2 appended rows on all three masters, and its spread line is there
    appended = re.findall(r"^\| master \d \|\s+[\d.]+ \| [\d.]+% \|\s+(\d+) \|", out, re.M)
    assert len(appended) == 3 and all(int(n) > 0 for n in appended), out
    assert re.search(r"spread \(max - min\) / mean = [\d.]+%", out), out
