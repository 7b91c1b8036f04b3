"""The handle of a private server: start, stop, restart, connect (see :mod:`tdstore.server`)."""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.connection import UnixDomainSocketConnection
from redis.retry import Retry

from tdstore._backend.credentials import login_kwargs
from tdstore.server.find import (  # noqa: F401 - re-exported
    _INSTALL_HINTS,
    _LOOPBACK,
    _PROBE_CACHE,
    _PROBE_LOCK,
    _SYSTEM_BIN_DIRS,
    _VERSION_RE,
    KINDS,
    ServerNotFoundError,
    _cached_probe,
    _candidates,
    _check_candidate,
    _encode_command,
    _env_override_name,
    _format_host,
    _free_port,
    _is_loopback_host,
    _package_dir,
    _ping,
    _probe_version,
    _tail,
    find_server_binary,
)

#: Order in which ``kind="auto"`` tries the kinds.
_AUTO_ORDER: tuple[str, ...] = ("valkey", "redis", "fakeredis")


_PORT_IN_USE_MARKERS: tuple[str, ...] = ("Address already in use", "Failed listening on port")

# Bounded waits (seconds) used when stopping a server.
_SHUTDOWN_CMD_TIMEOUT = 3.0
_EXIT_WAIT = 5.0
_PORT_RACE_RETRIES = 5
_LOG_TAIL_BYTES = 4000


# --------------------------------------------------------------------------- #
# Registry for the atexit hook
# --------------------------------------------------------------------------- #

_LIVE: dict[int, ServerHandle] = {}

_LIVE_LOCK = threading.Lock()
_ATEXIT_REGISTERED = False


def _register(handle: ServerHandle) -> None:
    global _ATEXIT_REGISTERED
    with _LIVE_LOCK:
        _LIVE[id(handle)] = handle
        if not _ATEXIT_REGISTERED:
            atexit.register(_stop_all_at_exit)
            _ATEXIT_REGISTERED = True


def _unregister(handle: ServerHandle) -> None:
    with _LIVE_LOCK:
        _LIVE.pop(id(handle), None)


def _stop_all_at_exit() -> None:
    """Stop every server this process started (never those of a parent process)."""
    pid = os.getpid()
    with _LIVE_LOCK:
        handles = list(_LIVE.values())
    for handle in handles:
        if handle._owner_pid == pid:  # noqa: SLF001 - module-private protocol
            with contextlib.suppress(Exception):
                handle.stop()


# --------------------------------------------------------------------------- #
# The handle
# --------------------------------------------------------------------------- #


