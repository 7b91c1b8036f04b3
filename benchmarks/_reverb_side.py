"""The Reverb half of ``bench_replay.py``: run by that script in Reverb's own Python, never imported by tdstore.

Reverb (dm-reverb 0.14, TensorFlow 2.15, numpy < 2) lives in a separate venv::

    python3.11 -m venv /tmp/reverb_venv
    /tmp/reverb_venv/bin/pip install dm-reverb==0.14.0 'tensorflow==2.15.*' 'numpy<2'

``bench_replay.py`` starts this script as ``unshare --net --map-root-user PYTHON _reverb_side.py``
with a JSON spec on stdin, and reads one line ``RESULT_JSON {...}`` from its stdout (all
else it prints goes to stderr). Reverb's gRPC server always listens on ``[::]:port``
(every interface); in the private network namespace the only interface is loopback, so
the server cannot be reached from outside this process tree. This script brings ``lo``
up in that namespace and refuses to start the server if any other interface is there
(unless the spec says ``allow_any_interface``).

One server, two tables of ``rows`` items, each item one row (one step: obs uint8, action
int64, reward float32), both with ``remover=Fifo()`` and ``rate_limiter=MinSize(1)``:
``uniform`` (``selectors.Uniform()``) and ``prio`` (``selectors.Prioritized(alpha)``).
The fill writes every row once and makes an item of it in both tables (the tables share
the chunk); the timed inserts then write to ``uniform`` only.

Cases (times from ``time.perf_counter``, one timed run = ``ops`` operations or one insert
run; the driver takes the medians):

* ``insert1`` / ``insert4``: ``client.trajectory_writer(num_keep_alive_refs=1)`` (so each
  step is its own chunk and a sample fetches one row, not a chunk of several); per
  16-row batch: 16 ``append`` + 16 ``create_item`` then ``flush()`` (the batch is on the
  server when the call returns, as after tdstore's ``extend``). ``insert1_stream``: the
  same without the per-batch ``flush()`` (one at the end of the run: Reverb streams the
  steps, its fastest way to insert). 4 writers are 4 spawned
  processes, each with its own client, started together at a barrier.
* ``uniform_ds``: ``reverb.TrajectoryDataset(max_in_flight_samples_per_worker=256)``
  ``.batch(256)``, ``next(it)`` and ``.numpy()`` of every field (the C++ sampler,
  streaming; samples are requested ahead of the consumer).
* ``uniform_client``: ``client.sample(table, 256, emit_timesteps=False)`` (its default
  ``buffer_size=1``) and ``np.stack`` of each field into a batch.
* ``prio_ds`` / ``prio_client``: the same on the ``prio`` table, then the importance
  weights ``(N * P) ** -beta / max`` from the sample's info (what tdstore returns as
  ``_weight``), then ``client.mutate_priorities("prio", updates={key: priority})`` of the
  256 keys.
"""

from __future__ import annotations

import fcntl
import json
import multiprocessing as mp
import os
import socket
import struct
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

KEYS = ("obs", "action", "reward")


def log(msg: str) -> None:
    print(f"[reverb] {msg}", file=sys.stderr, flush=True)


def loopback_up() -> list[str]:
    """Sets ``lo`` up (a fresh network namespace has it down); returns the interfaces."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sh", fcntl.ioctl(s, siocgifflags, struct.pack("16sh", b"lo", 0)))[1]
        if not flags & iff_up:
            fcntl.ioctl(s, siocsifflags, struct.pack("16sh", b"lo", flags | iff_up))
    return sorted(name for _, name in socket.if_nameindex())


def make_batch(np, batch: int, obs_shape: list[int], seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.integers(0, 256, size=(batch, *obs_shape), dtype=np.uint8),
        "action": rng.integers(0, 18, size=(batch,), dtype=np.int64),
        "reward": rng.random(batch, dtype=np.float32),
    }


def write_batch(writer, data: dict, tables: tuple[str, ...], flush: bool = True) -> None:
    n = len(data["action"])
    for i in range(n):
        writer.append({k: data[k][i] for k in KEYS})
        traj = {k: writer.history[k][-1] for k in KEYS}
        for t in tables:
            writer.create_item(t, 1.0, traj)
    if flush:
        writer.flush()


def writer_runs(address: str, spec: dict, seed: int, barrier, out, flush_each: bool = True) -> None:
    """One writer: ``warmup + repeat`` runs of ``insert_batches`` batches, each started at the barrier."""
    try:
        import numpy as np
        import reverb

        client = reverb.Client(address)
        data = make_batch(np, spec["batch"], spec["obs_shape"], seed)
        runs = []
        with client.trajectory_writer(num_keep_alive_refs=1) as writer:
            write_batch(writer, data, ("uniform",))  # connects the streams
            for _ in range(spec["warmup"] + spec["repeat"]):
                if barrier is not None:
                    barrier.wait(timeout=120)
                t0 = time.perf_counter()
                for _ in range(spec["insert_batches"]):
                    write_batch(writer, data, ("uniform",), flush=flush_each)
                writer.flush()
                runs.append((t0, time.perf_counter()))
        out.put({"seed": seed, "runs": runs})
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out.put({"seed": seed, "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()})
        if barrier is not None:
            barrier.abort()


def insert_case(address: str, spec: dict, writers: int, flush_each: bool = True) -> list[float]:
    """Items/s of each timed run, all writers together (first start to last end)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    if writers == 1:
        writer_runs(address, spec, 1, None, out, flush_each)
        results = [out.get(timeout=10)]
    else:
        barrier = ctx.Barrier(writers)
        procs = [
            ctx.Process(target=writer_runs, args=(address, spec, 100 + w, barrier, out, flush_each))
            for w in range(writers)
        ]
        for p in procs:
            p.start()
        try:
            results = [out.get(timeout=spec["timeout_s"]) for _ in procs]
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join(5)
    errors = [r for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"writer failed: {errors[0]['error']}\n{errors[0]['tb']}")
    items = writers * spec["insert_batches"] * spec["batch"]
    rates = []
    for r in range(spec["warmup"], spec["warmup"] + spec["repeat"]):
        t0 = min(res["runs"][r][0] for res in results)
        t1 = max(res["runs"][r][1] for res in results)
        rates.append(items / (t1 - t0))
    return rates


