"""tensordict's own test suite for ``tensordict.store``, run on tdstore and on the peer.

    python benchmarks/upstream_suite.py PATH/TO/test_store.py

PATH is ``test/store/test_store.py`` of a pytorch/tensordict checkout (not part of this
repository; docs/migrating.md gives the commit measured). The file runs twice on a private
redis-server: once as it is (``tensordict.store``), once with tdstore's ``TensorDictStore`` and
``LazyStackedTensorDictStore`` put in its place (in ``tensordict.store`` and
``tensordict.store._store``, which ``TensorDict.to_store`` imports from) before the file is
imported. Its "dragonfly" backend is deselected. Prints passed / failed per implementation
and the failing tests of tdstore.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

from tdstore.server import start_server

CONFTEST = '''
import os

PORT = int(os.environ["TDS_PORT"])
if os.environ.get("TDS_IMPL") == "tdstore":
    import tensordict.store as _ts
    import tensordict.store._store as _tss

    import tdstore

    for _mod in (_ts, _tss):
        _mod.TensorDictStore = tdstore.TensorDictStore
        _mod.LazyStackedTensorDictStore = tdstore.LazyStackedTensorDictStore


def pytest_collection_modifyitems(session, config, items):
    for item in items:  # the file's "redis" backend is this run's server
        mod = getattr(item, "module", None)
        if mod is not None and hasattr(mod, "_BACKEND_PORTS"):
            mod._BACKEND_PORTS["redis"] = PORT
            mod._BACKEND_PORTS["dragonfly"] = 1
'''


def run(folder: str, port: int, impl: str) -> tuple[dict[str, int], list[str]]:
    env = {**os.environ, "TDS_PORT": str(port), "TDS_IMPL": impl}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rf", "-k", "not dragonfly",
         "--timeout", "30", "test_store.py"],
        cwd=folder, env=env, capture_output=True, text=True, timeout=1800,
    )
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error)", proc.stdout.splitlines()[-1])}
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in proc.stdout.splitlines() if line.startswith("FAILED ")]
    return counts, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_file", help="tensordict's test/store/test_store.py")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="tds-upstream-")
    handle = start_server("redis")
    try:
        shutil.copy(args.test_file, os.path.join(folder, "test_store.py"))
        with open(os.path.join(folder, "conftest.py"), "w") as f:
            f.write(CONFTEST)
        port = int(handle.connection_kwargs()["port"])
        results = {impl: run(folder, port, impl) for impl in ("peer", "tdstore")}
    finally:
        handle.stop()
        shutil.rmtree(folder, ignore_errors=True)
    for impl, (counts, _) in results.items():
        ran = counts.get("passed", 0) + counts.get("failed", 0) + counts.get("error", 0)
        print(f"{impl:8s} passed {counts.get('passed', 0)} of {ran} (skipped {counts.get('skipped', 0)})")
    peer, tds = results["peer"][0].get("passed", 0), results["tdstore"][0].get("passed", 0)
    print(f"tdstore / peer passed: {tds / max(peer, 1):.2f}")
    print("failing on tdstore:\n  " + "\n  ".join(results["tdstore"][1]))


if __name__ == "__main__":
    main()
