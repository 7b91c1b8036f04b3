"""Replay buffer: tdstore against DeepMind Reverb, side by side in one run (issue 26, item 6).

    PYTHONPATH=. python benchmarks/bench_replay.py [--quick] [--reverb-python PATH]

The workload of the issue: a ring of ``--rows`` rows (default 100,000) of 21 KB, obs
uint8[84, 84, 3], action int64, reward float32, filled first (random bytes) so that every
sample draws from a full buffer. Each system runs on its own, one after the other (the
machine has few cores): tdstore first, on a private server (``--server``, default valkey)
over ``--transport`` (default tcp: Reverb's gRPC runs over TCP loopback too); then Reverb,
in its own venv; then TorchRL's in-process buffer, for reference.

Cases (tdstore | Reverb):

1. insert, 1 writer, 16-row batches, items/s: ``store.extend(td16)`` | a
   ``client.trajectory_writer(num_keep_alive_refs=1)``: 16 ``append`` + ``create_item``,
   then ``flush()`` (so the batch is on the server when the call returns, as after ``extend``);
   also shown: Reverb without the per-batch flush (streaming, one flush per run).
2. insert, 4 writers: 4 spawned processes, each its own handle / client, started together at
   a barrier; total items / (last end - first start).
3. uniform sample of 256, ms per batch: ``store.sample(256)`` | Reverb's best sampler, a
   ``reverb.TrajectoryDataset(max_in_flight_samples_per_worker=256).batch(256)`` (the C++
   sampler, streaming: it requests samples ahead of the consumer), ``next()`` + ``.numpy()``.
   Also shown: Reverb's plain ``client.sample(table, 256)`` (``buffer_size=1``) + ``np.stack``,
   and tdstore drawing ahead as Reverb's dataset does: ``next()`` of a
   ``tdstore.replay.Prefetcher(store, 256, in_flight=--in-flight)`` (threads of the client).
4. prioritized round, ms: ``store.sample(256, prioritized=True, return_info=True)`` then
   ``store.update_priority(info["index"], p, generation=info["generation"])`` | the same
   dataset on a ``selectors.Prioritized(0.6)`` table, the importance weights from the
   sample's info, then ``client.mutate_priorities(table, updates={key: p})``. Goal: tdstore
   <= 1.0x Reverb's time (moonshot 0.5x). Note that Reverb's dataset samples ahead, so its
   updates apply to rows drawn up to one batch earlier; tdstore's round is synchronous. The
   round through a ``Prefetcher(prioritized=True)`` samples ahead too (its updates reach the
   batches drawn after them, as Reverb's do).
5. server CPU (tdstore only) of a prioritized sample of 256 against a uniform sample of the
   same store: the deltas of ``used_cpu_sys_main_thread + used_cpu_user_main_thread`` in
   ``INFO cpu`` over ``--cpu-ops`` calls, divided by the calls. Goal <= 2x. And the
   prioritized sample's server CPU on a ring of ``--big-rows`` (default 1,000,000) against
   one of 100,000 rows: with narrow rows (obs uint8[8]; 1M rows of 21 KB would be 21 GB),
   every row marked written with ``set_ring_total`` and given varied priorities. Goal <= 1.5x.
6. TorchRL (``_torchrl_side.py``, run with ``--torchrl-path`` first on PYTHONPATH, since
   TorchRL 0.14.1 needs tensordict < 0.15): ``ReplayBuffer(LazyTensorStorage(rows))`` with
   ``RandomSampler`` and ``PrioritizedSampler`` (whose C++ extension may not load).

Reverb (``_reverb_side.py``) runs in the Python of ``--reverb-python`` (default: $REVERB_PYTHON,
else /tmp/reverb_venv/bin/python), as ``unshare --net --map-root-user``: Reverb's server always
listens on ``[::]``, and in a private network namespace only loopback exists. Its server runs
in a process of its own (a client in the server's process would bypass gRPC). Two tables of
``--rows`` items (one item per row), ``remover=Fifo()``, ``rate_limiter=MinSize(1)``,
``Uniform()`` and ``Prioritized(0.6)``. Without Reverb the bench prints how to install it
and shows its column as missing.

Ratios are tdstore time / Reverb time (for throughputs: Reverb items/s / tdstore items/s):
lower is better for tdstore. Cells are medians over ``--repeat`` timed runs (each of
``--ops`` operations, or of ``--insert-batches`` batches per writer), after ``--warmup``.

``--rounds N`` runs both systems N times, in the order tdstore, Reverb, then Reverb, tdstore
(ABBA), so that load that drifts during the run weighs on both alike. It prints each round's
main ratios, taken between the two runs next to each other in time, and then the table over
every round's timed runs (a single figure such as a server CPU: the median of the rounds').
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import bench_server, load_average, server_banner, server_cpu  # noqa: E402
from tensordict import TensorDict  # noqa: E402

import tdstore  # noqa: E402
from tdstore import TensorDictStore  # noqa: E402
from tdstore.replay import Prefetcher  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OBS = [84, 84, 3]
ALPHA, BETA = 0.6, 0.4
INSTALL = (
    "python3.11 -m venv /tmp/reverb_venv && "
    "/tmp/reverb_venv/bin/pip install dm-reverb==0.14.0 'tensorflow==2.15.*' 'numpy<2'"
)


def schema(obs: list[int]) -> dict:
    return {"obs": (obs, torch.uint8), "action": ([], torch.int64), "reward": ([], torch.float32)}


def make_batch(n: int, obs: list[int], seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        obs=torch.randint(0, 256, (n, *obs), dtype=torch.uint8, generator=g),
        action=torch.randint(0, 18, (n,), generator=g),
        reward=torch.rand(n, generator=g),
        batch_size=[n],
    )


def per_op(fn, args) -> list[float]:  # type: ignore[no-untyped-def]
    for _ in range(args.warmup):
        fn()
    runs = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        for _ in range(args.ops):
            fn()
        runs.append((time.perf_counter() - t) / args.ops)
    return runs


# --------------------------------------------------------------------------- #
# tdstore
# --------------------------------------------------------------------------- #


def writer_runs(conn: dict, td_id: str, spec: dict, seed: int, barrier, out) -> None:  # type: ignore[no-untyped-def]
    """One tdstore writer: ``warmup + repeat`` runs of ``insert_batches`` extends, each started at the barrier."""
    try:
        torch.set_num_threads(1)
        store = TensorDictStore.from_store(td_id=td_id, **conn)
        batch = make_batch(spec["batch"], spec["obs"], seed)
        store.extend(batch)
        runs = []
        for _ in range(spec["warmup"] + spec["repeat"]):
            if barrier is not None:
                barrier.wait(timeout=120)
            t0 = time.perf_counter()
            for _ in range(spec["insert_batches"]):
                store.extend(batch)
            runs.append((t0, time.perf_counter()))
        store.close()
        out.put({"runs": runs})
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out.put({"error": f"{type(exc).__name__}: {exc}"})
        if barrier is not None:
            barrier.abort()


def insert_rates(conn: dict, td_id: str, args, writers: int) -> list[float]:  # type: ignore[no-untyped-def]
    spec = {
        "batch": 16,
        "obs": OBS,
        "warmup": args.warmup,
        "repeat": args.repeat,
        "insert_batches": args.insert_batches,
    }
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    if writers == 1:
        writer_runs(conn, td_id, spec, 1, None, out)
        results = [out.get(timeout=10)]
    else:
        barrier = ctx.Barrier(writers)
        procs = [
            ctx.Process(target=writer_runs, args=(conn, td_id, spec, 100 + w, barrier, out)) for w in range(writers)
        ]
        for p in procs:
            p.start()
        try:
            results = [out.get(timeout=args.timeout) for _ in procs]
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join(5)
    for r in results:
        if "error" in r:
            raise RuntimeError(f"tdstore writer failed: {r['error']}")
    items = writers * spec["insert_batches"] * spec["batch"]
    return [
        items / (max(r["runs"][i][1] for r in results) - min(r["runs"][i][0] for r in results))
        for i in range(args.warmup, args.warmup + args.repeat)
    ]


def cpu_per_op(client, fn, calls: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    c0 = server_cpu(client)
    for _ in range(calls):
        fn()
    return (server_cpu(client) - c0) / calls


def tdstore_side(args) -> dict:  # type: ignore[no-untyped-def]
    res: dict = {"cases": {}, "errors": {}}
    g = torch.Generator().manual_seed(0)
    with bench_server(args.server) as srv:
        res["banner"] = server_banner(srv)
        conn = srv.connection_kwargs(unix=args.transport == "unix")
        client = srv.sync_client(unix=True)
        store = TensorDictStore.from_schema(schema(OBS), batch_size=[args.rows], chunk_bytes=64 * 2**20, **conn)
        try:
            t0 = time.perf_counter()
            fill = make_batch(256, OBS, 0)
            done = 0
            while done < args.rows:
                k = min(256, args.rows - done)
                store.extend(fill[:k])
                done += k
            res["fill_s"] = time.perf_counter() - t0
            print(f"# tdstore: filled {args.rows} rows in {res['fill_s']:.1f} s", flush=True)
            res["cases"]["insert1"] = insert_rates(conn, store.td_id, args, 1)
            print("# tdstore: insert, 1 writer done", flush=True)
            res["cases"]["insert4"] = insert_rates(conn, store.td_id, args, args.writers)
            print(f"# tdstore: insert, {args.writers} writers done", flush=True)
            res["cases"]["uniform"] = per_op(lambda: store.sample(256, generator=g), args)
            with Prefetcher(store, 256, in_flight=args.in_flight, generator=g) as ahead:
                res["cases"]["uniform_pf"] = per_op(lambda: next(ahead), args)
            store.enable_priorities(alpha=ALPHA, beta=BETA, eps=1e-8)
            for _ in range(8):  # varied priorities, as after some learning
                store.update_priority(torch.randint(0, args.rows, (4096,), generator=g), torch.rand(4096, generator=g))

            def prio_round() -> None:
                _batch, info = store.sample(256, prioritized=True, return_info=True, generator=g)
                store.update_priority(info["index"], torch.rand(256, generator=g), generation=info["generation"])

            res["cases"]["prio"] = per_op(prio_round, args)
            with Prefetcher(store, 256, prioritized=True, in_flight=args.in_flight, generator=g) as ahead:

                def prio_round_ahead() -> None:
                    _batch, info = next(ahead)
                    store.update_priority(info["index"], torch.rand(256, generator=g), generation=info["generation"])

                res["cases"]["prio_pf"] = per_op(prio_round_ahead, args)
            res["cases"]["prio_sample"] = per_op(
                lambda: store.sample(256, prioritized=True, return_info=True, generator=g), args
            )
            print("# tdstore: sampling done", flush=True)
            calls = args.cpu_ops
            res["cases"]["cpu_uniform"] = cpu_per_op(client, lambda: store.sample(256, generator=g), calls)
            res["cases"]["cpu_prio"] = cpu_per_op(
                client, lambda: store.sample(256, prioritized=True, return_info=True, generator=g), calls
            )
        finally:
            store.clear_redis()
            store.close()
        # prioritized sample's server CPU: --big-rows against 100,000 narrow rows
        if args.big_rows:
            narrow = {}
            for rows in (args.small_rows, args.big_rows):
                s = TensorDictStore.from_schema(schema([8]), batch_size=[rows], **conn)
                try:
                    s.set_ring_total(rows)  # every row counts as written
                    s.enable_priorities(alpha=ALPHA, beta=BETA, eps=1e-8)
                    for _ in range(16):
                        s.update_priority(
                            torch.randint(0, rows, (4096,), generator=g), torch.rand(4096, generator=g) * 10
                        )
                    narrow[rows] = cpu_per_op(
                        client, lambda s=s: s.sample(256, prioritized=True, return_info=True, generator=g), calls
                    )
                finally:
                    s.clear_redis()
                    s.close()
            res["cases"]["cpu_narrow"] = narrow
        client.close()
    return res


# --------------------------------------------------------------------------- #
# the other sides: subprocesses with a JSON spec on stdin, one RESULT_JSON line back
# --------------------------------------------------------------------------- #


def run_side(argv: list[str], spec: dict, timeout: float, env: dict | None = None) -> dict:
    """Runs ``argv`` in its own session; kills that session (only it) on timeout."""
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
        cwd=HERE,
    )
    try:
        stdout, stderr = proc.communicate(json.dumps(spec), timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        return {"errors": {"setup": f"timed out after {timeout:.0f} s (killed)"}, "cases": {}}
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT_JSON "):
            return json.loads(line[len("RESULT_JSON ") :])
    tail = "\n".join((stderr or "").strip().splitlines()[-8:])
    return {"errors": {"setup": f"exit {proc.returncode}, no result; stderr tail:\n{tail}"}, "cases": {}}


def reverb_python(args) -> str | None:  # type: ignore[no-untyped-def]
    path = args.reverb_python or os.environ.get("REVERB_PYTHON")
    if not path and os.path.exists("/tmp/reverb_venv/bin/python"):
        path = "/tmp/reverb_venv/bin/python"
    return path if path and os.path.exists(path) else None


def reverb_side(args) -> dict:  # type: ignore[no-untyped-def]
    py = reverb_python(args)
    if py is None:
        return {
            "missing": f"no Reverb python found (--reverb-python, $REVERB_PYTHON, /tmp/reverb_venv). Install: {INSTALL}"
        }
    check = subprocess.run([py, "-c", "import reverb"], capture_output=True, text=True, timeout=120)
    if check.returncode:
        return {"missing": f"{py} cannot import reverb ({check.stderr.strip().splitlines()[-1:]}). Install: {INSTALL}"}
    argv = [py, os.path.join(HERE, "_reverb_side.py")]
    if not args.reverb_any_interface:
        if shutil.which("unshare") is None:
            return {
                "missing": "`unshare` not found: cannot keep Reverb's [::] server off the network (--reverb-any-interface)"
            }
        argv = ["unshare", "--net", "--map-root-user", *argv]
    spec = {
        "rows": args.rows,
        "batch": 16,
        "sample": 256,
        "obs_shape": OBS,
        "alpha": ALPHA,
        "beta": BETA,
        "warmup": args.warmup,
        "repeat": args.repeat,
        "ops": args.ops,
        "insert_batches": args.insert_batches,
        "writers": args.writers,
        "timeout_s": args.timeout,
        "allow_any_interface": args.reverb_any_interface,
        "cases": ["insert1", "insert1_stream", "insert4", "uniform_ds", "uniform_client", "prio_ds", "prio_client"],
    }
    return run_side(argv, spec, args.timeout + 60)


def torchrl_side(args) -> dict:  # type: ignore[no-untyped-def]
    env = dict(os.environ)
    if args.torchrl_path:
        env["PYTHONPATH"] = args.torchrl_path
    else:
        env.pop("PYTHONPATH", None)
    spec = {
        "rows": args.rows,
        "sample": 256,
        "obs_shape": OBS,
        "alpha": ALPHA,
        "beta": BETA,
        "warmup": args.warmup,
        "repeat": args.repeat,
        "ops": args.ops,
    }
    return run_side([sys.executable, os.path.join(HERE, "_torchrl_side.py")], spec, args.timeout, env=env)


# --------------------------------------------------------------------------- #
# output
# --------------------------------------------------------------------------- #


def med(x) -> float | None:  # type: ignore[no-untyped-def]
    return statistics.median(x) if x else None


def ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f} ms"


def rate(r: float | None) -> str:
    return "-" if r is None else f"{r:,.0f} items/s"


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def met(x: float | None, goal: float | None) -> str:
    if goal is None:
        return ""
    if x is None:
        return "?"
    return "yes" if x <= goal else "NO"


def table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    sys.stdout.flush()


def pooled(results: list[dict]) -> dict:
    """The results of one side over every round, as one: the timed runs of each case
    together, a single figure (a server CPU per call, a fill time) the median of the rounds',
    anything else (a banner, an error) the first round's."""

    def merge(values: list) -> object:  # type: ignore[type-arg]
        first = values[0]
        if isinstance(first, dict):
            names = dict.fromkeys(k for v in values for k in v)
            return {k: merge([v[k] for v in values if k in v]) for k in names}
        if isinstance(first, list):
            return [x for v in values for x in v]
        if isinstance(first, (int, float)) and not isinstance(first, bool):
            return first if all(v == first for v in values) else statistics.median(values)
        return first

    return merge(results)  # type: ignore[return-value]


