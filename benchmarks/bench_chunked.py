"""Chunked entries (``chunk_bytes=``): how long the server blocks, and large-entry speed and memory.

    python benchmarks/bench_chunked.py --server valkey            # 1 GiB, about 5 min
    python benchmarks/bench_chunked.py --server valkey --quick    # 256 MiB, about 2 min

One private server, started with ``proto-max-bulk-len 2gb`` and ``client-query-buffer-limit
2gb`` (an unchunked 1 GiB entry and a raw 1 GiB SET need both) and
``lazyfree-lazy-user-del yes``. Two parts:

A. **Allocation.** ``TensorDictStore.from_schema({"obs": ([ROW_BYTES], torch.uint8)},
   batch_size=[rows])`` of one 1 GiB entry (``--quick``: 256 MiB), unchunked and with
   ``chunk_bytes`` of 4, 16 and 64 MiB. Unchunked, the commit script zero-fills the whole
   entry with one SETRANGE inside itself; chunked, each chunk grows in its own tmp key
   (separate server steps) and the commit script only renames them into place. The
   longest time the server blocks is measured two ways:

   * SLOWLOG with ``slowlog-log-slower-than 0`` (every command is logged): the longest
     entry and its command (EVALSHA = a script: the commit, or clear_redis's DEL script;
     SETRANGE = one chunk's zero-fill), the commit script's time, the longest SETRANGE;
   * a probe with its own blocking redis-py client that sends PING every
     ``--probe-interval-ms`` meanwhile: the max and p99 PING round trip (a PING that
     arrives during a blocking step waits for its end). ``--probe process`` (default) runs
     it in a separate process, ``--probe thread`` in a thread of this one (its PINGs then
     also wait for this process's GIL).

   SLOWLOG lists each command a MULTI/EXEC runs but not the EXEC that runs them all in one
   step, so the EXEC time is taken from INFO commandstats, and LATENCY LATEST (threshold
   1 ms) is shown as a cross-check of the longest step.

   Each case runs ``--alloc-warmup`` times untimed (printed, not tabled), then
   ``--alloc-repeat`` times, the cases interleaved: the first allocations on a fresh server
   touch new memory (page faults in the server), later ones reuse what was freed before.

   The same is reported for ``store.clear_redis()`` (freeing a 1 GiB string also takes
   server time; lazyfree does not help a string, which is one allocation and is freed
   in the main thread whatever the setting).

B. **One large entry, written and read.** ``store["x"] = t`` and ``store["x"]`` of a
   [16, n] float32 entry of 1 GiB (``--quick``: 256 MiB) in stores with ``chunk_bytes``
   of 64 MiB and 256 MiB (``--quick``: 16 and 64 MiB), and unchunked, against raw redis-py ``SET``/``GET`` +
   ``torch.frombuffer`` of the same bytes on the same server (cases interleaved, see
   _common.py). The client's peak extra memory is measured as in bench_large.py: the
   operation runs once more in a fresh process that reads its ``VmHWM`` before and after.
   One more overwrite and read of each store are observed as in part A (longest step,
   PING max): an overwrite of the same shape is written in place, all chunks' SETRANGEs
   in one MULTI/EXEC.

Every allocation and write is checked (chunk count and lengths on the server, the tensor
read back); a JSON line with every number ends the output.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
import torch
from _common import (
    Timing,
    base_parser,
    bench_server,
    byte_view,
    compare,
    fmt_ms,
    fmt_ratio,
    load_average,
    parse,
    print_table,
    server_banner,
    tensor_from_bytes,
    timed,
)
from bench_large import CONFIG as LARGE_CONFIG
from bench_large import _RawNoTimeout, measure_memory

from tdstore import TensorDictStore
from tdstore.server import ServerHandle

MIB = 2**20
CONFIG = {**LARGE_CONFIG, "lazyfree-lazy-user-del": "yes"}
SLOWLOG_MAX_LEN = 1_000_000
ROWS_B = 16  # batch size of part B's store: the entry is [16, n] float32
# commands of the benchmark itself, left out of "the longest step"
_OWN = {"PING", "SLOWLOG", "CONFIG", "INFO", "SCAN", "STRLEN", "CLIENT", "HELLO"}


# --------------------------------------------------------------------------- #
# observing the server while something runs
# --------------------------------------------------------------------------- #


@dataclass
class Observation:
    """What the server did while one call ran."""

    seconds: float
    slowlog: list[dict[str, Any]]  # entries other than the benchmark's own commands
    pings: list[float]  # round trips (s) of the probe's PINGs that overlapped the call
    result: Any = None
    exec_calls: int = 0  # MULTI/EXEC transactions (INFO commandstats), which SLOWLOG does not list
    exec_usec: int = 0  # their total time, including the commands they ran
    latency_ms: int = 0  # LATENCY LATEST: the longest top-level command (EXEC and scripts included), ms

    def longest(self) -> tuple[float, str]:
        """(microseconds, command) of the longest server step.

        SLOWLOG lists each command a transaction runs, but not the EXEC that runs them all
        in one step: the EXEC time comes from INFO commandstats (exact for one EXEC; for
        several, their mean, shown as "EXEC/n").
        """
        steps = [(float(e["duration"]), e["name"]) for e in self.slowlog]
        if self.exec_calls:
            name = "EXEC" if self.exec_calls == 1 else f"EXEC/{self.exec_calls}"
            steps.append((self.exec_usec / self.exec_calls, name))
        return max(steps, default=(0.0, "-"))

    def longest_of(self, name: str, key_part: str = "") -> float | None:
        """The longest ``name`` command (on a key containing ``key_part``), in microseconds.

        SLOWLOG also lists the commands a script runs (after them, the script itself):
        ``key_part=":tmp:"`` picks the SETRANGEs that grow a chunk's tmp key, which tdstore
        sends as commands of their own, not the commit script's SETRANGE of a ``d:`` key.
        """
        durations = [e["duration"] for e in self.slowlog if e["name"] == name and key_part in e["key"]]
        return float(max(durations)) if durations else None

    def count(self) -> int:
        return len(self.slowlog)

    def ping_max(self) -> float | None:
        return max(self.pings) if self.pings else None

    def ping_p99(self) -> float | None:
        if not self.pings:
            return None
        ordered = sorted(self.pings)
        return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


class _Probe:
    """A thread that PINGs the server over its own blocking client and records round trips."""

    def __init__(self, server: ServerHandle, interval: float) -> None:
        self.client = redis.Redis(unix_socket_path=server.unix_socket_path, socket_timeout=None)
        self.client.ping()
        self.interval = interval
        self.samples: list[tuple[float, float]] = []  # (sent, returned)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ping-probe", daemon=True)

    def _loop(self) -> None:
        ping = self.client.ping
        clock = time.monotonic
        while not self._stop.is_set():
            t0 = clock()
            ping()
            self.samples.append((t0, clock()))
            if self.interval:
                time.sleep(self.interval)

    def __enter__(self) -> _Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(60)
        self.client.close()

    def overlapping(self, t0: float, t1: float) -> list[float]:
        return [end - start for start, end in self.samples if start < t1 and end > t0]


_PROBE_CHILD = r"""
import json, select, sys, time
import redis
client = redis.Redis(unix_socket_path=sys.argv[1], socket_timeout=None)
client.ping()
interval = float(sys.argv[2])
print("ready", flush=True)
samples = []
while not select.select([sys.stdin], [], [], 0)[0]:
    t0 = time.monotonic()
    client.ping()
    samples.append((t0, time.monotonic()))
    if interval:
        time.sleep(interval)
