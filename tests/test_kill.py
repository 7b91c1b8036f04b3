"""A client killed (SIGKILL) mid-operation leaves the server in the old state or the new one.

Workers forked from the test process loop over large ``from_schema`` / ``from_tensordict`` /
multi-entry ``update`` / ``clear_redis`` calls and are killed at random moments. After each
kill the whole keyspace is checked with a plain client (tests/_kill_workers.check_wire): no
orphaned key, no registered-but-missing entry, no store whose entries mix two writes.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import _kill_workers as kw
import pytest

from tdstore.testing.counts import record

pytestmark = pytest.mark.multiprocess

KILLS = 6
#: seconds of one worker cycle, about (measured): kills land anywhere in it
CYCLE = {"schema_cycler": 0.2, "tensordict_cycler": 0.5}


@pytest.mark.parametrize(
    ("kind", "worker"), [("redis", "schema_cycler"), ("redis", "tensordict_cycler"), ("valkey", "schema_cycler")]
)
def test_sigkill_mid_create_write_clear_leaves_old_or_new(kind, worker, request):
    server = request.getfixturevalue(f"{kind}_server")
    conn = server.connection_kwargs()
    prefix = f"kill{worker[:2]}"
    ctx = multiprocessing.get_context("fork")  # fast: no re-import of torch per kill
    extra = (kw.cycler_values(),) if worker == "tensordict_cycler" else ()
    rng = random.Random(7)
    landed: dict[str, int] = {}
    totals = {"orphan_keys": 0, "missing_entries": 0, "mixed_values": 0}
    stores_seen = sealed = 0
    client = server.sync_client()
    try:
        for i in range(KILLS):
            phase = ctx.Array("i", [-1, 0])
            proc = ctx.Process(target=getattr(kw, worker), args=(conn, prefix, phase, 10_000, 30.0, *extra))
            proc.start()
            deadline = time.monotonic() + 30
            while phase[1] < 1:  # wait until it is connected and has done one cycle
                assert time.monotonic() < deadline and proc.is_alive(), "the worker did not start"
                time.sleep(0.005)
            if i % 2:  # every other kill aims at clear_redis(), a short call
                while phase[0] != kw.CLEAR and time.monotonic() < deadline:
                    pass
                time.sleep(rng.uniform(0.0, 0.003))
            else:
                time.sleep(rng.uniform(0.0, CYCLE[worker]))
            where = kw.PHASES[phase[0]]
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
            assert proc.exitcode == -signal.SIGKILL, "the worker ended before the kill"
            landed[where] = landed.get(where, 0) + 1
            counts = kw.check_wire(client, prefix, clean=True)
            stores_seen += counts.pop("stores")
            sealed += counts.pop("sealed")
            for name, value in counts.items():
                totals[name] += value
    finally:
        client.close()
    record(request, kills=KILLS, stores_checked=stores_seen, sealed_by_a_killed_clear=sealed, **{f"killed_in_{k}": v for k, v in sorted(landed.items())}, **totals)
    assert totals == {"orphan_keys": 0, "missing_entries": 0, "mixed_values": 0}
    assert set(landed) - {"between"}, "no kill landed inside an operation"
