"""Start-up time of the ``tdstore`` command (issue 17: under 0.5 s for the commands that need no torch).

    python benchmarks/bench_cli_start.py --server valkey --repeat 7

Each command runs ``--repeat`` times (after one untimed run) as a fresh subprocess
(``python -m tdstore ...``, the console script's code) against a private server that this
script starts with one small store on it; the table gives the median and the minimum wall
time of each, and whether the process imported torch. The interpreter alone (``python -c pass``), ``import tdstore`` alone, and
``import tdstore`` plus the first use of ``tdstore.TensorDictStore`` (which imports torch and
tensordict), are measured the same way for reference.

The store-free commands (``--help``, ``--version``, ``ls``, ``info``, ``serve --help``,
``doctor``, ``rm``) must not import torch: ``rm`` deletes a dense or lazy store with one
server step, without its class (only a ShardedStore is opened, to delete its blocks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tdstore.server import start_server  # noqa: E402

GOAL_S = 0.5

#: prints whether torch was imported, at exit (appended to every command run)
_PROBE = (
    "import atexit, sys\n"
    "atexit.register(lambda: sys.stderr.write('\\nTORCH=%s\\n' % ('torch' in sys.modules)))\n"
)


def _run(argv: list[str], env: dict[str, str]) -> tuple[float, bool]:
    code = _PROBE + "import runpy, sys\nsys.argv = ['tdstore', *sys.argv[1:]]\n" \
        "runpy.run_module('tdstore', run_name='__main__')\n"
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=120)
    elapsed = time.perf_counter() - start
    if "TORCH=" not in done.stderr:
        raise RuntimeError(f"tdstore {' '.join(argv)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return elapsed, "TORCH=True" in done.stderr


def _run_code(code: str, env: dict[str, str]) -> tuple[float, bool]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _PROBE + code], capture_output=True, text=True, env=env, timeout=120)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{code!r} failed: {done.stderr[-2000:]}")
    return elapsed, "TORCH=True" in done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=("valkey", "redis", "redis6"), default="valkey")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs per command (default: 7)")
    args = parser.parse_args()

    env = {k: v for k, v in os.environ.items() if k not in ("TDSTORE_URL", "TDSTORE_PASSWORD", "REDISCLI_AUTH")}
    env["PYTHONPATH"] = _ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with start_server(args.server) as srv:
        import torch

        from tdstore import TensorDictStore

        store = TensorDictStore.from_dict({"x": torch.arange(12).reshape(4, 3)}, batch_size=[4],
                                          td_id="bench-cli", **srv.connection_kwargs())
        store.close()
        conn = ["-s", srv.unix_socket_path] if srv.unix_socket_path else ["-p", str(srv.port)]
        cases: list[tuple[str, object]] = [
            ("--help", ["--help"]),
            ("--version", ["--version"]),
            ("ls", ["ls", *conn]),
            ("info bench-cli", ["info", "bench-cli", *conn]),
            ("serve --help", ["serve", "--help"]),
            ("doctor", ["doctor", *conn]),
            ("rm --yes (a missing store)", ["rm", "--yes", "no-such-store", *conn]),
            ("python -c 'pass' (the interpreter alone)", "pass"),
            ("python -c 'import tdstore'", "import tdstore"),
            ("import tdstore; tdstore.TensorDictStore", "import tdstore; tdstore.TensorDictStore"),
        ]
        rows = []
        for name, what in cases:
            runner = (lambda what=what: _run(what, env)) if isinstance(what, list) else (lambda what=what: _run_code(what, env))  # type: ignore[arg-type]
            runner()  # untimed: file caches, .pyc
            times, torch_seen = [], False
            for _ in range(args.repeat):
                elapsed, imported = runner()
                times.append(elapsed)
                torch_seen = torch_seen or imported
            rows.append((name, statistics.median(times), min(times), torch_seen))
        with srv.sync_client() as client:
            for key in client.scan_iter(match="tensordict:{bench-cli}*"):
                client.delete(key)

    print(f"tdstore command start-up, {args.server} {srv.version}, median of {args.repeat} runs "
          f"(python {sys.version.split()[0]}, load average {os.getloadavg()[0]:.2f})")
    print(f"{'command':<44} {'median':>8} {'min':>8}  torch  goal<{GOAL_S}s")
    for name, median, low, torch_seen in rows:
        goal = "" if name.startswith(("python", "import")) else ("yes" if median < GOAL_S else "NO")
        print(f"{name:<44} {median:>7.3f}s {low:>7.3f}s  {'yes' if torch_seen else 'no':<5}  {goal}")


if __name__ == "__main__":
    main()