print(json.dumps(samples), flush=True)
"""


class _ProbeProcess(_Probe):
    """:class:`_Probe` in a separate Python process (redis-py only): its PINGs never wait for
    this process's GIL, which tdstore's IO thread holds while it copies a large payload.
    Its clock (``time.monotonic``, CLOCK_MONOTONIC) is the same as this process's."""

    def __init__(self, server: ServerHandle, interval: float) -> None:
        self.socket, self.interval = server.unix_socket_path, interval
        self.samples = []

    def __enter__(self) -> _ProbeProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PROBE_CHILD, str(self.socket), str(self.interval)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.proc.kill()
            raise RuntimeError(f"the PING probe process did not start (said {line!r})")
        return self

    def __exit__(self, *exc: Any) -> None:
        out, _ = self.proc.communicate("stop\n", timeout=60)
        self.samples = [tuple(x) for x in json.loads(out.strip().splitlines()[-1])]


PROBES: dict[str, type[_Probe]] = {"thread": _Probe, "process": _ProbeProcess}
PROBE = {"kind": "process"}  # set by --probe


def observe(server: ServerHandle, admin: redis.Redis, fn: Callable[[], Any], probe_interval: float) -> Observation:
    """Runs ``fn()`` with every command logged by SLOWLOG and a PING probe running."""
    admin.config_set("latency-monitor-threshold", 1)
    admin.execute_command("LATENCY", "RESET")
    exec_before = admin.info("commandstats").get("cmdstat_exec", {})
    admin.config_set("slowlog-log-slower-than", 0)
    admin.slowlog_reset()
    try:
        with PROBES[PROBE["kind"]](server, probe_interval) as probe:
            time.sleep(0.05)  # the probe is running before the call starts
            t0 = time.monotonic()
            result = fn()
            t1 = time.monotonic()
            time.sleep(0.02)
        admin.config_set("slowlog-log-slower-than", 10000)
        entries = admin.execute_command("SLOWLOG", "GET", max(1, int(admin.slowlog_len())))
        exec_after = admin.info("commandstats").get("cmdstat_exec", {})
        # [[event, time, latest ms, max ms, ...], ...]
        latency = max((int(e[3]) for e in admin.execute_command("LATENCY", "LATEST")), default=0)
    finally:
        admin.config_set("slowlog-log-slower-than", 10000)
        admin.config_set("latency-monitor-threshold", 0)
    log = []
    for entry in entries:
        # raw reply: [id, start (s), duration (us), [args...], (client addr, client name)]
        args = entry[3]
        name = (args[0].decode(errors="replace") if isinstance(args[0], bytes) else str(args[0])).upper() if args else "?"
        if name in _OWN:
            continue
        key = args[1].decode(errors="replace") if len(args) > 1 and isinstance(args[1], bytes) else ""
        log.append({"name": name, "key": key, "duration": int(entry[2])})
    admin.slowlog_reset()
    return Observation(
        t1 - t0, log, probe.overlapping(t0, t1), result,
        exec_calls=int(exec_after.get("calls", 0)) - int(exec_before.get("calls", 0)),
        exec_usec=int(exec_after.get("usec", 0)) - int(exec_before.get("usec", 0)),
        latency_ms=latency,
    )


