"""Start a private master with replicas, and optionally Sentinels, for tests and demos.

Each node is a ``redis-server`` (or ``valkey-server``) started by
:func:`tdstore.server.start_server`; the replicas are pointed at the master with
``REPLICAOF`` and the launcher waits until each says ``master_link_status:up`` at the
master's replication offset. Each Sentinel is the same binary run as
``redis-server <conf> --sentinel`` on its own loopback port, with a writable config file in
its private temporary directory (Sentinel rewrites it) holding
``sentinel monitor <service_name> 127.0.0.1 <port> <quorum>`` and short
``down-after-milliseconds`` / ``failover-timeout``; the launcher waits until every Sentinel
knows every replica and the other Sentinels, so that a failover can start at once.

Example:
    >>> from tdstore.server import start_replication
    >>> with start_replication(replicas=2, sentinels=3) as group:      # doctest: +SKIP
    ...     store = TensorDictStore(**group.connection_kwargs(), batch_size=[4])
    ...     group.kill(group.master_index())       # SIGKILL; the Sentinels promote a replica

Every node binds only ``127.0.0.1``; persistence is off; every node (and the group's handle)
is stopped by the same :mod:`atexit` hook as a single server.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from types import TracebackType
from typing import Any

import redis
import redis.exceptions

from tdstore.server.find import _LOOPBACK, _free_port, _tail, find_server_binary
from tdstore.server.handle import _PORT_RACE_RETRIES, ServerHandle, _port_in_use, _register, _unregister
from tdstore.server.start import start_server

__all__ = ["ReplicationHandle", "start_replication"]

#: an INFO reply, or connection keywords
Info = dict[str, Any]


def _client(node: ServerHandle, timeout: float = 5.0) -> redis.Redis:
    return redis.Redis(
        host=str(node.host), port=int(node.port or 0), socket_timeout=timeout, socket_connect_timeout=timeout
    )


def _info(node: ServerHandle, section: str) -> Info:
    client = _client(node)
    try:
        return dict(client.info(section))
    finally:
        client.close()


def _start_sentinel(
    binary: str,
    kind: str,
    master: tuple[str, int],
    service_name: str,
    quorum: int,
    down_after_ms: int,
    failover_timeout_ms: int,
    startup_timeout: float,
) -> ServerHandle:
    """One Sentinel watching ``master``, on a free loopback port, as a :class:`ServerHandle`."""
    runtime_dir = tempfile.mkdtemp(prefix="tds-sentinel-", dir="/tmp")  # mode 0700
    try:
        conf = os.path.join(runtime_dir, "sentinel.conf")
        log_file = os.path.join(runtime_dir, "server.log")
        console_file = os.path.join(runtime_dir, "console.log")
        for attempt in range(_PORT_RACE_RETRIES):
            port = _free_port()
            with open(conf, "w") as f:  # rewritten by the Sentinel itself (it must be writable)
                f.write(
                    f"port {port}\nbind {_LOOPBACK}\ndaemonize no\ndir {runtime_dir}\nlogfile {log_file}\n"
                    f"sentinel monitor {service_name} {master[0]} {master[1]} {quorum}\n"
                    f"sentinel down-after-milliseconds {service_name} {down_after_ms}\n"
                    f"sentinel failover-timeout {service_name} {failover_timeout_ms}\n"
                    f"sentinel parallel-syncs {service_name} 1\n"
                )
            handle = ServerHandle(
                kind=kind, binary=binary, version="", host=_LOOPBACK, port=port, unix_socket_path=None,
                data_dir=runtime_dir, log_file=log_file,
            )  # fmt: skip
            handle._argv = [binary, conf, "--sentinel"]
            handle._runtime_dir = runtime_dir
            handle._console_file = console_file
            handle._owner_pid = os.getpid()
            for path in (log_file, console_file):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            try:
                handle._launch(startup_timeout=startup_timeout)
            except RuntimeError as exc:
                if attempt + 1 < _PORT_RACE_RETRIES and _port_in_use(exc):
                    continue
                raise
            _register(handle)
            _shorten_tilt(handle)
            return handle
        raise AssertionError("unreachable")  # pragma: no cover
    except BaseException:
        shutil.rmtree(runtime_dir, ignore_errors=True)
        raise


def _shorten_tilt(sentinel: ServerHandle) -> None:
    """A Sentinel whose timer ran late by 2 s (a loaded machine, a paused VM) enters TILT mode and
    starts no failover for 30 s; here it stays 3 s (``SENTINEL DEBUG tilt-period``, Redis 7.0 and
    Valkey; Redis 6.2 has no such setting and keeps its 30 s)."""
    client = _client(sentinel, 2.0)
    try:
        client.execute_command("SENTINEL", "DEBUG", "tilt-period", str(_TILT_PERIOD_MS))
    except redis.exceptions.ResponseError:
        pass
    finally:
        client.close()


_TILT_PERIOD_MS = 3000


class ReplicationHandle(ServerHandle):
    """A running master with replicas (and Sentinels): its nodes and the ways to reach them.

    Attributes:
        kind: ``"replication"``.
        nodes: One :class:`~tdstore.server.ServerHandle` per data node: the master as started
            first, then the replicas. After a failover, :meth:`master_index` tells which is master.
        sentinels: One handle per Sentinel (empty without Sentinels).
        service_name: The name the Sentinels monitor the master under.
        host, port: The first master's address.
    """

    def __init__(self, nodes: list[ServerHandle], sentinels: list[ServerHandle], *, service_name: str) -> None:
        first = nodes[0]
        super().__init__(
            kind="replication", binary=first.binary, version=first.version, host=first.host, port=first.port,
            unix_socket_path=None,
        )  # fmt: skip
        self.nodes = nodes
        self.sentinel_nodes = sentinels
        self.service_name = service_name
        self._paused: set[int] = set()
        self._owner_pid = os.getpid()

    def __repr__(self) -> str:
        ports = ",".join(str(n.port) for n in self.nodes)
        sentinels = ",".join(str(n.port) for n in self.sentinel_nodes)
        return f"ReplicationHandle(ports={ports}, sentinels={sentinels or '-'}, service_name={self.service_name!r})"

    # -- connecting ----------------------------------------------------------------
    @property
    def sentinel_addresses(self) -> list[tuple[str, int]]:
        """``[(host, port), ...]`` of every Sentinel."""
        return [(str(n.host), int(n.port or 0)) for n in self.sentinel_nodes]

    @property
    def sentinel_url(self) -> str:
        """``redis+sentinel://h1:p1,h2:p2/<service_name>``, for ``url=`` or ``TDSTORE_URL``."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinel_addresses)
        return f"redis+sentinel://{hosts}/{self.service_name}"

    def connection_kwargs(self, *, unix: bool = False) -> Info:
        """``{"sentinels": [...], "service_name": ...}`` (the first master's host/port without
        Sentinels), for ``TensorDictStore(**kwargs)``."""
        if not self.sentinel_nodes:
            return {"host": self.host, "port": self.port}
        return {"sentinels": self.sentinel_addresses, "service_name": self.service_name}

    @property
    def url(self) -> str:
        return self.sentinel_url if self.sentinel_nodes else f"redis://{self.host}:{self.port}/0"

    def node_client(self, index: int) -> redis.Redis:
        """A plain client to data node ``index`` (close it when done)."""
        return _client(self.nodes[index], 10.0)

    def master_index(self) -> int:
        """The index of the node that says it is a master now (ROLE), among the running, unpaused ones."""
        for index, node in enumerate(self.nodes):
            if not node.running or index in self._paused:
                continue
            client = _client(node, 2.0)
            try:
                if client.execute_command("ROLE")[0] == b"master":
                    return index
            except (redis.exceptions.RedisError, OSError):
                continue
            finally:
                client.close()
        raise LookupError(f"no running node of {self!r} is a master")

    def wait_for_failover(self, old: int, timeout: float = 30.0) -> int:
        """Waits until the Sentinels name a master other than node ``old`` and it says so; its index."""
        deadline = time.monotonic() + timeout
        ports = [n.port for n in self.nodes]
        while time.monotonic() < deadline:
            for sentinel in self.sentinel_nodes:
                client = _client(sentinel, 1.0)
                try:
                    addr = client.execute_command("SENTINEL", "get-master-addr-by-name", self.service_name)
                except (redis.exceptions.RedisError, OSError):
                    continue
                finally:
                    client.close()
                port = int(addr[1]) if addr else None
                if port in ports and ports.index(port) != old:
                    index = ports.index(port)
                    with contextlib.suppress(LookupError):
                        if self.master_index() == index:
                            return index
            time.sleep(0.05)
        raise TimeoutError(
            f"the Sentinels of {self!r} did not promote a new master within {timeout} s\n{self._sentinel_report()}"
        )

    def _sentinel_report(self) -> str:
        """What each Sentinel says of the master and its replicas, and the end of its log: the
        text a failover that never came is diagnosed from."""
        parts = []
        for sentinel in self.sentinel_nodes:
            client = _client(sentinel, 1.0)
            try:
                master = client.execute_command("SENTINEL", "master", self.service_name)
                replicas = client.execute_command("SENTINEL", "replicas", self.service_name)
                state = f"master {_fields(master)}; replicas {[_fields(r) for r in replicas]}"
            except (redis.exceptions.RedisError, OSError) as exc:
                state = f"no answer ({exc})"
            finally:
                client.close()
            log = "\n".join(_tail(sentinel.log_file, 4096).splitlines()[-25:])
            parts.append(f"--- Sentinel {sentinel.port}: {state}\n{log}")
        return "\n".join(parts)

    def wait_in_sync(self, timeout: float = 30.0) -> None:
        """Waits until every running replica of the current master is linked and at its offset."""
        _wait_in_sync(self.nodes[self.master_index()], timeout)

    # -- faults --------------------------------------------------------------------
    def _signal(self, index: int, sig: signal.Signals) -> None:
        node = self.nodes[index]
        node._check_owner(f"send {sig.name} to")
        proc = node._proc
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"node {index} of {self!r} is not running")
        os.kill(proc.pid, sig)

    def kill(self, index: int) -> None:
        """SIGKILL data node ``index`` (no shutdown, no save: a crash)."""
        self._signal(index, signal.SIGKILL)
        self._paused.discard(index)
        with contextlib.suppress(Exception):
            self.nodes[index]._proc.wait(timeout=5.0)  # type: ignore[union-attr]

    def pause(self, index: int) -> None:
        """SIGSTOP data node ``index`` (it holds its connections but answers nothing)."""
        self._signal(index, signal.SIGSTOP)
        self._paused.add(index)

    def resume(self, index: int) -> None:
        """SIGCONT data node ``index``."""
        self._signal(index, signal.SIGCONT)
        self._paused.discard(index)

    # -- lifecycle -----------------------------------------------------------------
    @property
    def running(self) -> bool:
        return not self._stopped and any(n.running for n in self.nodes)

    def stop(self) -> None:
        """Stops every Sentinel and node (idempotent)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            try:
                for index in list(self._paused):
                    with contextlib.suppress(Exception):
                        self.resume(index)  # a stopped process would not see SIGTERM
                for node in [*self.sentinel_nodes, *self.nodes]:
                    with contextlib.suppress(Exception):
                        node.stop()
            finally:
                _unregister(self)

    def __enter__(self) -> ReplicationHandle:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __getstate__(self) -> Info:
        raise TypeError("a ReplicationHandle is not picklable; pass connection_kwargs() or sentinel_url")


def _fields(reply: object) -> dict[str, str]:
    """A Sentinel's flat ``[name, value, ...]`` reply, reduced to the fields a failover turns on."""
    if isinstance(reply, dict):  # redis-py parses SENTINEL MASTER / REPLICAS into dicts
        pairs = list(reply.items())
    else:
        items = list(reply) if isinstance(reply, list) else []
        pairs = list(zip(items[::2], items[1::2], strict=False))
    text = {(k.decode() if isinstance(k, bytes) else str(k)): (v.decode() if isinstance(v, bytes) else str(v))
            for k, v in pairs}  # fmt: skip
    wanted = (
        "port", "flags", "failover-state", "master-link-down-time", "master-link-status", "info-refresh",
        "last-ok-ping-reply", "slave-repl-offset",
    )  # fmt: skip
    return {k: text[k] for k in wanted if k in text}


