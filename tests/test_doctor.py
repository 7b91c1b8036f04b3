"""``tdstore doctor``: a well-configured server passes, a misconfigured one fails with the fix.

The well-configured server is the session's (``real_server``: redis, valkey, redis6 by
``--backends``): ``noeviction``, default string limits, no persistence (a warning, not a
failure). The misconfigured one is started here with eviction on (``allkeys-lru`` under a
``maxmemory``) and a small ``proto-max-bulk-len``, and holds a store with an entry larger
than that limit: doctor must exit 1 and name both, each with its fix, and change nothing
on the server.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import _selected_backends

from tdstore import TensorDictStore
from tdstore.cli import main
from tdstore.server import ServerHandle, start_server


def _conn_args(handle: ServerHandle, *, unix: bool = False) -> list[str]:
    kwargs = handle.connection_kwargs(unix=unix)
    if "unix_socket_path" in kwargs:
        return ["-s", kwargs["unix_socket_path"]]
    return ["-h", str(kwargs["host"]), "-p", str(kwargs["port"])]


def _doctor(args: list[str], monkeypatch: pytest.MonkeyPatch, handle: ServerHandle) -> tuple[int, str]:
    monkeypatch.delenv("TDSTORE_URL", raising=False)
    password = handle.connection_kwargs().get("password")
    if password:
        monkeypatch.setenv("TDSTORE_PASSWORD", password)
    else:
        monkeypatch.delenv("TDSTORE_PASSWORD", raising=False)
    out = io.StringIO()
    code = main(["doctor", *args], out=out)
    return code, out.getvalue()


def _items(text: str) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in json.loads(text)["items"]}


def _snapshot(handle: ServerHandle) -> dict[bytes, bytes]:
    client = handle.sync_client()
    try:
        return {k: client.dump(k) for k in client.scan_iter(count=1000)}
    finally:
        client.close()


def test_doctor_passes_a_well_configured_server(real_server: ServerHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    code, text = _doctor(["--json", *_conn_args(real_server)], monkeypatch, real_server)
    assert code == 0, text
    doc = json.loads(text)
    assert doc["ok"] is True
    items = _items(text)
    assert not [i for i in items.values() if i["status"] == "fail"], text
    assert items["eviction"]["status"] == "ok" and items["eviction"]["value"] == "noeviction"
    assert items["proto-max-bulk-len"]["value"] == 512 * 1024 * 1024
    assert items["client-query-buffer-limit"]["value"] >= 512 * 1024 * 1024
    assert items["lua"]["value"].startswith("Lua 5.")
    assert items["cluster"]["value"] is False
    assert items["transport"]["value"] == "tcp"
    assert items["latency"]["value"] > 0
    assert items["server"]["value"].split()[1] == real_server.version or real_server.kind == "valkey"
    # the session servers keep nothing on disk: a warning with its fix, not a failure
    assert items["persistence"]["status"] == "warn" and "appendonly" in items["persistence"]["fix"]
    if real_server.kind == "redis6":  # Redis 6 runs scripts but takes no script flags
        assert items["scripts"]["status"] == "warn" and items["scripts"]["value"] == {"eval": True, "flags": False}
    else:
        assert items["scripts"]["status"] == "ok" and items["scripts"]["value"] == {"eval": True, "flags": True}

    # the text report over the unix socket: one line per item, the verdict last
    code, text = _doctor(_conn_args(real_server, unix=True), monkeypatch, real_server)
    assert code == 0, text
    lines = text.splitlines()
    assert lines[0].startswith("tdstore doctor: unix://")
    assert any(line.startswith("OK    eviction") for line in lines), text
    assert any(line.startswith("INFO  transport") and "unix socket" in line for line in lines), text
    assert lines[-1].startswith("verdict: fit to hold tdstore data")


@pytest.fixture(params=["redis", "valkey", "redis6"])
def bad_server(request: pytest.FixtureRequest) -> Iterator[ServerHandle]:
    """A server that evicts keys and takes strings of 1 MB at most."""
    if request.param not in _selected_backends(request.config):
        pytest.skip(f"{request.param} backend excluded by --backends")
    config = {"maxmemory": "256mb", "maxmemory-policy": "allkeys-lru", "proto-max-bulk-len": "1mb"}
    handle = start_server(request.param, config=config)
    try:
        yield handle
    finally:
        handle.stop()


def test_doctor_fails_a_server_that_evicts_and_takes_small_strings(
    bad_server: ServerHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, text = _doctor(["--json", *_conn_args(bad_server)], monkeypatch, bad_server)
    assert code == 1, text
    items = _items(text)
    assert json.loads(text)["ok"] is False
    eviction = items["eviction"]
    assert eviction["status"] == "fail" and eviction["value"] == "allkeys-lru"
    assert "lost data" in eviction["detail"] and "noeviction" in eviction["fix"]
    bulk = items["proto-max-bulk-len"]  # no store yet: judged against the usual 512 MiB
    assert bulk["status"] == "warn" and bulk["value"] == 1024 * 1024 and "CONFIG SET proto-max-bulk-len" in bulk["fix"]
    assert items["memory"]["value"]["maxmemory"] == 256 * 1024 * 1024

    # a store whose entry (2 MB) was written before the limit came down to 1 MB
    client = bad_server.sync_client()
    client.config_set("proto-max-bulk-len", "8mb")
    store = TensorDictStore.from_dict({"big": torch.zeros(2 * 1024 * 1024, dtype=torch.uint8)}, batch_size=[],
                                      td_id="doctor-big", **bad_server.connection_kwargs())
    store.close()
    client.config_set("proto-max-bulk-len", "1mb")
    client.close()
    before = _snapshot(bad_server)

    code, text = _doctor(["--json", *_conn_args(bad_server)], monkeypatch, bad_server)
    assert code == 1, text
    bulk = _items(text)["proto-max-bulk-len"]
    assert bulk["status"] == "fail", bulk
    assert "doctor-big big" in bulk["detail"] and "chunk_bytes" in bulk["fix"]
    assert _snapshot(bad_server) == before  # doctor only reads

    code, text = _doctor(_conn_args(bad_server), monkeypatch, bad_server)
    assert code == 1
    assert any(line.startswith("FAIL  eviction") for line in text.splitlines()), text
    assert "fix: SET maxmemory-policy noeviction" in text
    assert text.splitlines()[-1].startswith("verdict: 2 problem(s)")


def test_doctor_names_an_unreachable_server(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.delenv("TDSTORE_URL", raising=False)
    assert main(["doctor", "-h", "127.0.0.1", "-p", str(port), "--timeout", "2"], out=io.StringIO()) == 1
    err = capsys.readouterr().err
    assert f"cannot reach 127.0.0.1:{port}" in err and "Traceback" not in err


def test_doctor_as_a_user_without_info_and_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ACL user without ``@dangerous`` (INFO, CONFIG) gets a partial report that says so, not a crash."""
    handle = start_server("redis", config={"requirepass": "doctor-admin-pw"},
                          acl_users={"actor": ["on", ">doctor-actor-pw", "~*", "&*", "+@all", "-@dangerous"]})
    try:
        monkeypatch.delenv("TDSTORE_URL", raising=False)
        monkeypatch.setenv("TDSTORE_PASSWORD", "doctor-actor-pw")
        out = io.StringIO()
        code = main(["doctor", "--json", "--user", "actor", "-p", str(handle.port), "-h", "127.0.0.1"], out=out)
        items = _items(out.getvalue())
        assert items["permissions"]["status"] == "warn" and "INFO is refused" in items["permissions"]["detail"]
        assert items["eviction"]["status"] == "warn" and items["eviction"]["value"] is None
        assert items["persistence"]["status"] == "warn" and items["persistence"]["value"] is None
        assert items["proto-max-bulk-len"]["status"] == "warn" and items["proto-max-bulk-len"]["value"] is None
        assert items["scripts"]["status"] == "ok"
        assert code == 0
    finally:
        handle.stop()