def serve(rows: int, alpha: float, port_q, stop) -> None:
    """The Reverb server process: two tables, until ``stop`` is set."""
    try:
        import reverb

        def table(name: str, sampler) -> reverb.Table:
            return reverb.Table(
                name=name,
                sampler=sampler,
                remover=reverb.selectors.Fifo(),
                max_size=rows,
                rate_limiter=reverb.rate_limiters.MinSize(1),
            )

        server = reverb.Server(
            tables=[table("uniform", reverb.selectors.Uniform()), table("prio", reverb.selectors.Prioritized(alpha))]
        )
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        port_q.put(f"server did not start: {type(exc).__name__}: {exc}")
        return
    port_q.put(server.port)
    try:
        stop.wait(24 * 3600)
    finally:
        server.stop()


def weights(np, probability, table_size, beta: float):
    w = (table_size.astype(np.float64) * probability) ** -beta
    return (w / w.max()).astype(np.float32)


def main() -> None:
    spec = json.loads(sys.stdin.read())
    result: dict = {"cases": {}, "notes": [], "errors": {}}
    try:
        interfaces = loopback_up()
    except OSError as exc:
        interfaces = sorted(name for _, name in socket.if_nameindex())
        log(f"could not set lo up: {exc}")
    result["interfaces"] = interfaces
    if interfaces != ["lo"] and not spec.get("allow_any_interface"):
        result["errors"]["setup"] = (
            f"not in a private network namespace (interfaces {interfaces}); Reverb's server listens on [::] "
            "and would be reachable from outside: refusing (run through `unshare --net --map-root-user`)"
        )
        print("RESULT_JSON " + json.dumps(result), flush=True)
        return

    import numpy as np
    import reverb
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(spec.get("tf_threads", 2))
    tf.config.threading.set_intra_op_parallelism_threads(spec.get("tf_threads", 2))
    import importlib.metadata as md

    result["versions"] = {
        "dm-reverb": md.version("dm-reverb"),
        "tensorflow": tf.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
    }
    rows, n_sample, obs_shape = spec["rows"], spec["sample"], spec["obs_shape"]
    alpha, beta = spec["alpha"], spec["beta"]
    deadline = time.monotonic() + spec["timeout_s"]

    # the server in a process of its own: a Reverb client in the server's process reads the
    # tables directly, without gRPC, which a real learner / actor never does
    ctx = mp.get_context("spawn")
    port_q, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve, args=(rows, alpha, port_q, stop), name="reverb-server")
    server.start()
    try:
        port = port_q.get(timeout=120)
        if isinstance(port, str):
            raise RuntimeError(port)
        address = f"localhost:{port}"
        result["address"] = f"[::]:{port} in a private network namespace (interfaces: {', '.join(interfaces)})"
        client = reverb.Client(address)
        # fill: every row once, an item of it in both tables (they share the chunk)
        t0 = time.perf_counter()
        fill = make_batch(np, 256, obs_shape, 0)
        with client.trajectory_writer(num_keep_alive_refs=1) as writer:
            done = 0
            while done < rows:
                part = {k: v[: min(256, rows - done)] for k, v in fill.items()}
                write_batch(writer, part, ("uniform", "prio"))
                done += len(part["action"])
                if time.monotonic() > deadline:
                    raise TimeoutError(f"fill took too long ({done} of {rows} rows)")
        info = client.server_info()
        result["fill_s"] = time.perf_counter() - t0
        result["table_sizes"] = {name: int(t.current_size) for name, t in info.items()}
        log(f"filled {rows} rows in {result['fill_s']:.1f} s: {result['table_sizes']}")

        def run(name: str, fn) -> None:
            if name not in spec["cases"]:
                return
            if time.monotonic() > deadline:
                result["errors"][name] = "skipped: the Reverb side ran out of time"
                return
            log(f"case {name}")
            try:
                result["cases"][name] = fn()
            except Exception as exc:  # noqa: BLE001 - reported, the other cases go on
                result["errors"][name] = f"{type(exc).__name__}: {exc}"
                log(traceback.format_exc())

        def per_op(fn) -> list[float]:
            for _ in range(spec["warmup"]):
                fn()
            runs = []
            for _ in range(spec["repeat"]):
                t = time.perf_counter()
                for _ in range(spec["ops"]):
                    fn()
                runs.append((time.perf_counter() - t) / spec["ops"])
            return runs

        run("insert1", lambda: {"items_per_s": insert_case(address, spec, 1)})
        run("insert1_stream", lambda: {"items_per_s": insert_case(address, spec, 1, flush_each=False)})
        run("insert4", lambda: {"items_per_s": insert_case(address, spec, spec["writers"])})

        dtypes = {"obs": tf.uint8, "action": tf.int64, "reward": tf.float32}
        shapes = {"obs": tf.TensorShape(obs_shape), "action": tf.TensorShape([]), "reward": tf.TensorShape([])}

        def dataset_iter(table_name: str):
            ds = reverb.TrajectoryDataset(
                server_address=address,
                table=table_name,
                dtypes=dtypes,
                shapes=shapes,
                max_in_flight_samples_per_worker=n_sample,
                rate_limiter_timeout_ms=30_000,
            )
            return iter(ds.batch(n_sample, drop_remainder=True))

        def uniform_ds() -> dict:
            it = dataset_iter("uniform")

            def once() -> None:
                s = next(it)
                out = {k: s.data[k].numpy() for k in KEYS}
                assert out["obs"].shape == (n_sample, *obs_shape)

            return {"s_per_op": per_op(once)}

        def uniform_client() -> dict:
            def once() -> None:
                items = list(client.sample("uniform", num_samples=n_sample, emit_timesteps=False))
                out = {k: np.stack([it.data[j] for it in items]) for j, k in enumerate(sorted(KEYS))}
                assert out["obs"].shape == (n_sample, *obs_shape)

            return {"s_per_op": per_op(once)}

        rng = np.random.default_rng(1)

        def prio_ds() -> dict:
            it = dataset_iter("prio")

            def once() -> None:
                s = next(it)
                out = {k: s.data[k].numpy() for k in KEYS}
                keys = s.info.key.numpy()
                w = weights(np, s.info.probability.numpy(), s.info.table_size.numpy(), beta)
                assert out["obs"].shape == (n_sample, *obs_shape) and w.shape == (n_sample,)
                client.mutate_priorities(
                    "prio", updates=dict(zip(keys.tolist(), rng.random(n_sample).tolist(), strict=True))
                )

            return {"s_per_op": per_op(once)}

        def prio_client() -> dict:
            def once() -> None:
                items = list(client.sample("prio", num_samples=n_sample, emit_timesteps=False))
                out = {k: np.stack([it.data[j] for it in items]) for j, k in enumerate(sorted(KEYS))}
                keys = [it.info.key for it in items]
                prob = np.array([it.info.probability for it in items])
                size = np.array([it.info.table_size for it in items])
                w = weights(np, prob, size, beta)
                assert out["obs"].shape == (n_sample, *obs_shape) and w.shape == (n_sample,)
                client.mutate_priorities("prio", updates=dict(zip(keys, rng.random(n_sample).tolist(), strict=True)))

            return {"s_per_op": per_op(once)}

        run("uniform_ds", uniform_ds)
        run("uniform_client", uniform_client)
        run("prio_ds", prio_ds)
        run("prio_client", prio_client)
        result["table_sizes_after"] = {name: int(t.current_size) for name, t in client.server_info().items()}
    except Exception as exc:  # noqa: BLE001 - reported to the driver
        result["errors"]["setup"] = f"{type(exc).__name__}: {exc}"
        log(traceback.format_exc())
    finally:
        stop.set()
        server.join(60)
        if server.is_alive():
            server.kill()
            server.join(10)
    print("RESULT_JSON " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