def _wait_in_sync(master: ServerHandle, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last: Info = {}
    while time.monotonic() < deadline:
        last = _info(master, "replication")
        offset = int(last.get("master_repl_offset", 0))
        replicas = [v for k, v in last.items() if k.startswith("slave") and isinstance(v, dict)]
        if len(replicas) == int(last.get("connected_slaves", 0)) and all(
            r.get("state") == "online" and int(r.get("offset", -1)) >= offset for r in replicas
        ):
            return
        time.sleep(0.02)
    raise TimeoutError(f"the replicas of {master.host}:{master.port} did not catch up within {timeout} s: {last}")


def _wait_replica_up(replica: ServerHandle, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    info: Info = {}
    while time.monotonic() < deadline:
        info = _info(replica, "replication")
        if info.get("master_link_status") == "up" and not int(info.get("master_sync_in_progress", 0)):
            return
        time.sleep(0.02)
    raise TimeoutError(f"replica {replica.host}:{replica.port} did not link up within {timeout} s: {info}")


def _wait_sentinels_ready(sentinels: list[ServerHandle], service_name: str, replicas: int, timeout: float) -> None:
    """Until every Sentinel sees every replica and every other Sentinel (a failover needs both)."""
    deadline = time.monotonic() + timeout
    seen: list[tuple[int, int]] = []
    while time.monotonic() < deadline:
        seen = []
        for sentinel in sentinels:
            client = _client(sentinel, 2.0)
            try:
                known_replicas = client.execute_command("SENTINEL", "replicas", service_name)
                known_sentinels = client.execute_command("SENTINEL", "sentinels", service_name)
            except (redis.exceptions.RedisError, OSError):
                known_replicas, known_sentinels = [], []
            finally:
                client.close()
            seen.append((len(known_replicas), len(known_sentinels)))
        if all(r >= replicas and s >= len(sentinels) - 1 for r, s in seen):
            return
        time.sleep(0.1)
    raise TimeoutError(
        f"the Sentinels did not discover the {replicas} replicas and each other within {timeout} s "
        f"((replicas, other sentinels) seen by each: {seen})"
    )


def start_replication(
    kind: str = "redis",
    *,
    replicas: int = 2,
    sentinels: int = 0,
    service_name: str = "tdsmaster",
    quorum: int | None = None,
    down_after_ms: int = 500,
    failover_timeout_ms: int = 2000,
    config: dict[str, str] | None = None,
    startup_timeout: float = 30.0,
) -> ReplicationHandle:
    """Starts a master, ``replicas`` replicas of it and ``sentinels`` Sentinels, on loopback ports.

    Args:
        kind: ``"redis"`` or ``"valkey"`` (a real server: fakeredis has no replication).
        replicas: Replicas of the master (``REPLICAOF``), in sync when this returns.
        sentinels: Sentinels monitoring the master as ``service_name`` (0: none); they know
            every replica and each other when this returns.
        quorum: Sentinels that must agree the master is down (default: a majority).
        down_after_ms, failover_timeout_ms: The Sentinels' ``down-after-milliseconds`` and
            ``failover-timeout`` (short, so that a test's failover takes seconds).
        config: Extra settings for every data node (``--name value``).
        startup_timeout: Seconds for each wait (start, sync, discovery).

    Returns:
        A handle that owns every process; use it as a context manager or call
        :meth:`ReplicationHandle.stop`. Groups still running at exit are stopped.
    """
    if kind not in ("redis", "valkey", "redis6"):
        raise ValueError(f"start_replication() needs a real server kind (redis, valkey, redis6), got {kind!r}")
    if replicas < 0 or sentinels < 0:
        raise ValueError(f"replicas and sentinels must be >= 0, got {replicas} and {sentinels}")
    nodes: list[ServerHandle] = []
    sentinel_nodes: list[ServerHandle] = []
    try:
        for _ in range(replicas + 1):
            nodes.append(start_server(kind, unix_socket=False, config=config, startup_timeout=startup_timeout))
        master = nodes[0]
        for replica in nodes[1:]:
            client = _client(replica)
            try:
                client.execute_command("REPLICAOF", master.host, str(master.port))
            finally:
                client.close()
        for replica in nodes[1:]:
            _wait_replica_up(replica, startup_timeout)
        _wait_in_sync(master, startup_timeout)
        if sentinels:
            binary = find_server_binary(kind)
            q = quorum if quorum is not None else sentinels // 2 + 1
            for _ in range(sentinels):
                sentinel_nodes.append(
                    _start_sentinel(
                        binary, kind, (str(master.host), int(master.port or 0)), service_name, q, down_after_ms,
                        failover_timeout_ms, startup_timeout,
                    )
                )  # fmt: skip
            _wait_sentinels_ready(sentinel_nodes, service_name, replicas, startup_timeout)
    except BaseException:
        for node in [*sentinel_nodes, *nodes]:
            with contextlib.suppress(Exception):
                node.stop()
        raise
    handle = ReplicationHandle(nodes, sentinel_nodes, service_name=service_name)
    _register(handle)
    return handle