def round_line(k: int, td: dict, rv: dict) -> str:
    """One round's main ratios (tdstore / Reverb's dataset; the server-CPU ratio tdstore's own)."""
    c, rc = td.get("cases", {}), rv.get("cases", {})

    def against(ours: str, theirs: str) -> str:
        a, b = med(c.get(ours)), med(rc.get(theirs, {}).get("s_per_op"))
        return f"{ms(a)} / {ms(b)} = {ratio(a / b if a and b else None)}"

    cu, cp = c.get("cpu_uniform"), c.get("cpu_prio")
    cpu = ratio(cp / cu) if cu and cp else "-"
    return (
        f"# round {k}: uniform {against('uniform', 'uniform_ds')}; prioritized round {against('prio', 'prio_ds')}; "
        f"drawn ahead {against('prio_pf', 'prio_ds')}; server CPU prioritized / uniform {cpu}"
    )


def report(args, td: dict, rv: dict, trl: dict) -> None:  # type: ignore[no-untyped-def]
    c, rc, tc = td.get("cases", {}), rv.get("cases", {}), trl.get("cases", {})

    def rv_rate(name: str) -> float | None:
        return med(rc.get(name, {}).get("items_per_s"))

    def rv_s(name: str) -> float | None:
        return med(rc.get(name, {}).get("s_per_op"))

    def thr(ours: float | None, theirs: float | None) -> float | None:
        return theirs / ours if ours and theirs else None

    def tim(ours: float | None, theirs: float | None) -> float | None:
        return ours / theirs if ours and theirs else None

    rows: list[list[str]] = []
    i1, r1 = med(c.get("insert1")), rv_rate("insert1")
    x = thr(i1, r1)
    rows.append(["1. insert 16-row batches, 1 writer", rate(i1), rate(r1), ratio(x), "<= 0.67x", met(x, 0.67)])
    r1s = rv_rate("insert1_stream")
    rows.append(
        [
            "   insert, 1 writer (Reverb: no flush per batch, streaming)",
            rate(i1),
            rate(r1s),
            ratio(thr(i1, r1s)),
            "",
            "",
        ]
    )
    i4, r4 = med(c.get("insert4")), rv_rate("insert4")
    x = thr(i4, r4)
    rows.append(
        [f"2. insert 16-row batches, {args.writers} writers (total)", rate(i4), rate(r4), ratio(x), "<= 0.67x", met(x, 0.67)]
    )
    u, ud, uc = med(c.get("uniform")), rv_s("uniform_ds"), rv_s("uniform_client")
    x = tim(u, ud)
    rows.append(
        ["3. uniform sample 256 (Reverb: TrajectoryDataset, 256 in flight)", ms(u), ms(ud), ratio(x), "<= 0.67x", met(x, 0.67)]
    )
    upf = med(c.get("uniform_pf"))
    x = tim(upf, ud)
    rows.append(
        [
            f"   uniform, tdstore Prefetcher(in_flight={args.in_flight}) (Reverb: dataset)",
            ms(upf),
            ms(ud),
            ratio(x),
            "<= 0.67x",
            met(x, 0.67),
        ]
    )
    rows.append(
        ["   uniform sample 256 (Reverb: client.sample, buffer_size=1)", ms(u), ms(uc), ratio(tim(u, uc)), "", ""]
    )
    p, pd, pc = med(c.get("prio")), rv_s("prio_ds"), rv_s("prio_client")
    x = tim(p, pd)
    rows.append(
        [
            "4. prioritized round: sample 256 + update 256 (Reverb: dataset)",
            ms(p),
            ms(pd),
            ratio(x),
            "<= 1.0x (0.5x)",
            met(x, 1.0) + (" (moonshot met)" if x is not None and x <= 0.5 else ""),
        ]
    )
    ppf = med(c.get("prio_pf"))
    x = tim(ppf, pd)
    rows.append(
        [
            f"   prioritized round, tdstore Prefetcher(in_flight={args.in_flight}) (Reverb: dataset)",
            ms(ppf),
            ms(pd),
            ratio(x),
            "<= 1.0x (0.5x)",
            met(x, 1.0),
        ]
    )
    x = tim(p, pc)
    rows.append(["   prioritized round (Reverb: client.sample)", ms(p), ms(pc), ratio(x), "<= 1.0x", met(x, 1.0)])
    cu, cp = c.get("cpu_uniform"), c.get("cpu_prio")
    x = cp / cu if cu and cp else None
    rows.append(
        [
            "5. server CPU, prioritized / uniform sample 256 (tdstore)",
            f"{ms(cp)} / {ms(cu)}",
            "n/a",
            ratio(x),
            "<= 2.0x",
            met(x, 2.0),
        ]
    )
    nar = {int(k): v for k, v in c.get("cpu_narrow", {}).items()}
    if nar:
        big, small = nar.get(args.big_rows), nar.get(args.small_rows)
        x = big / small if big and small else None
        rows.append(
            [
                f"   server CPU, prio sample 256, {args.big_rows:,} / {args.small_rows:,} rows of obs uint8[8]",
                f"{ms(big)} / {ms(small)}",
                "n/a",
                ratio(x),
                "<= 1.5x",
                met(x, 1.5),
            ]
        )
    tu, tp = med(tc.get("uniform", {}).get("s_per_op")), med(tc.get("prio", {}).get("s_per_op"))
    rows.append(
        [
            "6. TorchRL in-process uniform sample 256 (RandomSampler)",
            ms(u),
            ms(tu),
            f"{ratio(tim(u, tu))} vs TorchRL" if tu else "-",
            "",
            "",
        ]
    )
    tp_err = trl.get("errors", {}).get("prio") or trl.get("errors", {}).get("setup") or "-"
    tp_cell = ms(tp) if tp else ("does not load (see below)" if tp_err.startswith("does not load") else tp_err[:60])
    rows.append(
        [
            "   TorchRL in-process prioritized round (PrioritizedSampler)",
            ms(p),
            tp_cell,
            f"{ratio(tim(p, tp))} vs TorchRL" if tp else "-",
            "",
            "",
        ]
    )

    if "missing" in rv:  # Reverb's column: say why it is empty
        for row in rows[:9]:  # cases 1-4 (5 and 6 are not Reverb's)
            if row[2] == "-":
                row[2] = "missing (see below)"
    print()
    print(
        f"### Replay buffer: {args.rows:,} rows of 21 KB (obs uint8[84,84,3], action, reward); medians; "
        f"ratio = tdstore time / other time (lower is better for tdstore)"
    )
    print()
    table(["case", "tdstore", "reverb", "ratio", "goal", "met?"], rows)
    print()
    print(
        f"# tdstore: {tdstore.__file__}; {td.get('banner', '')}; transport {args.transport}; "
        f"fill {td.get('fill_s', 0):.1f} s"
    )
    if "missing" in rv:
        print(f"# REVERB COLUMN MISSING: {rv['missing']}")
    else:
        print(
            f"# reverb: {rv.get('versions')}; server {rv.get('address')}, own process; tables {rv.get('table_sizes')}; "
            f"fill {rv.get('fill_s', 0):.1f} s"
        )
    for side, res in (("tdstore", td), ("reverb", rv), ("torchrl", trl)):
        for name, err in res.get("errors", {}).items():
            print(f"# {side} {name}: {err[:400]}")
    if trl.get("versions"):
        print(f"# torchrl side: {trl['versions']} (in-process, no server)")
    if c.get("prio_sample"):
        print(f"# tdstore prioritized sample alone (no update): {ms(med(c['prio_sample']))}")
    print(f"# load average after the run: {load_average()} on {os.cpu_count()} CPUs")


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="valkey", choices=("valkey", "redis", "redis6"))
    parser.add_argument("--transport", default="tcp", choices=("tcp", "unix"), help="tdstore's transport (default tcp)")
    parser.add_argument("--rows", type=int, default=100_000, help="ring rows (default 100000, 2.1 GB per system)")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs per case (default 7)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
    parser.add_argument("--ops", type=int, default=10, help="operations per timed run of a sampling case (default 10)")
    parser.add_argument("--insert-batches", type=int, default=50, help="16-row batches per writer per run (default 50)")
    parser.add_argument("--writers", type=int, default=4, help="writer processes of case 2 (default 4)")
    parser.add_argument(
        "--in-flight", type=int, default=2,
        help="samples a tdstore Prefetcher draws ahead in the prefetched cases (default 2: its best here, docs/replay.md)",
    )
    parser.add_argument("--cpu-ops", type=int, default=100, help="calls per server CPU measurement (default 100)")
    parser.add_argument("--big-rows", type=int, default=1_000_000, help="large ring of the CPU scaling case (0: skip)")
    parser.add_argument("--small-rows", type=int, default=100_000, help="small ring of the CPU scaling case")
    parser.add_argument(
        "--reverb-python", default=None, help="Reverb venv python (default $REVERB_PYTHON or /tmp/reverb_venv)"
    )
    parser.add_argument(
        "--reverb-any-interface",
        action="store_true",
        help="run Reverb without a private network namespace (its server then listens on every interface)",
    )
    parser.add_argument(
        "--torchrl-path",
        default="/tmp/td014" if os.path.isdir("/tmp/td014") else None,
        help="PYTHONPATH for the TorchRL side (default /tmp/td014 where it exists)",
    )
    parser.add_argument("--no-torchrl", action="store_true", help="skip the TorchRL reference")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed per side (default 900)")
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of both systems, in ABBA order (default 1; see the docstring)"
    )
    parser.add_argument("--quick", action="store_true", help="10,000 rows, 3 runs, fewer ops")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.repeat, args.warmup, args.ops = min(args.rows, 10_000), 3, 1, 5
        args.insert_batches, args.cpu_ops, args.timeout = 20, 30, min(args.timeout, 400)
    if min(args.rows, args.repeat, args.ops, args.insert_batches, args.writers, args.cpu_ops, args.rounds) < 1 or args.warmup < 0:
        parser.error("counts must be >= 1 (--warmup >= 0)")
    torch.set_num_threads(1)
    print(
        f"# bench_replay: {args.rows:,} rows; load average before: {load_average()} on {os.cpu_count()} CPUs",
        flush=True,
    )
    tds: list[dict] = []
    rvs: list[dict] = []
    for k in range(args.rounds):
        for side in ("tdstore", "reverb") if k % 2 == 0 else ("reverb", "tdstore"):
            if side == "tdstore":
                tds.append(tdstore_side(args))
            else:
                print("# reverb side ...", flush=True)
                rvs.append(reverb_side(args))
    trl = {"cases": {}, "errors": {"setup": "skipped (--no-torchrl)"}} if args.no_torchrl else torchrl_side(args)
    if args.rounds > 1:
        print()
        for k, (td, rv) in enumerate(zip(tds, rvs, strict=True), 1):
            print(round_line(k, td, rv))
    report(args, pooled(tds), pooled(rvs), trl)


if __name__ == "__main__":
    main()
