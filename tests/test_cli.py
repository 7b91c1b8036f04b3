"""The ``tdstore`` command, end to end against real servers.

Most tests call :func:`tdstore.cli.main` in-process (the same code the console script
runs) with connection flags built from the session's server handles, and check what it
prints against the wire state read with a plain client. A few run the real console
script / ``python -m tdstore`` in a subprocess: ``serve`` (a long-running process,
stopped with SIGTERM) and the help screens.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from tdstore import TensorDictStore
from tdstore.cli import CliError, ConnOptions, build_parser, conn_options, main
from tdstore.cli.stores import human_seconds
from tdstore.server import ServerHandle, start_server

SUBPROCESS_TIMEOUT = 90.0


# --------------------------------------------------------------------------- helpers
def conn_args(handle: ServerHandle, *, unix: bool = False) -> list[str]:
    """CLI flags that reach ``handle`` (TCP by default)."""
    kwargs = handle.connection_kwargs(unix=unix)
    if "unix_socket_path" in kwargs:
        args = ["-s", kwargs["unix_socket_path"]]
    else:
        args = ["-h", str(kwargs["host"]), "-p", str(kwargs["port"])]
    if kwargs.get("db"):
        args += ["-n", str(kwargs["db"])]
    if kwargs.get("username"):
        args += ["--user", kwargs["username"]]
    return args


def password_env(handle: ServerHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    password = handle.connection_kwargs().get("password")
    monkeypatch.delenv("REDISCLI_AUTH", raising=False)
    monkeypatch.delenv("TDSTORE_URL", raising=False)
    if password:
        monkeypatch.setenv("TDSTORE_PASSWORD", password)
    else:
        monkeypatch.delenv("TDSTORE_PASSWORD", raising=False)


def run_cli(argv: list[str], stdin: str = "") -> tuple[int, str]:
    out = io.StringIO()
    code = main(argv, out=out, stdin=io.StringIO(stdin))
    return code, out.getvalue()


def make_stores(handle: ServerHandle) -> tuple[TensorDictStore, TensorDictStore]:
    kwargs = handle.connection_kwargs()
    first = TensorDictStore.from_dict(
        {
            "obs": torch.arange(30, dtype=torch.float32).reshape(5, 6),
            "nested": {"act": torch.ones(5, 2, dtype=torch.int64)},
            "label": "hello",
        },
        batch_size=[5],
        td_id="cli-first",
        **kwargs,
    )
    second = TensorDictStore.from_schema(
        {"x": ([3], torch.uint8)}, batch_size=[7], td_id="cli-second", prefix="other", **kwargs
    )
    return first, second


def keys_of(handle: ServerHandle, pattern: str) -> set[bytes]:
    client = handle.sync_client()
    try:
        return set(client.scan_iter(match=pattern, count=1000))
    finally:
        client.close()


# --------------------------------------------------------------------------- ls / info
def test_ls_lists_every_store_with_sizes_and_ttl(real_server: ServerHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    password_env(real_server, monkeypatch)
    first, second = make_stores(real_server)
    try:
        client = real_server.sync_client()
        client.pexpire(f"other:{{{second.td_id}}}:meta", 60_000)
        client.close()

        code, text = run_cli(["ls", "--json", *conn_args(real_server)])
        assert code == 0
        doc = json.loads(text)
        by_id = {s["td_id"]: s for s in doc["stores"]}
        assert set(by_id) == {"cli-first", "cli-second"}
        a, b = by_id["cli-first"], by_id["cli-second"]
        assert (a["prefix"], a["kind"], a["batch_size"], a["entries"]) == ("tensordict", "store", [5], 3)
        # bytes are the servers' string lengths: 30 float32 + 10 int64 + the JSON of "hello"
        assert a["bytes"] == 30 * 4 + 10 * 8 + len(json.dumps("hello"))
        assert a["ttl_s"] is None and 0 <= a["age_s"] < 120  # "created" is written by the creating commit
        assert (b["prefix"], b["batch_size"], b["entries"], b["bytes"]) == ("other", [7], 1, 21)
        assert 0 < b["ttl_s"] <= 60

        code, text = run_cli(["ls", "--prefix", "other", "--json", *conn_args(real_server)])
        assert code == 0
        assert [s["td_id"] for s in json.loads(text)["stores"]] == ["cli-second"]

        code, text = run_cli(["ls", *conn_args(real_server)])
        assert code == 0
        lines = text.splitlines()
        assert lines[0].split() == ["TD_ID", "PREFIX", "KIND", "BATCH", "ENTRIES", "BYTES", "AGE", "TTL"]
        row = next(line for line in lines if line.startswith("cli-first"))
        cells = row.split()
        assert cells[:7] + cells[8:] == ["cli-first", "tensordict", "store", "[5]", "3", "207", "B", "none"]
        assert cells[7] == human_seconds(float(cells[7].rstrip("s"))) and cells[7].endswith("s")  # the age
        row = next(line for line in lines if line.startswith("cli-second"))
        assert row.split()[:6] == ["cli-second", "other", "store", "[7]", "1", "21"]
        assert row.split()[-1].endswith("s") and row.split()[-1] != "none"
        assert lines[-1].startswith("2 stores, 228 B (228 bytes) on ")
    finally:
        first.clear_redis()
        second.clear_redis()
        first.close()
        second.close()


def test_ls_on_an_empty_server_and_ignores_foreign_keys(real_server: ServerHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    password_env(real_server, monkeypatch)
    client = real_server.sync_client()
    client.hset("app:{not-a-store}:meta", "x", "1")  # looks like a store's meta key, has no format
    client.close()
    code, text = run_cli(["ls", *conn_args(real_server)])
    assert code == 0
    assert text.startswith("no stores on ")
    code, text = run_cli(["ls", "--json", *conn_args(real_server)])
    assert json.loads(text)["stores"] == []


def test_info_shows_entries_and_layout(real_server: ServerHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    password_env(real_server, monkeypatch)
    first, second = make_stores(real_server)
    try:
        second.lock_()
        code, text = run_cli(["info", "cli-first", "--json", *conn_args(real_server)])
        assert code == 0
        info = json.loads(text)
        client = real_server.sync_client()
        lv = int(client.hget("tensordict:{cli-first}:meta", "lv"))
        wv = int(client.get("tensordict:{cli-first}:wv") or 0)
        client.close()
        assert info["layout_version"] == lv and info["write_version"] == wv
        assert (info["format"], info["locked"], info["chunking"]) == ("1", False, None)
        assert info["batch_size"] == [5]
        rows = {".".join(e["key"]): (e["kind"], e["shape"], e["dtype"], e["bytes"]) for e in info["entries"]}
        assert rows == {
            "obs": ("tensor", [5, 6], "float32", 120),
            "nested": ("tensordict", [5], None, None),
            "nested.act": ("tensor", [5, 2], "int64", 80),
            "label": ("non-tensor", [], "json", len(json.dumps("hello"))),
        }
        assert [".".join(e["key"]) for e in info["entries"]] == ["obs", "nested", "nested.act", "label"]

        code, text = run_cli(["info", "cli-second", "--prefix", "other", *conn_args(real_server)])
        assert code == 0
        header, table_text = text.split("\n\n", 1)
        fields = {line[:16].strip(): line[16:] for line in header.splitlines()}
        assert (fields["lock"], fields["chunking"], fields["format"]) == ("locked", "-", "1")
        assert (fields["kind"], fields["batch size"], fields["ttl"]) == ("TensorDictStore", "[7]", "none")
        assert fields["layout version"].isdigit() and fields["size"] == "21 B (21 bytes) in 1 entry"
        table = table_text.splitlines()
        assert table[0].split() == ["KEY", "KIND", "SHAPE", "DTYPE", "BYTES"]
        assert table[1].split() == ["x", "tensor", "[7,", "3]", "uint8", "21"]
    finally:
        second.unlock_()
        for store in (first, second):
            store.clear_redis()
            store.close()


def test_info_of_a_missing_or_invalid_store(real_server: ServerHandle, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    password_env(real_server, monkeypatch)
    code, _ = run_cli(["info", "no-such-store", *conn_args(real_server)])
    assert code == 1
    err = capsys.readouterr().err
    assert "no store with td_id='no-such-store' under prefix 'tensordict'" in err
    code, _ = run_cli(["info", "bad id with spaces", *conn_args(real_server)])
    assert code == 2
    assert "td_id must be" in capsys.readouterr().err


# --------------------------------------------------------------------------- rm
def test_rm_asks_first_and_deletes_only_what_was_confirmed(
    real_server: ServerHandle, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from tdstore.testing.wire import wire_snapshot

    password_env(real_server, monkeypatch)
    first, second = make_stores(real_server)
    try:
        first.lock_()  # the prompt says so; clear_redis() deletes a locked store too
        before = wire_snapshot(real_server)
        for answer in ("n\n", "", "maybe\n"):  # no, end of input, anything but y/yes
            code, _ = run_cli(["rm", "cli-first", *conn_args(real_server)], stdin=answer)
            assert code == 1
            err = capsys.readouterr().err
            assert "delete 1 store on" in err and "cli-first (207 B, locked)? [y/N]" in err
            assert "nothing deleted" in err
            assert wire_snapshot(real_server) == before

        code, text = run_cli(["rm", "cli-first", *conn_args(real_server)], stdin="y\n")
        assert code == 0
        assert text == "deleted cli-first (207 B, 3 entries)\n"
        assert keys_of(real_server, "tensordict:{cli-first}:*") == set()
        # the other store is untouched
        assert {k: v for k, v in before.items() if k.startswith(b"other:")} == wire_snapshot(real_server)
        assert torch.equal(second["x"], torch.zeros(7, 3, dtype=torch.uint8))
    finally:
        for store in (first, second):
            store.clear_redis()
            store.close()


def test_rm_yes_several_with_a_missing_one(real_server: ServerHandle, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    password_env(real_server, monkeypatch)
    kwargs = real_server.connection_kwargs()
    stores = [TensorDictStore.from_dict({"a": torch.arange(4)}, batch_size=[4], td_id=f"rm-{i}", **kwargs) for i in range(3)]
    try:
        code, text = run_cli(["rm", "--yes", "--json", "rm-0", "missing", "rm-2", *conn_args(real_server)])
        assert code == 1  # one was missing
        assert json.loads(text) == {"deleted": ["rm-0", "rm-2"], "bytes": 64, "missing": ["missing"]}
        assert "no store with td_id='missing'" in capsys.readouterr().err
        assert keys_of(real_server, "tensordict:{rm-0}:*") == set()
        assert keys_of(real_server, "tensordict:{rm-2}:*") == set()
        assert torch.equal(stores[1]["a"], torch.arange(4))

        code, _ = run_cli(["rm", "-y", "missing", *conn_args(real_server)])
        assert code == 1
        code, text = run_cli(["rm", "-y", "rm-1", *conn_args(real_server)])
        assert (code, text) == (0, "deleted rm-1 (32 B, 1 entry)\n")
    finally:
        for store in stores:
            store.clear_redis()
            store.close()


# --------------------------------------------------------------------------- connections
def test_unix_socket_url_and_db(redis_server: ServerHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    password_env(redis_server, monkeypatch)
    store = TensorDictStore.from_dict({"a": torch.arange(3)}, batch_size=[3], td_id="db3", db=3,
                                      **redis_server.connection_kwargs())
    try:
        sock = redis_server.unix_socket_path
        assert sock is not None
        variants = [
            ["-s", sock, "-n", "3"],
            ["--url", f"unix://{sock}?db=3"],
            ["--url", f"redis://127.0.0.1:{redis_server.port}/3"],
            ["-u", f"redis://127.0.0.1:{redis_server.port}/0", "-n", "3"],  # flags override the URL
        ]
        for args in variants:
            code, text = run_cli(["ls", "--json", *args])
            assert code == 0, args
            assert [s["td_id"] for s in json.loads(text)["stores"]] == ["db3"], args
        code, text = run_cli(["ls", "--json", "-s", sock])  # db 0: empty
        assert json.loads(text)["stores"] == []
        monkeypatch.setenv("TDSTORE_URL", f"redis://127.0.0.1:{redis_server.port}/3")
        code, text = run_cli(["ls", "--json"])  # TDSTORE_URL when no connection flag is given
        assert [s["td_id"] for s in json.loads(text)["stores"]] == ["db3"]
    finally:
        store.clear_redis()
        store.close()


@pytest.fixture(scope="module")
def password_server() -> Any:
    """A private redis-server with a default-user password and an ACL user."""
    srv = start_server("redis", config={"requirepass": "cli-secret"})
    client = srv.sync_client()
    client.execute_command("ACL", "SETUSER", "reader", "on", ">reader-pw", "~*", "&*", "+@all", "-@dangerous")
    client.close()
    yield srv
    srv.stop()


def test_password_from_env_flag_and_user(password_server: ServerHandle, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    for name in ("TDSTORE_PASSWORD", "REDISCLI_AUTH", "TDSTORE_URL"):
        monkeypatch.delenv(name, raising=False)
    where = ["-p", str(password_server.port), "-h", "127.0.0.1"]
    store = TensorDictStore.from_dict({"a": torch.arange(2)}, batch_size=[2], td_id="auth", port=password_server.port,
                                      host="127.0.0.1", password="cli-secret")
    try:
        code, _ = run_cli(["ls", *where])
        assert code == 1
        assert "tdstore: " in capsys.readouterr().err

        monkeypatch.setenv("REDISCLI_AUTH", "cli-secret")
        code, text = run_cli(["ls", "--json", *where])
        assert code == 0 and [s["td_id"] for s in json.loads(text)["stores"]] == ["auth"]
        monkeypatch.delenv("REDISCLI_AUTH")

        monkeypatch.setenv("TDSTORE_PASSWORD", "wrong")
        code, _ = run_cli(["ls", *where])
        assert code == 1
        assert "refused the login" in capsys.readouterr().err

        code, text = run_cli(["ls", "--json", "--pass", "cli-secret", *where])  # the flag wins, with a warning
        assert code == 0 and [s["td_id"] for s in json.loads(text)["stores"]] == ["auth"]
        assert "visible to other users" in capsys.readouterr().err

        monkeypatch.setenv("TDSTORE_PASSWORD", "reader-pw")
        code, text = run_cli(["info", "auth", "--json", "--user", "reader", *where])
        assert code == 0 and json.loads(text)["bytes"] == 16
        code, text = run_cli(["ls", "--json", "--url", f"redis://reader:reader-pw@127.0.0.1:{password_server.port}/0"])
        assert code == 0 and len(json.loads(text)["stores"]) == 1
        assert "password given with --url is visible" in capsys.readouterr().err
        monkeypatch.setenv("TDSTORE_URL", f"redis://reader:reader-pw@127.0.0.1:{password_server.port}/0")
        code, text = run_cli(["ls", "--json"])  # from the environment: no warning
        assert code == 0 and len(json.loads(text)["stores"]) == 1
        assert "warning" not in capsys.readouterr().err
    finally:
        store.clear_redis()
        store.close()


def test_unreachable_server_is_one_clear_line(capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TDSTORE_URL", raising=False)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    code, out = run_cli(["ls", "-p", str(port), "-h", "127.0.0.1", "--timeout", "5"])
    assert code == 1 and out == ""
    err = capsys.readouterr().err
    assert f"tdstore: cannot reach 127.0.0.1:{port} db=0" in err
    assert "Traceback" not in err


def test_conn_options_parsing() -> None:
    parser = build_parser()

    def parse(*argv: str, env: dict[str, str] | None = None) -> ConnOptions:
        return conn_options(parser.parse_args(["ls", *argv]), env or {})

    assert parse().describe() == "localhost:6379 db=0"
    o = parse("-h", "127.0.0.1", "-p", "7000", "-n", "2")
    assert (o.host, o.port, o.db, o.unix_socket_path) == ("127.0.0.1", 7000, 2, None)
    o = parse("--url", "redis://u:p@127.0.0.1:7001/4")
    assert (o.host, o.port, o.db, o.username, o.password) == ("127.0.0.1", 7001, 4, "u", "p")
    o = parse("--url", "rediss://127.0.0.1:7002/0", "--cacert", "/ca.pem")
    assert o.ssl and o.redis_kwargs()["ssl_ca_certs"] == "/ca.pem"
    o = parse("--url", "unix:///tmp/x.sock?db=5")
    assert (o.unix_socket_path, o.db) == ("/tmp/x.sock", 5)
    assert o.store_kwargs()["unix_socket_path"] == "/tmp/x.sock" and "host" not in o.store_kwargs()
    o = parse("--url", "unix:///tmp/x.sock", "-p", "7003")  # an explicit port means TCP
    assert (o.unix_socket_path, o.port) == (None, 7003)
    o = parse(env={"TDSTORE_URL": "redis://127.0.0.1:7004/1", "REDISCLI_AUTH": "pw"})
    assert (o.port, o.db, o.password) == (7004, 1, "pw")
    o = parse("-p", "7005", env={"TDSTORE_URL": "redis://127.0.0.1:7004/1", "TDSTORE_PASSWORD": "a", "REDISCLI_AUTH": "b"})
    assert (o.port, o.db, o.password) == (7005, 0, "a")  # TDSTORE_URL only without flags
    with pytest.raises(CliError, match="--tls needs a TCP address"):
        parse("-s", "/tmp/x.sock", "--tls")
    with pytest.raises(CliError, match="bad --url"):
        parse("--url", "http://127.0.0.1:1/0")


def test_help_and_usage_errors(capsys: Any) -> None:
    assert main(["--help"]) == 0
    assert "ls" in capsys.readouterr().out
    for command in ("ls", "info", "rm", "bench", "serve"):
        assert main([command, "--help"]) == 0
        assert "usage: tdstore " + command in capsys.readouterr().out
    assert main([]) == 2
    assert main(["nope"]) == 2
    assert main(["rm"]) == 2  # needs a TD_ID
    assert main(["bench", "--mb", "0", "-p", "1"]) == 2
    assert "--mb must be" in capsys.readouterr().err


# --------------------------------------------------------------------------- bench
def test_bench_reports_rates_and_ratios_and_cleans_up(redis_server: ServerHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    password_env(redis_server, monkeypatch)
    args = ["bench", "--mb", "1", "--rows", "128", "--row-bytes", "512", "--batch", "32", "--repeat", "1",
            *conn_args(redis_server, unix=True)]
    code, text = run_cli([*args, "--json"])
    assert code == 0
    doc = json.loads(text)
    assert doc["server_version"].startswith("redis ")
    cases = [r["case"] for r in doc["results"]]
    assert len(cases) == 5 and cases[0].startswith("store['x'] = t")
    for r in doc["results"]:
        assert r["tdstore_ms"] > 0 and r["raw_ms"] > 0
        assert r["ratio"] == pytest.approx(r["tdstore_ms"] / r["raw_ms"])
        assert r["mb_per_s"] > 0
    assert doc["results"][2]["rows_per_s"] == pytest.approx(32 / doc["results"][2]["tdstore_ms"] * 1e3)
    assert keys_of(redis_server, "*") == set()  # everything it wrote is gone

    code, text = run_cli(args)
    assert code == 0
    lines = text.splitlines()
    assert lines[0].startswith("tdstore bench on unix://") and "ratio = tdstore / raw" in lines[0]
    assert lines[1].split()[:3] == ["CASE", "TDSTORE", "ms"]
    assert len(lines) == 7 and all(line.split()[-1] in ("SET", "frombuffer", "GETRANGE", "SETRANGE") for line in lines[2:])


# --------------------------------------------------------------------------- serve (subprocess)
def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TDSTORE_URL", None)
    return env


def test_serve_runs_a_server_until_sigterm(tmp_path: Any) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tdstore", "serve", "--port", "0", "--json", "--maxmemory", "64mb"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=str(tmp_path),
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line, proc.stderr.read() if proc.stderr else ""
        doc = json.loads(line)
        assert doc["kind"] in ("valkey", "redis") and os.path.isabs(doc["binary"]) and doc["version"]
        assert doc["url"] == f"redis://127.0.0.1:{doc['port']}/0"
        handle = ServerHandle.from_url(doc["url"])
        client = handle.sync_client()
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert int(client.config_get("maxmemory")["maxmemory"]) == 64 * 1024 * 1024
        client.close()
        store = TensorDictStore.from_dict({"a": torch.arange(3)}, batch_size=[3], td_id="served",
                                          unix_socket_path=doc["unix_socket"])
        code, text = run_cli(["ls", "--json", "--url", doc["url"]])
        assert [s["td_id"] for s in json.loads(text)["stores"]] == ["served"]
        store.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "server stopped" in (proc.stderr.read() if proc.stderr else "")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(doc["pid"], 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"the server process {doc['pid']} outlived `tdstore serve`")
        assert not os.path.exists(doc["unix_socket"])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_serve_text_output_names_the_binary(tmp_path: Any) -> None:
    # Started with SIGINT ignored, as a background job of a non-interactive shell is (CI runs so):
    # Python then raises no KeyboardInterrupt, and serve must catch Ctrl-C itself. If it hangs,
    # SIGABRT makes it print every thread's stack (PYTHONFAULTHANDLER) for the failure message.
    proc = subprocess.Popen(
        [sys.executable, "-m", "tdstore", "serve", "--port", "0", "--kind", "redis", "--no-socket"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**_env(), "PYTHONFAULTHANDLER": "1"},
        cwd=str(tmp_path), preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(8)]
        assert lines[0].startswith("tdstore serve: redis 7.") and " running /" in lines[0]
        assert "redis-server" in lines[0]
        assert lines[2].split() == ["socket", ":", "-"]
        assert lines[-1].strip() == "Ctrl-C stops the server."
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            stacks, _ = proc.communicate(timeout=30)
            raise AssertionError(f"tdstore serve did not stop within 30 s of Ctrl-C; its threads:\n{stacks}") from None
        assert code == 0
        assert "server stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_console_script_and_python_m_agree() -> None:
    """The installed ``tdstore`` script and ``python -m tdstore`` run the same CLI."""
    import shutil

    script = shutil.which("tdstore")
    assert script is not None, "the tdstore console script is not installed (pip install -e .)"
    for argv in ([script, "--help"], [sys.executable, "-m", "tdstore", "--help"]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, env=_env())
        assert done.returncode == 0, done.stderr
        for command in ("ls", "info", "rm", "serve", "bench", "demo"):
            assert f"    {command} " in done.stdout


def test_tls_with_ca_and_acl_user(tls_server: ServerHandle, tls_files: Any, acl_server: ServerHandle,
                                  monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """--tls/--cacert against a TLS-only port; --user with the password from the environment."""
    for name in ("TDSTORE_PASSWORD", "REDISCLI_AUTH", "TDSTORE_URL"):
        monkeypatch.delenv(name, raising=False)
    store = TensorDictStore.from_dict({"a": torch.arange(5)}, batch_size=[5], td_id="tls", **tls_server.connection_kwargs())
    try:
        where = ["-h", "127.0.0.1", "-p", str(tls_server.port)]
        code, text = run_cli(["info", "tls", "--json", "--tls", "--cacert", tls_files.server.ca_file, *where])
        assert code == 0 and json.loads(text)["bytes"] == 40
        # the same port without TLS, or with a CA that did not sign the server: one line, no data
        code, _ = run_cli(["ls", "--timeout", "5", *where])
        assert code == 1
        code, _ = run_cli(["ls", "--tls", "--cacert", tls_files.other_ca_file, *where])
        assert code == 1
        err = capsys.readouterr().err
        assert err.count("tdstore: ") == 2 and "Traceback" not in err
    finally:
        store.clear_redis()
        store.close()

    from conftest import ACL_PASSWORD, ACL_USER

    kwargs = acl_server.connection_kwargs()
    acl_store = TensorDictStore.from_dict({"a": torch.arange(2)}, batch_size=[2], td_id="acl", **kwargs)
    try:
        monkeypatch.setenv("TDSTORE_PASSWORD", ACL_PASSWORD)
        args = ["--user", ACL_USER, "-h", "127.0.0.1", "-p", str(acl_server.port)]
        code, text = run_cli(["ls", "--json", *args])
        assert code == 0 and [s["td_id"] for s in json.loads(text)["stores"]] == ["acl"]
        code, text = run_cli(["rm", "-y", "acl", *args])  # clear_redis() through the ACL user
        assert code == 0 and text.startswith("deleted acl ")
    finally:
        acl_store.close()


def test_cluster_option_lists_and_reaches_stores_on_every_master(cluster_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TDSTORE_PASSWORD", "REDISCLI_AUTH", "TDSTORE_URL"):
        monkeypatch.delenv(name, raising=False)
    kwargs = cluster_server.connection_kwargs()
    stores = [TensorDictStore.from_dict({"a": torch.arange(3)}, batch_size=[3], td_id=f"cl-{i}", **kwargs) for i in range(6)]
    try:
        masters = {cluster_server.node_of_store(s.td_id) for s in stores}
        assert len(masters) >= 2  # the test means something only if the stores are spread
        host, port = cluster_server.startup_nodes[0]
        where = ["-c", "-h", host, "-p", str(port)]
        code, text = run_cli(["ls", "--json", *where])
        assert code == 0
        assert [s["td_id"] for s in json.loads(text)["stores"]] == [f"cl-{i}" for i in range(6)]
        assert all(s["bytes"] == 24 for s in json.loads(text)["stores"])
        # without -c, one node shows only its own stores
        code, text = run_cli(["ls", "--json", "-h", host, "-p", str(port)])
        assert code == 0 and len(json.loads(text)["stores"]) < 6
        for store in stores:
            code, text = run_cli(["info", store.td_id, "--json", *where])
            assert code == 0 and json.loads(text)["entries"][0]["bytes"] == 24
        code, text = run_cli(["rm", "-y", "cl-0", "cl-1", "cl-2", "cl-3", "cl-4", *where])
        assert code == 0 and text.count("deleted cl-") == 5
        code, text = run_cli(["ls", "--json", *where])
        assert [s["td_id"] for s in json.loads(text)["stores"]] == ["cl-5"]
        with pytest.raises(CliError, match="only database 0"):
            conn_options(build_parser().parse_args(["ls", *where, "-n", "1"]), {})
    finally:
        for store in stores:
            store.clear_redis()
            store.close()


def test_lazy_and_sharded_stores_are_shown_and_removed_whole(redis_server: ServerHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    from tensordict import LazyStackedTensorDict, TensorDict

    from tdstore import LazyStackedTensorDictStore, ShardedStore

    password_env(redis_server, monkeypatch)
    kwargs = redis_server.connection_kwargs()
    lazy = LazyStackedTensorDictStore.from_lazy_stack(
        LazyStackedTensorDict(TensorDict(a=torch.zeros(3)), TensorDict(a=torch.ones(5))), td_id="lz", **kwargs
    )
    sharded = ShardedStore.from_schema({"x": ([2], torch.float32)}, batch_size=[10], block_rows=4, td_id="sh", **kwargs)
    try:
        where = conn_args(redis_server)
        code, text = run_cli(["ls", "--json", *where])
        kinds = {s["td_id"]: s["kind"] for s in json.loads(text)["stores"]}
        assert kinds == {"lz": "lazy", "sh": "sharded", "sh.b0": "store", "sh.b1": "store", "sh.b2": "store"}
        code, text = run_cli(["info", "lz", "--json", *where])
        info = json.loads(text)
        assert (info["kind"], info["stack_dim"], info["batch_size"]) == ("lazy", 0, [2])
        assert [(e["key"], e["shape"], e["bytes"]) for e in info["entries"]] == [(["a"], {"ragged": [[3], [5]]}, 32)]
        code, text = run_cli(["info", "lz", *where])
        assert "ragged [3] | [5]" in text and "LazyStackedTensorDictStore (stack_dim 0)" in text
        code, text = run_cli(["info", "sh", "--json", *where])
        assert (json.loads(text)["kind"], json.loads(text)["sharded_blocks"]) == ("sharded", 3)

        code, text = run_cli(["rm", "lz", "sh", *where], stdin="yes\n")
        assert code == 0
        assert text.splitlines() == ["deleted lz (32 B, 1 entry)", "deleted sh (ShardedStore with 3 blocks, 1 entry)"]
        assert keys_of(redis_server, "*") == set()  # the blocks went with the manifest
    finally:
        lazy.close()
        sharded.close()


def test_serve_dir_keeps_the_data_across_restarts(tmp_path: Any) -> None:
    """--dir: a snapshot is saved when the server stops, and the next `serve --dir` loads it."""
    data_dir = tmp_path / "data"

    def start() -> tuple[subprocess.Popen[str], dict[str, Any]]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tdstore", "serve", "--port", "0", "--json", "--kind", "redis", "--dir", str(data_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=str(tmp_path),
        )
        line = proc.stdout.readline() if proc.stdout else ""
        assert line, proc.stderr.read() if proc.stderr else ""
        return proc, json.loads(line)

    proc, doc = start()
    try:
        assert doc["data_dir"] == str(data_dir)
        store = TensorDictStore.from_dict({"a": torch.arange(5)}, batch_size=[5], td_id="kept",
                                          unix_socket_path=doc["unix_socket"])
        store.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert (data_dir / "dump.rdb").is_file()
        proc, doc = start()
        again = TensorDictStore.from_store(td_id="kept", unix_socket_path=doc["unix_socket"])
        assert torch.equal(again["a"], torch.arange(5))
        again.clear_redis()
        again.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# --------------------------------------------------------------------------- start-up, --version, serve's port
def _child_env() -> dict[str, str]:
    env = _env()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def test_version_prints_the_package_version(capsys: Any) -> None:
    import tdstore

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tdstore {tdstore.__version__}"


def test_cli_and_errors_import_without_torch_or_tensordict(real_server: ServerHandle) -> None:
    """``tdstore --help``, ``ls``, ``info`` and ``rm`` (of a real store too) never import torch or tensordict."""
    store = TensorDictStore.from_dict({"a": torch.arange(4), "n": {"b": torch.zeros(4, 2)}}, batch_size=[4],
                                      td_id="cli-rm-me", **real_server.connection_kwargs())
    store.close()
    code = (
        "import sys, io\n"
        "import tdstore.cli, tdstore.errors, tdstore\n"
        "from tdstore.cli import main\n"
        "assert tdstore.errors.ServerUnavailableError.__name__ and tdstore.TDStoreError\n"
        "for argv in (['--help'], ['--version'], ['ls', *sys.argv[1:]], ['info', 'nope', *sys.argv[1:]],\n"
        "             ['rm', '--yes', 'nope', *sys.argv[1:]], ['rm', '--yes', 'cli-rm-me', *sys.argv[1:]],\n"
        "             ['doctor', *sys.argv[1:]], ['serve', '--help']):\n"
        "    try:\n"
        "        main(argv, out=io.StringIO())\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('torch', 'tensordict', 'numpy') if m in sys.modules))\n"
    )
    env = _child_env()
    password = real_server.connection_kwargs().get("password")
    if password:
        env["TDSTORE_PASSWORD"] = password
    done = subprocess.run([sys.executable, "-c", code, *conn_args(real_server)], capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
    assert real_server.sync_client().keys("*cli-rm-me*") == []  # rm deleted the store, without torch
    # the lazy names still resolve, to the classes themselves
    import tdstore
    import tdstore.store

    assert tdstore.TensorDictStore is tdstore.store.TensorDictStore
    for name in tdstore.__all__:
        assert getattr(tdstore, name) is not None, name


def _serve_with_default_port(port: int, tmp_path: Any, *extra: str) -> subprocess.Popen[str]:
    """``tdstore serve`` in a subprocess whose default port is ``port`` (instead of 6379)."""
    code = ("import sys; import tdstore.cli.serve as s; s.SERVE_PORT = int(sys.argv[1]); "
            "from tdstore.cli import main; sys.exit(main(['serve', *sys.argv[2:]]))")
    return subprocess.Popen([sys.executable, "-c", code, str(port), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_child_env(), cwd=str(tmp_path))


def test_serve_picks_a_free_port_when_the_default_is_busy(redis_server: ServerHandle, tmp_path: Any) -> None:
    busy = redis_server.port
    proc = _serve_with_default_port(busy, tmp_path, "--json", "--kind", "redis", "--no-socket")
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line, proc.stderr.read() if proc.stderr else ""
        doc = json.loads(line)
        assert doc["port"] != busy
        assert f"port {busy} is in use" in doc["note"] and "--port" in doc["note"]
        client = ServerHandle.from_url(doc["url"]).sync_client()
        assert client.ping()
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_serve_on_a_busy_port_names_the_flag(redis_server: ServerHandle, tmp_path: Any) -> None:
    busy = redis_server.port
    done = subprocess.run([sys.executable, "-m", "tdstore", "serve", "--port", str(busy), "--kind", "redis"],
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, env=_child_env(),
                          cwd=str(tmp_path))
    assert done.returncode == 1
    assert f"port {busy} on 127.0.0.1 is in use" in done.stderr and "--port 0" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert redis_server.sync_client().ping()  # the server that holds the port is untouched


def test_unreachable_server_message_has_no_doubled_period() -> None:
    from tdstore.errors import ServerUnavailableError

    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens on it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ServerUnavailableError) as info:
        TensorDictStore.from_dict({"a": torch.zeros(2)}, batch_size=[2], host="127.0.0.1", port=port, retry=False)
    text = str(info.value)
    assert "Connect call failed" in text and "Gave up after" in text, text
    assert ".." not in text, text


# --------------------------------------------------------------------------- damaged stores, empty prefix
def test_ls_marks_a_damaged_store_and_lists_the_rest(real_server: ServerHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    password_env(real_server, monkeypatch)
    first, second = make_stores(real_server)
    client = real_server.sync_client()
    try:
        client.delete(f"tensordict:{{{first.td_id}}}:reg")
        client.rpush(f"tensordict:{{{first.td_id}}}:reg", b"not a hash")  # the registry key has the wrong type
        code, text = run_cli(["ls", "--json", *conn_args(real_server)])
        assert code == 0
        by_id = {s["td_id"]: s for s in json.loads(text)["stores"]}
        assert by_id["cli-first"]["kind"] == "damaged" and "reg" in by_id["cli-first"]["damage"]
        assert by_id["cli-second"]["kind"] == "store" and by_id["cli-second"]["entries"] == 1
        code, text = run_cli(["ls", *conn_args(real_server)])
        assert code == 0 and "damaged: cli-first" in text and "cli-second" in text
        code, _ = run_cli(["rm", "cli-first", "--yes", *conn_args(real_server)])
        assert code == 0
        assert not keys_of(real_server, "*cli-first*")
    finally:
        second.clear_redis()
        client.close()
        first.close()
        second.close()


def test_empty_prefix_in_ls_and_rm(real_server: ServerHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    password_env(real_server, monkeypatch)
    store = TensorDictStore(batch_size=[2], td_id="cli-empty", prefix="", **real_server.connection_kwargs())
    store["x"] = torch.zeros(2)
    try:
        code, text = run_cli(["ls", "--json", *conn_args(real_server)])
        assert code == 0
        assert [(s["td_id"], s["prefix"]) for s in json.loads(text)["stores"]] == [("cli-empty", "")]
        code, _ = run_cli(["rm", "cli-empty", "--prefix", "", "--yes", *conn_args(real_server)])
        assert code == 0
        assert not keys_of(real_server, "*cli-empty*")
    finally:
        store.close()


# --------------------------------------------------------------------------- damaged stores (issue 24, N6)
def _damage_data_list(client: Any, base: str) -> str:
    key = f"{base}:d:obs"
    client.delete(key)
    client.rpush(key, b"junk")  # a data key holding a list
    return key


def _damage_ring_garbage(client: Any, base: str) -> str:
    client.set(f"{base}:ring", b"abc")
    return f"{base}:ring"


def _damage_ring_list(client: Any, base: str) -> str:
    client.rpush(f"{base}:ring", b"1")
    return f"{base}:ring"


def _damage_flags_hash(client: Any, base: str) -> str:
    client.hset(f"{base}:rf", "a", "b")
    return f"{base}:rf"


def _damage_wv_garbage(client: Any, base: str) -> str:
    client.set(f"{base}:wv", b"-x")
    return f"{base}:wv"


@pytest.mark.parametrize(
    "damage", [_damage_data_list, _damage_ring_garbage, _damage_ring_list, _damage_flags_hash, _damage_wv_garbage],
    ids=["data-list", "ring-garbage", "ring-list", "flags-hash", "wv-garbage"],
)
def test_ls_info_rm_on_a_damaged_store(real_server: ServerHandle, monkeypatch: pytest.MonkeyPatch, capsys: Any, damage: Any) -> None:
    """N6: a data key holding a list made `ls` exit 1 with WRONGTYPE and list nothing; a garbage ring
    cursor crashed `info` and `rm` with a traceback, and `ls` showed the store as healthy. Now `ls`
    marks the store damaged (naming the key) and lists the others, `info` says what is wrong in one
    line, and `rm` deletes every key of it."""
    password_env(real_server, monkeypatch)
    first, second = make_stores(real_server)
    client = real_server.sync_client()
    try:
        key = damage(client, "tensordict:{cli-first}")
        code, text = run_cli(["ls", "--json", *conn_args(real_server)])
        assert code == 0
        by_id = {s["td_id"]: s for s in json.loads(text)["stores"]}
        assert by_id["cli-first"]["kind"] == "damaged" and key in by_id["cli-first"]["damage"]
        assert by_id["cli-second"]["kind"] == "store"
        capsys.readouterr()
        code, _ = run_cli(["info", "cli-first", *conn_args(real_server)])
        err = capsys.readouterr().err
        assert code == 1 and key in err and "Traceback" not in err and err.count("\n") == 1, err
        code, _ = run_cli(["rm", "cli-first", "--yes", *conn_args(real_server)])
        assert code == 0
        assert not keys_of(real_server, "*cli-first*")
        assert keys_of(real_server, "other:{cli-second}:*")  # the other store is untouched
    finally:
        second.clear_redis()
        client.close()
        first.close()
        second.close()


def test_ls_info_rm_on_a_store_whose_clear_was_interrupted(
    real_server: ServerHandle, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """A clear killed between its seal and its delete: `ls` lists the store as being deleted, `info`
    says so, and `rm` finishes the clear."""
    from _clear_workers import clear_killed_after_seal

    password_env(real_server, monkeypatch)
    first, second = make_stores(real_server)
    clear_killed_after_seal(first, monkeypatch)
    try:
        assert keys_of(real_server, "tensordict:{cli-first}:*")
        code, text = run_cli(["ls", "--json", *conn_args(real_server)])
        assert code == 0
        by_id = {s["td_id"]: s for s in json.loads(text)["stores"]}
        assert by_id["cli-first"]["kind"] == "deleting" and "tdstore rm" in by_id["cli-first"]["damage"]
        code, text = run_cli(["ls", *conn_args(real_server)])
        assert code == 0 and "deleting: cli-first" in text
        capsys.readouterr()
        code, _ = run_cli(["info", "cli-first", *conn_args(real_server)])
        err = capsys.readouterr().err
        assert code == 1 and "being deleted" in err
        code, out = run_cli(["rm", "cli-first", "--yes", *conn_args(real_server)])
        assert code == 0 and "deleted cli-first (deleting" in out
        assert not keys_of(real_server, "*cli-first*")
    finally:
        second.clear_redis()
        first.close()
        second.close()