# --------------------------------------------------------------------------- #
# part A: allocation
# --------------------------------------------------------------------------- #


@dataclass
class AllocCase:
    label: str
    chunk_bytes: int | None
    allocs: list[Observation] = field(default_factory=list)
    clears: list[Observation] = field(default_factory=list)
    chunks: int = 0


def _data_keys(admin: redis.Redis, td_id: str) -> dict[str, int]:
    """{key: STRLEN} of the store's data strings (``d:`` and ``c:`` keys)."""
    out = {}
    for key in admin.scan_iter(match=f"*{{{td_id}}}:*", count=1000):
        name = key.decode()
        if ":c:" in name or ":d:" in name:
            out[name] = int(admin.strlen(key))
    return out


def _check_layout(admin: redis.Redis, keys: dict[str, int], data: memoryview, label: str) -> None:
    """Chunk k holds bytes [k * c, (k + 1) * c) of the entry: checks each string's length and
    its first and last 4 KiB against the tensor's bytes (a whole-string compare would move
    the entry once more)."""
    chunks = sorted((int(k.split(":c:")[1].split(":")[0]), k) for k in keys if ":c:" in k)
    if not chunks:
        return
    size = keys[chunks[0][1]]
    for k, key in chunks:
        start = k * size
        n = min(size, data.nbytes - start)
        assert keys[key] == n, f"{label}: {key} holds {keys[key]} bytes, expected {n}"
        for off in (0, max(0, n - 4096)):
            got = admin.getrange(key, off, min(n, off + 4096) - 1)
            assert got == data[start + off : start + min(n, off + 4096)].tobytes(), f"{label}: {key} bytes differ at {off}"


