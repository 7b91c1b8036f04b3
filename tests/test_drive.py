"""The drivers of the operations written once (tdstore/_backend/drive.py; issue 25, item 1).

An operation is a generator of effects (a connection checked out, a packet exchanged, a
connection released or discarded); :func:`run_blocking` runs it on a blocking client and
:func:`run_async` on an asyncio one. The same operation must give the same result on both, and
an error of an effect must reach the operation at its ``yield`` (so that it can discard the
connection and say what happened), not be lost in the driver.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis.exceptions

from tdstore._backend.drive import Checkout, ConnOp, Discard, Exchange, Release, Usable, run_async, run_blocking

ROOT = Path(__file__).resolve().parent.parent / "tdstore"


def _counter_op(client: Any, key: str, log: list[str]) -> ConnOp[tuple[Any, ...]]:
    """INCR a counter twice in one packet and read it, on one connection; ``log`` the path taken."""
    connection = yield Checkout(client)
    usable = yield Usable(connection)
    log.append(f"usable={usable}")
    try:
        replies = yield Exchange(connection, [("INCR", key), ("INCR", key), ("GET", key), ("HGET", key, "f")])
    except BaseException:
        log.append("discard")
        yield Discard(client, connection)
        raise
    log.append("release")
    yield Release(client, connection)
    return tuple(replies)


def _run_both(server: Any, op: Any) -> tuple[Any, Any]:
    """``op(client)`` on a blocking client, then on an asyncio client of ``server``."""
    sync = server.sync_client()
    try:
        blocking = run_blocking(op(sync))
    finally:
        sync.close()

    async def main() -> Any:
        client = server.async_client()
        try:
            return await run_async(op(client))
        finally:
            await client.aclose()

    return blocking, asyncio.run(main())


def test_one_operation_gives_the_same_result_on_both_drivers(real_server) -> None:
    key = "tdstore-test:drive:counter"
    logs: list[list[str]] = []

    def op(client: Any) -> ConnOp[tuple[Any, ...]]:
        logs.append([])
        return _counter_op(client, key, logs[-1])

    sync = real_server.sync_client()
    try:
        sync.delete(key)
        blocking, on_loop = _run_both(real_server, op)
        # the error reply (HGET of a string) comes back as a value, in its place, on both
        assert blocking[:3] == (1, 2, b"2") and on_loop[:3] == (3, 4, b"4")
        assert all(isinstance(r[3], redis.exceptions.ResponseError) and "WRONGTYPE" in str(r[3]) for r in (blocking, on_loop))
        assert logs == [["usable=True", "release"], ["usable=True", "release"]]
        assert int(sync.get(key)) == 4
    finally:
        sync.delete(key)
        sync.close()


def test_an_error_of_an_effect_reaches_the_operation_at_its_yield(real_server) -> None:
    """A connection that breaks during the exchange: the operation sees the error where it
    yielded, discards the connection, and its error (not the driver's) is what the caller gets."""
    logs: list[list[str]] = []

    def op(client: Any) -> ConnOp[tuple[Any, ...]]:
        logs.append([])
        return _counter_op(client, "tdstore-test:drive:gone", logs[-1])

    class Broken(Exception):
        pass

    import tdstore._backend.drive as drive

    def broken_sync(connection: Any, commands: Any) -> Any:
        raise Broken("the connection broke")

    async def broken_async(connection: Any, commands: Any) -> Any:
        raise Broken("the connection broke")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(drive.wire, "exchange_sync", broken_sync)
        mp.setattr(drive.wire, "exchange", broken_async)
        with pytest.raises(Broken):
            _run_both(real_server, op)

        async def on_loop() -> None:
            client = real_server.async_client()
            try:
                await run_async(op(client))
            finally:
                await client.aclose()

        with pytest.raises(Broken):
            asyncio.run(on_loop())
    assert logs == [["usable=True", "discard"], ["usable=True", "discard"]]


def test_a_discard_never_raises_into_the_operation(real_server) -> None:
    """Discard runs in the operation's error path: a failing disconnect must not replace the
    error the operation is raising."""

    def op(client: Any) -> ConnOp[str]:
        connection = yield Checkout(client)
        yield Discard(client, connection)
        yield Discard(client, object())  # (not a connection: its disconnect and release both fail)
        return "done"

    assert _run_both(real_server, op) == ("done", "done")


def test_the_connection_operations_are_written_once() -> None:
    """The armed row write and the ring append have one body each, a generator of effects;
    their blocking and asyncio entry points only hand it to a driver (no second copy of the
    protocol: no WATCH, MULTI or EXEC in them)."""
    for module, op, entries in (
        ("armed_write.py", "_write_op", ("write_runs_armed", "write_runs_direct")),
        ("append.py", "_append_op", ("append_watched", "append_direct")),
    ):
        tree = ast.parse((ROOT / "_backend" / module).read_text())
        functions = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert any(isinstance(n, ast.Yield) for n in ast.walk(functions[op])), f"{module}: {op} is not a generator"
        for name in entries:
            statements = functions[name].body
            if statements and isinstance(statements[0], ast.Expr) and isinstance(statements[0].value, ast.Constant):
                statements = statements[1:]  # (the docstring)
            body = "\n".join(ast.unparse(s) for s in statements)
            assert f"{op}(" in body and ("run_blocking(" in body or "run_async(" in body), f"{module}: {name}"
            for word in ("WATCH", "MULTI", "EXEC", "exchange"):
                assert word not in body.replace("NoScriptError", ""), f"{module}: {name} speaks the protocol itself ({word})"