@dataclass(eq=False)
class ServerHandle:
    """A running (or stopped) server and the ways to connect to it.

    Handles of servers started by :func:`start_server` own the server and stop
    it in :meth:`stop`. Handles made by :meth:`from_url` (kind ``"external"``)
    or unpickled in another process only connect; they never stop anything.

    Attributes:
        kind: ``"redis"``, ``"valkey"``, ``"redis6"``, ``"fakeredis"`` or ``"external"``.
        binary: Absolute path of the executable; ``None`` for fakeredis/external.
        version: Server version, e.g. ``"7.0.15"`` (``valkey_version`` for
            Valkey, ``fakeredis.__version__`` for fakeredis).
        host: ``"127.0.0.1"``; ``None`` when there is no TCP endpoint
            (fakeredis, a unix-socket-only external server).
        port: TCP port; ``None`` for fakeredis and socket-only servers.
        unix_socket_path: Path of the unix socket, or ``None``.
        data_dir: The server's ``--dir`` (where RDB/AOF files go), or ``None``.
        log_file: The server's log file, or ``None``.
    """

    kind: str
    binary: str | None = None
    version: str = "unknown"
    host: str | None = None
    port: int | None = None
    unix_socket_path: str | None = None
    data_dir: str | None = None
    log_file: str | None = None

    # Private state; not part of the constructor.
    _argv: list[str] = field(default_factory=list, init=False, repr=False)
    _runtime_dir: str | None = field(default=None, init=False, repr=False)
    _console_file: str | None = field(default=None, init=False, repr=False)
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _owner_pid: int | None = field(default=None, init=False, repr=False)
    _password: str | None = field(default=None, init=False, repr=False)
    _username: str | None = field(default=None, init=False, repr=False)
    _db: int = field(default=0, init=False, repr=False)
    _url: str | None = field(default=None, init=False, repr=False)
    _tls: dict[str, Any] | None = field(default=None, init=False, repr=False)  # client ssl_* kwargs
    _fake_server: Any = field(default=None, init=False, repr=False)
    _stopped: bool = field(default=False, init=False, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False, repr=False)

    # ------------------------------------------------------------------ #
    # Construction from a URL (external servers)
    # ------------------------------------------------------------------ #

    @classmethod
    def from_url(cls, url: str, *, allow_remote: bool = False) -> ServerHandle:
        """Make a non-owning handle (kind ``"external"``) for a running server.

        The URL is parsed by :func:`redis.from_url`; ``redis://`` and
        ``unix://`` URLs are accepted. The server is contacted once (PING and
        INFO) to check it answers and to read its version.

        Args:
            url: e.g. ``redis://127.0.0.1:6379/0`` or ``unix:///tmp/r.sock?db=1``.
            allow_remote: Accept hosts other than loopback.

        Returns:
            A handle whose :meth:`stop` and :meth:`restart` do not touch the server.

        Raises:
            ValueError: Unsupported scheme, or a non-loopback host while
                ``allow_remote`` is false.
            redis.exceptions.ConnectionError: The server does not answer.
        """
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        if scheme not in ("redis", "unix"):
            raise ValueError(f"unsupported server URL {url!r}: only redis:// and unix:// URLs are accepted")
        probe = redis.from_url(url, socket_connect_timeout=5, socket_timeout=10, retry=Retry(NoBackoff(), 0))
        try:
            pool_kwargs = dict(probe.connection_pool.connection_kwargs)
            is_unix = issubclass(probe.connection_pool.connection_class, UnixDomainSocketConnection)
            host: str | None = None
            port: int | None = None
            sock_path: str | None = None
            if is_unix:
                if not pool_kwargs.get("path"):
                    raise ValueError(f"unix socket URL {url!r} has no path")
                sock_path = str(pool_kwargs["path"])
            else:
                host = str(pool_kwargs.get("host", "localhost"))
                port = int(pool_kwargs.get("port", 6379))
                if not allow_remote and not _is_loopback_host(host):
                    raise ValueError(
                        f"refusing non-loopback server {host!r} in {url!r}: only 127.0.0.1, "
                        "::1, localhost or a unix socket may be used"
                    )
            probe.ping()
            version = "unknown"
            with contextlib.suppress(redis.RedisError):
                info = probe.info("server")
                version = str(info.get("valkey_version") or info.get("redis_version") or "unknown")
        finally:
            probe.close()

        handle = cls(kind="external", version=version, host=host, port=port, unix_socket_path=sock_path)
        handle._url = url
        handle._db = int(pool_kwargs.get("db") or 0)
        handle._password = pool_kwargs.get("password")
        handle._username = pool_kwargs.get("username")
        return handle

    # ------------------------------------------------------------------ #
    # Connection helpers
    # ------------------------------------------------------------------ #

    @property
    def owned(self) -> bool:
        """Whether this handle started the server (and so may stop it)."""
        return self._proc is not None or (self._fake_server is not None and self._owner_pid is not None)

    @property
    def pid(self) -> int | None:
        """PID of the server process; ``None`` for fakeredis and non-owning handles."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        """Whether the server is up, as far as this handle can tell."""
        if self._stopped:
            return False
        if self._fake_server is not None:
            return bool(self._fake_server.connected)
        if self._proc is not None and self._owner_pid == os.getpid():
            return not self._exited(0)  # does not reap, see _exited
        return True  # not our child: assume it is up

    def _extra_kwargs(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"db": self._db} if self._db else {}
        return {**extra, **login_kwargs(self._username, self._password)}

    def connection_kwargs(self, *, unix: bool = False) -> dict[str, Any]:
        """Keyword arguments to connect to this server.

        They suit both ``tdstore.TensorDictStore(...)`` and
        ``redis.asyncio.Redis(...)`` (for real servers).

        Args:
            unix: Connect through the unix socket instead of TCP.

        Returns:
            ``{"host": ..., "port": ...}`` (TCP), ``{"unix_socket_path": ...}``
            (unix), or ``{"client": FakeRedis}`` for fakeredis (a new
            :class:`fakeredis.aioredis.FakeRedis` on this handle's server).

        Raises:
            ValueError: The requested transport is not available.
        """
        if self._fake_server is not None:
            import fakeredis.aioredis

            return {"client": fakeredis.aioredis.FakeRedis(server=self._fake_server)}
        if unix or self.port is None:
            if self.unix_socket_path is None:
                raise ValueError(f"{self.kind} server has no unix socket (started with unix_socket=False)")
            kwargs: dict[str, Any] = {"unix_socket_path": self.unix_socket_path}
        else:
            kwargs = {"host": self.host, "port": self.port}
            if self._tls is not None:  # the TCP port speaks TLS only; the unix socket is plain
                kwargs.update(self._tls)
        kwargs.update(self._extra_kwargs())
        return kwargs

    def as_user(self, username: str | None, password: str | None) -> ServerHandle:
        """A non-owning handle to the same server that connects as another (ACL) user.

        Its :meth:`stop` and :meth:`restart` do not touch the server; the owning handle
        keeps managing it with its own credentials.
        """
        other = ServerHandle.__new__(ServerHandle)
        other.__setstate__(self.__getstate__())
        other._username = username
        other._password = password
        return other

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``, or ``unix://PATH`` when there is only a socket.

        Raises:
            ValueError: For fakeredis, which has no address.
        """
        if self._url is not None:
            return self._url
        if self._fake_server is not None:
            raise ValueError("a fakeredis server is in-process and has no URL; use connection_kwargs()")
        if self.port is not None and self.host is not None:
            scheme = "rediss" if self._tls is not None else "redis"
            return f"{scheme}://{_format_host(self.host)}:{self.port}/{self._db}"
        if self.unix_socket_path is not None:
            return f"unix://{self.unix_socket_path}?db={self._db}"
        raise ValueError("server has neither a TCP port nor a unix socket")

    def sync_client(self, *, unix: bool = False, **kw: Any) -> redis.Redis:
        """A plain synchronous client (bytes replies), e.g. to inspect wire state.

        Args:
            unix: Connect through the unix socket instead of TCP.
            **kw: Extra arguments for :class:`redis.Redis` (or ``fakeredis.FakeRedis``).

        Returns:
            A new client; close it when done.
        """
        if self._fake_server is not None:
            import fakeredis

            return fakeredis.FakeRedis(server=self._fake_server, **kw)
        kwargs = self.connection_kwargs(unix=unix)
        kwargs.setdefault("socket_connect_timeout", 10)
        kwargs.update(kw)
        return redis.Redis(**kwargs)

    def async_client(self, *, unix: bool = False, **kw: Any) -> redis.asyncio.Redis:
        """A new :class:`redis.asyncio.Redis` client (bytes replies).

        Args:
            unix: Connect through the unix socket instead of TCP.
            **kw: Extra arguments for the client constructor.

        Returns:
            A new client (``fakeredis.aioredis.FakeRedis`` for fakeredis); ``aclose()`` it when done.
        """
        if self._fake_server is not None:
            import fakeredis.aioredis

            return fakeredis.aioredis.FakeRedis(server=self._fake_server, **kw)
        kwargs = self.connection_kwargs(unix=unix)
        kwargs.setdefault("socket_connect_timeout", 10)
        kwargs.update(kw)
        return redis.asyncio.Redis(**kwargs)

    # ------------------------------------------------------------------ #
    # Process management
    # ------------------------------------------------------------------ #

    def _check_owner(self, action: str) -> None:
        if self._owner_pid is not None and self._owner_pid != os.getpid():
            raise RuntimeError(
                f"cannot {action} the {self.kind} server: it was started by process "
                f"{self._owner_pid}, this is process {os.getpid()}"
            )

    def _launch(self, *, startup_timeout: float) -> None:
        """Start the process from ``self._argv`` and wait until it answers PING."""
        assert self._console_file is not None
        with open(self._console_file, "ab") as console:
            proc = subprocess.Popen(  # noqa: S603 - argv built from validated parts
                self._argv,
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                cwd=self._runtime_dir,
                start_new_session=True,
                close_fds=True,
            )
        self._proc = proc
        try:
            self._wait_ready(startup_timeout)
            self._check_identity()
        except BaseException:
            self._kill_process()
            raise

    def _check_identity(self) -> None:
        """Make sure the TCP port is served by our process, and read the version.

        Between picking a free port and the server binding it, another
        process may take the port; PING alone would then reach the wrong
        server. ``INFO server`` reports ``process_id``, which must be ours.
        """
        assert self._proc is not None
        kwargs: dict[str, Any] = (
            {"host": self.host, "port": self.port}
            if self.port is not None and self._tls is None  # a TLS server is checked on its socket
            else {"unix_socket_path": self.unix_socket_path}
        )
        client = redis.Redis(
            **kwargs,
            password=self._password,
            socket_timeout=10,
            socket_connect_timeout=10,
            retry=Retry(NoBackoff(), 0),
        )
        try:
            info = client.info("server")
        except (redis.RedisError, OSError) as exc:
            raise self._startup_failure(f"answered PING but not INFO ({exc})") from exc
        finally:
            client.close()
        pid = int(info.get("process_id", -1))
        if pid != self._proc.pid:
            raise _PortTakenError(
                f"port {self.port} is served by process {pid}, not by the {self.kind} server "
                f"just started (pid {self._proc.pid}): Address already in use"
            )
        self.version = str(info.get("valkey_version") or info.get("redis_version") or "unknown")

    def _startup_failure(self, reason: str) -> RuntimeError:
        log = _tail(self.log_file).rstrip()
        console = _tail(self._console_file).rstrip()
        parts = [f"{self.kind} server ({self.binary}) {reason}", f"command: {shlex.join(self._argv)}"]
        if console:
            parts.append(f"--- console output ---\n{console}")
        if log:
            parts.append(f"--- log {self.log_file} ---\n{log}")
        if not console and not log:
            parts.append("(the server wrote no output)")
        return RuntimeError("\n".join(parts))

    def _wait_ready(self, startup_timeout: float) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + startup_timeout
        delay = 0.01
        tcp_ok = self.port is None or self._tls is not None  # TLS: the plain unix socket answers
        unix_ok = self.unix_socket_path is None
        while True:
            code = self._proc.poll()
            if code is not None:
                raise self._startup_failure(f"exited with status {code} during startup")
            if not tcp_ok:
                tcp_ok = _ping(socket.AF_INET, (self.host, self.port), self._password)
            if tcp_ok and not unix_ok:
                unix_ok = _ping(socket.AF_UNIX, self.unix_socket_path, self._password)
            if tcp_ok and unix_ok:
                return
            if time.monotonic() >= deadline:
                raise self._startup_failure(
                    f"did not answer PING within {startup_timeout:g}s "
                    f"(tcp={'ok' if tcp_ok else 'no'}, unix={'ok' if unix_ok else 'no'})"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)

    def _send_shutdown(self, *, save: bool) -> None:
        """Send ``SHUTDOWN SAVE|NOSAVE`` over a raw connection; errors are ignored.

        A raw socket (not redis-py) keeps this free of client retry policies:
        the caller waits for the process and escalates to signals anyway.
        """
        address: str | tuple[str, int]
        if self.unix_socket_path is not None and os.path.exists(self.unix_socket_path):
            family, address = socket.AF_UNIX, self.unix_socket_path
        elif self.port is not None and self.host is not None:
            family, address = socket.AF_INET, (self.host, self.port)
        else:
            return
        payload = b""
        if self._password is not None:
            payload += _encode_command(b"AUTH", self._password.encode())
        payload += _encode_command(b"SHUTDOWN", b"SAVE" if save else b"NOSAVE")
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(_SHUTDOWN_CMD_TIMEOUT)
                sock.connect(address)
                sock.sendall(payload)
                deadline = time.monotonic() + _SHUTDOWN_CMD_TIMEOUT
                # The server closes the connection when it exits.
                while time.monotonic() < deadline and sock.recv(4096):
                    pass
        except OSError:
            pass

    def _exited(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the process to exit, without reaping it.

        An exited but unreaped process (a zombie) keeps its PID and process
        group ID reserved, so the group can still be signalled safely.
        """
        proc = self._proc
        assert proc is not None
        deadline = time.monotonic() + timeout
        while True:
            if proc.returncode is not None:
                return True
            try:
                if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return True
            except ChildProcessError:  # already reaped elsewhere
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def _kill_process(self, *, graceful: bool = False, save: bool = False) -> None:
        """Make sure the process is gone, then reap it.

        Args:
            graceful: First ask with ``SHUTDOWN`` (else start at SIGTERM).
            save: With ``graceful``, ``SHUTDOWN SAVE`` instead of ``NOSAVE``.
        """
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        if graceful and not self._exited(0):
            self._send_shutdown(save=save)
        if not self._exited(_EXIT_WAIT if graceful else 0):
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            if not self._exited(_EXIT_WAIT):
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                self._exited(_EXIT_WAIT)
        if proc.returncode is None:
            # The leader is now a zombie (or, after SIGKILL failed, still
            # there), so its group ID cannot have been reused: sweep any
            # BGSAVE/AOF-rewrite child left in the server's own session.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=_EXIT_WAIT)

    def _stop_process(self, *, save: bool) -> None:
        self._kill_process(graceful=True, save=save)

    def save(self, *, timeout: float = 600.0) -> None:
        """An RDB snapshot into the server's ``dir`` now (``SAVE``: returns once it is written).

        Raises:
            redis.exceptions.RedisError: The server could not write it (or did not answer in ``timeout`` s).
        """
        client = self.sync_client(socket_timeout=timeout)
        try:
            client.save()
        finally:
            client.close()

    def stop(self) -> None:
        """Stop the server and remove its temporary directory.

        Sends ``SHUTDOWN NOSAVE``, then escalates to SIGTERM and SIGKILL, each
        with a bounded wait. Idempotent. A ``dir`` passed to
        :func:`start_server` is left in place. Non-owning handles (external,
        unpickled) do nothing. For fakeredis, clients of the server start
        failing with ``ConnectionError`` and its data is dropped.

        Raises:
            RuntimeError: Called in a different process from the one that
                started the server (e.g. a forked child).
        """
        with self._lock:
            if self._stopped:
                return
            if not self.owned:
                self._stopped = True
                return
            self._check_owner("stop")
            self._stopped = True
            try:
                if self._fake_server is not None:
                    self._fake_server.connected = False
                    self._fake_server.dbs.clear()
                    self._fake_server.script_cache.clear()
                else:
                    self._stop_process(save=False)
            finally:
                if self._runtime_dir is not None:
                    shutil.rmtree(self._runtime_dir, ignore_errors=True)
                _unregister(self)

    def restart(self, *, save: bool = False, startup_timeout: float = 10.0) -> None:
        """Stop the server and start it again with the same port, socket and dir.

        Like a real restart, the script cache is emptied and the keyspace is
        whatever the server reloads from its data dir (nothing, with the
        default ``--save ""`` and ``--appendonly no``, unless the test ran
        ``SAVE`` or configured persistence). Existing client connections are
        dropped. fakeredis emulates this: the data is dropped unless ``save``.

        A handle that was stopped (or whose server crashed) is started again
        too, with a fresh private temporary directory at the same path.

        Args:
            save: Shut down with ``SHUTDOWN SAVE`` (write an RDB first), so the
                data survives the restart. Ignored when nothing is running.
            startup_timeout: Seconds to wait for the new process to answer.

        Raises:
            RuntimeError: The handle does not own the server, or the server
                failed to come back (the message has its log tail).
        """
        with self._lock:
            if not self.owned:
                raise RuntimeError(f"cannot restart a {self.kind} server this handle did not start")
            self._check_owner("restart")
            if self._fake_server is not None:
                if not save or self._stopped:
                    self._fake_server.dbs.clear()
                self._fake_server.script_cache.clear()
                self._fake_server.connected = True
                self._stopped = False
                return
            was_stopped = self._stopped
            if was_stopped:
                self._recreate_runtime_dir()
            else:
                self._stop_process(save=save)
            if self.unix_socket_path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.unix_socket_path)
            try:
                self._relaunch(startup_timeout)
            except BaseException:
                if was_stopped and self._runtime_dir is not None:
                    shutil.rmtree(self._runtime_dir, ignore_errors=True)
                raise
            if was_stopped:
                self._stopped = False
                _register(self)

    def _recreate_runtime_dir(self) -> None:
        assert self._runtime_dir is not None
        try:
            os.mkdir(self._runtime_dir, 0o700)  # fails if someone else made it meanwhile
        except FileExistsError as exc:
            raise RuntimeError(
                f"cannot restart the {self.kind} server: its directory {self._runtime_dir} "
                "was re-created by someone else"
            ) from exc
        if self.data_dir is not None:
            os.makedirs(self.data_dir, exist_ok=True)

    def _relaunch(self, startup_timeout: float) -> None:
        # The old listener may linger for a moment; retry on "address in use".
        deadline = time.monotonic() + startup_timeout
        while True:
            try:
                self._launch(startup_timeout=max(1.0, deadline - time.monotonic()))
                return
            except RuntimeError as exc:
                if not _port_in_use(exc) or time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    # ------------------------------------------------------------------ #
    # Context manager, pickling
    # ------------------------------------------------------------------ #

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __getstate__(self) -> dict[str, Any]:
        """Pickle as a non-owning handle (for worker processes).

        Raises:
            TypeError: For fakeredis, whose server lives in this process only.
        """
        if self._fake_server is not None:
            raise TypeError("a fakeredis ServerHandle cannot be sent to another process")
        state = dict(self.__dict__)
        for name in ("_proc", "_owner_pid", "_lock", "_argv", "_runtime_dir", "_console_file"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._proc = None
        self._owner_pid = None
        self._lock = threading.RLock()
        self._argv = []
        self._runtime_dir = None
        self._console_file = None


class _PortTakenError(RuntimeError):
    """Another process answered on the port picked for a new server."""


def _port_in_use(exc: BaseException) -> bool:
    if isinstance(exc, _PortTakenError):
        return True
    text = str(exc)
    return any(marker in text for marker in _PORT_IN_USE_MARKERS)


# --------------------------------------------------------------------------- #
# Starting servers
# --------------------------------------------------------------------------- #