def _check_alloc(store: TensorDictStore, admin: redis.Redis, case: AllocCase, total: int, row_bytes: int) -> int:
    keys = _data_keys(admin, store.td_id)
    assert sum(keys.values()) == total, f"{case.label}: data strings hold {sum(keys.values())} bytes, expected {total}"
    chunked = [k for k in keys if ":c:" in k]
    if case.chunk_bytes is None or case.chunk_bytes >= total:
        assert not chunked and len(keys) == 1, f"{case.label}: expected one d: string, got {sorted(keys)}"
    else:
        size = (case.chunk_bytes // row_bytes) * row_bytes
        expected = -(-total // size)
        assert len(chunked) == expected == len(keys), f"{case.label}: {len(chunked)} chunks, expected {expected}"
        assert max(keys.values()) <= case.chunk_bytes, f"{case.label}: a chunk exceeds chunk_bytes"
    assert store.chunk_bytes == case.chunk_bytes, f"{case.label}: store.chunk_bytes is {store.chunk_bytes}"
    rows = total // row_bytes
    for i in (0, rows // 2, rows - 1):
        assert not store[i]["obs"].any(), f"{case.label}: row {i} is not zero"
    return len(keys)


def run_allocation(
    server: ServerHandle, admin: redis.Redis, total: int, row_bytes: int, chunk_list: list[int | None],
    repeat: int, warmup: int, probe_interval: float,
) -> list[AllocCase]:
    rows = total // row_bytes
    kwargs = server.connection_kwargs(unix=True)
    cases = [AllocCase("unchunked" if cb is None else f"chunk_bytes={cb // MIB} MiB", cb) for cb in chunk_list]
    for r in range(warmup + repeat):
        # rotate the order each round, as compare() does
        for case in cases[r % len(cases):] + cases[: r % len(cases)]:
            time.sleep(0.2)  # let the previous case's frees settle

            def alloc(case: AllocCase = case) -> TensorDictStore:
                return TensorDictStore.from_schema(
                    {"obs": ([row_bytes], torch.uint8)}, batch_size=[rows], chunk_bytes=case.chunk_bytes, **kwargs
                )

            obs = observe(server, admin, alloc, probe_interval)
            store: TensorDictStore = obs.result
            obs.result = None
            cleared = None
            try:
                case.chunks = _check_alloc(store, admin, case, total, row_bytes)
                time.sleep(0.2)
                cleared = observe(server, admin, store.clear_redis, probe_interval)
                if r >= warmup:
                    case.clears.append(cleared)
                left = _data_keys(admin, store.td_id)
                assert not left, f"{case.label}: clear_redis left {sorted(left)}"
            finally:
                if cleared is None:  # a failed check: leave no 1 GiB entry behind
                    store.clear_redis()
                store.close()
            if r >= warmup:
                case.allocs.append(obs)
            longest, name = obs.longest()
            print(
                f"#   {'warm-up ' if r < warmup else ''}{case.label}: alloc {fmt_ms(obs.seconds)} ms, longest step {longest:.0f} us ({name}), "
                f"PING max {fmt_ms(obs.ping_max())} ms ({len(obs.pings)} PINGs); clear {fmt_ms(cleared.seconds)} ms, "
                f"longest step {cleared.longest()[0]:.0f} us ({cleared.longest()[1]})",
                flush=True,
            )
    return cases


def _med(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e3:.1f}" if value >= 1e4 else f"{value / 1e3:.2f}"


def alloc_rows(cases: list[AllocCase]) -> tuple[list[list[str]], list[dict[str, Any]]]:
    rows, js = [], []
    for case in cases:
        a, c = case.allocs, case.clears
        longest = [o.longest() for o in a]
        worst = max(longest, key=lambda x: x[0])
        clear_longest = max((o.longest() for o in c), key=lambda x: x[0])
        item = {
            "case": case.label,
            "chunk_bytes": case.chunk_bytes,
            "strings": case.chunks,
            "alloc_ms": _ms(_med([o.seconds for o in a])),
            "longest_step_us": worst[0],
            "longest_step_cmd": worst[1],
            "commit_evalsha_us": _med([o.longest_of("EVALSHA") for o in a]),
            "max_setrange_us": _med([o.longest_of("SETRANGE", ":tmp:") for o in a]),
            "slowlog_entries": _med([float(o.count()) for o in a]),
            "latency_max_ms": max(o.latency_ms for o in a),
            "ping_max_ms": _ms(max((o.ping_max() or 0.0) for o in a)),
            "ping_p99_ms": _ms(_med([o.ping_p99() for o in a])),
            "pings": sum(len(o.pings) for o in a),
            "clear_ms": _ms(_med([o.seconds for o in c])),
            "clear_longest_step_us": clear_longest[0],
            "clear_longest_cmd": clear_longest[1],
            "clear_ping_max_ms": _ms(max((o.ping_max() or 0.0) for o in c)),
        }
        js.append(item)
        rows.append([
            case.label,
            str(case.chunks),
            fmt_ms(_med([o.seconds for o in a])),
            f"{_us(worst[0])} {worst[1]}",
            _us(item["commit_evalsha_us"]),
            _us(item["max_setrange_us"]),
            f"{item['slowlog_entries']:.0f}",
            str(item["latency_max_ms"]),
            fmt_ms(max((o.ping_max() or 0.0) for o in a)),
            fmt_ms(_med([o.ping_p99() for o in a])),
            fmt_ms(_med([o.seconds for o in c])),
            f"{_us(clear_longest[0])} {clear_longest[1]}",
        ])
    return rows, js


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


# --------------------------------------------------------------------------- #
# part B: one large entry
# --------------------------------------------------------------------------- #


def run_large(
    server: ServerHandle, admin: redis.Redis, mib: int, chunk_list: list[int | None], args: Any
) -> tuple[list[list[str]], list[list[str]], list[list[str]], list[dict[str, Any]]]:
    shape = (ROWS_B, mib * MIB // 4 // ROWS_B)
    nbytes = shape[0] * shape[1] * 4
    tensor = torch.randn(*shape)
    kwargs = server.connection_kwargs(unix=True)
    raw = _RawNoTimeout(server)
    key = raw.key("x")
    stores: dict[str, TensorDictStore] = {}
    time_rows: list[list[str]] = []
    mem_rows: list[list[str]] = []
    step_rows: list[list[str]] = []
    js: list[dict[str, Any]] = []
    try:

        async def raw_set(c: Any) -> Any:
            return await c.set(key, byte_view(tensor))

        async def raw_get(c: Any) -> Any:
            return tensor_from_bytes(await c.get(key), torch.float32, shape)

        raw.call("unix", raw_set)
        assert torch.equal(raw.call("unix", raw_get), tensor), "raw round trip differs"
        for cb in chunk_list:
            label = "unchunked" if cb is None else f"chunk_bytes={cb // MIB} MiB"
            store = TensorDictStore(batch_size=[ROWS_B], chunk_bytes=cb, **kwargs)
            stores[label] = store
            store["x"] = tensor
            assert torch.equal(store["x"], tensor), f"{label}: read back differs"
            keys = _data_keys(admin, store.td_id)
            assert sum(keys.values()) == nbytes, f"{label}: data strings hold {sum(keys.values())} bytes"
            expect = 1 if cb is None or cb >= nbytes else -(-nbytes // ((cb // (nbytes // ROWS_B)) * (nbytes // ROWS_B)))
            assert len(keys) == expect, f"{label}: {len(keys)} strings, expected {expect}"
            _check_layout(admin, keys, byte_view(tensor), label)
            print(f"#   {label}: {len(keys)} string(s) of at most {max(keys.values()) / MIB:.0f} MiB; read back ok", flush=True)

        def writer(store: TensorDictStore) -> Callable[[], None]:
            def write() -> None:
                store["x"] = tensor

            return write

        cases_w = {"raw:set": raw.timed("unix", raw_set)}
        cases_w.update({f"write:{label}": timed(writer(s)) for label, s in stores.items()})
        cases_r = {"raw:get": raw.timed("unix", raw_get)}
        cases_r.update({f"read:{label}": timed(lambda s=s: s["x"]) for label, s in stores.items()})
        times: dict[str, Timing] = compare(cases_w, repeat=args.repeat, warmup=args.warmup)
        times.update(compare(cases_r, repeat=args.repeat, warmup=args.warmup))
        for label, store in stores.items():
            assert torch.equal(store["x"], tensor), f"{label}: read back differs after the timed runs"

        # the server steps of one more overwrite and read of each (SLOWLOG + PING probe)
        probe = args.probe_interval_ms / 1e3
        observed: list[tuple[str, str, Observation]] = []
        for label, store in stores.items():
            observed.append((label, 'store["x"] = t (overwrite)', observe(server, admin, writer(store), probe)))
            observed.append((label, 'store["x"]', observe(server, admin, lambda s=store: s["x"], probe)))
        observed.append(("raw", "SET (overwrite)", observe(server, admin, lambda: raw.call("unix", raw_set), probe)))
        observed.append(("raw", "GET + frombuffer", observe(server, admin, lambda: raw.call("unix", raw_get), probe)))
        for label, what, obs in observed:
            obs.result = None
            longest, name = obs.longest()
            step_rows.append([
                label, what, fmt_ms(obs.seconds), f"{_us(longest)} {name}", str(obs.latency_ms),
                fmt_ms(obs.ping_max()), str(len(obs.pings)),
            ])
            js.append({
                "mib": mib, "op": "steps:" + what, "case": label, "ms": _ms(obs.seconds), "longest_step_us": longest,
                "longest_step_cmd": name, "latency_max_ms": obs.latency_ms, "exec_calls": obs.exec_calls,
                "exec_usec": obs.exec_usec, "ping_max_ms": _ms(obs.ping_max()),
            })

        mem: dict[str, dict[str, Any]] = {}
        if not args.no_memory:
            child_kwargs = {k: v for k, v in kwargs.items() if isinstance(v, (str, int, float))}
            for op in ("raw:set", "raw:get"):
                mem[op] = measure_memory({"op": op, "shape": shape, "kwargs": child_kwargs, "key": key, "td_id": ""})
            for label, store in stores.items():
                for op in ("write", "read"):
                    spec = {"op": op, "shape": shape, "kwargs": child_kwargs, "key": key, "td_id": store.td_id}
                    mem[f"{op}:{label}"] = measure_memory(spec)

        def mult(op: str) -> float | None:
            return (mem[op]["peak"] - mem[op]["base"]) / nbytes if op in mem else None

        for label in stores:
            for op, base, what in (("write", "raw:set", 'store["x"] = t vs SET'), ("read", "raw:get", 'store["x"] vs GET + frombuffer')):
                o, b = times[f"{op}:{label}"], times[base]
                time_rows.append([
                    str(mib), what, label, f"{fmt_ms(b.median)} ({fmt_ms(b.min)})", f"{fmt_ms(o.median)} ({fmt_ms(o.min)})",
                    fmt_ratio(o.median, b.median), fmt_ratio(o.min, b.min),
                ])
                ours, theirs = mult(f"{op}:{label}"), mult(base)
                if ours is not None and theirs is not None:
                    mem_rows.append([str(mib), what, label, f"{theirs:.2f}x", f"{ours:.2f}x"])
                js.append({
                    "mib": mib, "op": op, "case": label, "raw_ms": _ms(b.median), "tdstore_ms": _ms(o.median),
                    "ratio": round(o.median / b.median, 3), "ratio_of_mins": round(o.min / b.min, 3),
                    "raw_peak_extra": None if theirs is None else round(theirs, 3),
                    "tdstore_peak_extra": None if ours is None else round(ours, 3),
                })
    finally:
        for store in stores.values():
            try:
                store.clear_redis()
            finally:
                store.close()
        raw.cleanup()
    return time_rows, mem_rows, step_rows, js


# --------------------------------------------------------------------------- #
# main
# --------------------------------------------------------------------------- #


def _mib_list(text: str) -> list[int | None]:
    out: list[int | None] = []
    for part in text.split(","):
        part = part.strip()
        if part:
            out.append(None if part in ("none", "0") else int(part) * MIB)
    return out


def main() -> None:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB entries instead of 1 GiB")
    parser.add_argument("--alloc-mib", type=int, help="part A entry size in MiB (default 1024; --quick 256)")
    parser.add_argument("--alloc-chunks", default="none,4,16,64", help="part A chunk_bytes in MiB ('none': unchunked)")
    parser.add_argument("--alloc-repeat", type=int, default=3, help="part A timed runs per case (default 3)")
    parser.add_argument(
        "--alloc-warmup", type=int, default=1,
        help="part A untimed runs per case first (default 1): the first allocations touch fresh server memory "
        "(page faults), later ones reuse what the previous case freed",
    )
    parser.add_argument("--row-bytes", type=int, default=4096, help="part A row size: obs is [rows, ROW_BYTES] uint8")
    parser.add_argument("--probe-interval-ms", type=float, default=0.5, help="pause between the probe's PINGs")
    parser.add_argument(
        "--probe", choices=tuple(PROBES), default="process",
        help="run the PING probe in a separate process (default: no wait for this process's GIL) or in a thread",
    )
    parser.add_argument("--large-mib", type=int, help="part B entry size in MiB (default 1024; --quick 256)")
    parser.add_argument(
        "--large-chunks", help="part B chunk_bytes in MiB ('none': unchunked; default 64,256,none; --quick 16,64,none)"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip part B's peak-memory subprocesses")
    parser.add_argument("--skip", choices=("alloc", "large"), help="skip one part")
    parser.set_defaults(repeat=2, warmup=0, transport="unix")
    args = parse(parser)
    if args.transport != "unix":
        parser.error("bench_chunked measures over the unix socket only (--transport unix)")
    alloc_mib = args.alloc_mib or (256 if args.quick else 1024)
    large_mib = args.large_mib or (256 if args.quick else 1024)
    alloc_repeat = args.alloc_repeat
    large_chunks = args.large_chunks or ("16,64,none" if args.quick else "64,256,none")
    if alloc_repeat < 1 or args.alloc_warmup < 0:
        parser.error("--alloc-repeat must be >= 1 and --alloc-warmup >= 0")
    PROBE["kind"] = args.probe
    if os.environ.pop("TDSTORE_CHUNK_BYTES", None):
        print("# note: TDSTORE_CHUNK_BYTES was set; ignored (every case names its chunk_bytes)")
    total = alloc_mib * MIB
    if total % args.row_bytes:
        parser.error("--row-bytes must divide the entry size")
    result: dict[str, Any] = {"benchmark": "bench_chunked", "server": args.server}

    with bench_server(args.server, CONFIG) as handle:
        admin = redis.Redis(unix_socket_path=handle.unix_socket_path, socket_timeout=None)
        admin.config_set("slowlog-max-len", SLOWLOG_MAX_LEN)
        lazy = admin.config_get("lazyfree-lazy-user-del").get("lazyfree-lazy-user-del")
        print(f"# bench_chunked; {datetime.datetime.now().isoformat(timespec='minutes')}; {server_banner(handle)}")
        print(f"# server config: {CONFIG} (lazyfree-lazy-user-del now {lazy!r}); load average at start: {load_average()}")
        result.update({"banner": server_banner(handle), "lazyfree_lazy_user_del": lazy})
        if args.skip != "alloc":
            print(
                f"# A. from_schema of obs [{total // args.row_bytes}, {args.row_bytes}] uint8 = {alloc_mib} MiB; "
                f"{alloc_repeat} timed run(s) per case after {args.alloc_warmup} untimed; cases interleaved; "
                f"PING probe every {args.probe_interval_ms} ms",
                flush=True,
            )
            cases = run_allocation(
                handle, admin, total, args.row_bytes, _mib_list(args.alloc_chunks), alloc_repeat, args.alloc_warmup,
                args.probe_interval_ms / 1e3,
            )
            rows, js = alloc_rows(cases)
            result["allocation"] = {
                "mib": alloc_mib, "row_bytes": args.row_bytes, "runs": alloc_repeat, "warmup": args.alloc_warmup, "cases": js,
            }
            print_table(
                f"A. allocation of one {alloc_mib} MiB entry by from_schema: longest blocking server step",
                ["case", "strings", "alloc ms", "longest step ms (cmd)", "commit EVALSHA ms", "max tmp SETRANGE ms",
                 "slowlog entries", "LATENCY max ms", "PING max ms", "PING p99 ms", "clear ms", "clear longest ms (cmd)"],
                rows,
                [
                    "longest step = the longest SLOWLOG entry (slowlog-log-slower-than 0) other than the probe's PINGs, or "
                    "EXEC (INFO commandstats; SLOWLOG does not list it); LATENCY max = LATENCY LATEST (threshold 1 ms, "
                    "whole ms) as a cross-check; "
                    "EVALSHA is a script (the commit; in the clear column clear.lua's DELs), SETRANGE one zero-fill step "
                    "of a chunk's tmp key (or of 64 MiB of it). slowlog entries count the commands scripts run too. "
                    f"PING: round trips of a probe's blocking client (own {args.probe}), one every "
                    f"{args.probe_interval_ms} ms, overlapping the call. Times are medians of {alloc_repeat} run(s); "
                    "longest step and PING max are the worst run.",
                    f"load average now: {load_average()}",
                ],
            )
        if args.skip != "large":
            print(
                f"# B. one [{ROWS_B}, n] float32 entry of {large_mib} MiB, unix socket; median (min) ms of "
                f"{args.repeat} interleaved runs after {args.warmup} warm-up run(s)",
                flush=True,
            )
            time_rows, mem_rows, step_rows, js = run_large(handle, admin, large_mib, _mib_list(large_chunks), args)
            result["large"] = js
            print_table(
                f"B. one {large_mib} MiB entry: time vs raw redis-py",
                ["MiB", "operation", "store", "raw ms", "tdstore ms", "tdstore/raw", "(of mins)"],
                time_rows,
                [
                    "ratio = median tdstore time / median raw time (lower is better); raw = redis.asyncio + hiredis "
                    "awaited inside its own loop, SET of the tensor's memoryview / GET + torch.frombuffer.",
                    f"load average now: {load_average()}",
                ],
            )
            print_table(
                f"B. one {large_mib} MiB entry: longest blocking server step of one more overwrite / read",
                ["store", "operation", "ms", "longest step ms (cmd)", "LATENCY max ms", "PING max ms", "PINGs"],
                step_rows,
                [
                    "measured as in part A (SLOWLOG + PING probe), one run each. The overwrite has the entry's shape "
                    "and dtype, so tdstore writes it in place (SETRANGEs in one MULTI/EXEC); the raw SET replaces the "
                    "old string (freed at once). EXEC = one MULTI/EXEC transaction, timed by "
                    "INFO commandstats (SLOWLOG lists only the commands inside it); EXEC/n = the mean of n.",
                ],
            )
            if mem_rows:
                print_table(
                    f"B. one {large_mib} MiB entry: client peak extra memory (multiple of the entry size)",
                    ["MiB", "operation", "store", "raw peak extra", "tdstore peak extra"],
                    mem_rows,
                    [
                        "peak extra = (VmHWM after - VmHWM before) / entry size, one run in a fresh process "
                        "(bench_large.py --child); a read's figure includes the tensor it returns.",
                    ],
                )
        left = admin.dbsize()
        if left:
            print(f"# WARNING: {left} keys were left on the server after the benchmark")
        admin.close()
    print()
    print("JSON " + json.dumps(result, separators=(",", ":")))


if __name__ == "__main__":
    main()
