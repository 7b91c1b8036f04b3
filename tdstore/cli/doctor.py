"""``tdstore doctor``: is this server fit to hold tdstore data?

One connection (the same options as every subcommand), a few read-only commands (sent by
:func:`tdstore._backend.probe.probe_server`; this module only judges and formats what they
answered), and one line per item with its verdict and, when it is not ``ok``, the fix:

- ``eviction``: ``maxmemory-policy`` other than ``noeviction`` with a ``maxmemory`` set lets the
  server delete keys to make room: an evicted entry is lost data (**fail**);
- ``memory``: how full the server is against its ``maxmemory``;
- ``proto-max-bulk-len`` and ``client-query-buffer-limit``: the largest string the server takes,
  against the largest entry stored on it (**fail** when an entry there no longer fits), or
  against the 512 MB default when it holds no store;
- ``persistence``: RDB snapshots and the append-only file (off: a restart loses every store);
- ``scripts``: EVAL works (tdstore's writes are Lua scripts: **fail** without), and whether the
  server takes script flags (``#!lua``; Redis 6 and KeyDB do not: tdstore then sends the
  scripts without them);
- ``server`` and ``lua``: the versions; ``cluster``: cluster mode; ``latency``: the median
  round trip of a PING; ``transport``: tcp, tls or unix socket.

The exit status is 1 when an item would lose data or stop tdstore from working (a ``fail``),
else 0. ``--json`` prints one document with every item.
"""

from __future__ import annotations

import argparse
import statistics
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from tdstore.cli.commands import ConnOptions

__all__ = ["run_doctor", "diagnose", "format_doctor"]

#: the servers' default ``proto-max-bulk-len``: entries up to it are ordinary
TYPICAL_ENTRY = 512 * 1024 * 1024
#: PINGs timed for the latency
PINGS = 20
#: stores whose entries are looked at for the largest one (the largest stores first)
LARGEST_STORES = 20
#: a ``maxmemory`` more used than this gets a warning
MEMORY_WARN = 0.9

def _mb(n: int | None) -> str:
    if n is None:
        return "?"
    if n >= 1024**3 and n % 1024**3 == 0:
        return f"{n // 1024**3} GiB"
    if n >= 1024**2:
        return f"{n / 1024**2:.1f} MiB".replace(".0 MiB", " MiB")
    return f"{n} bytes"


def _item(name: str, status: str, value: object, detail: str, fix: str | None = None) -> dict[str, Any]:
    return {"name": name, "status": status, "value": value, "detail": detail, "fix": fix}


def _int(value: object) -> int | None:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None


def _largest_entry(opts: ConnOptions) -> tuple[int, str | None, int]:
    """``(bytes, "td_id key", number of stores)`` of the largest entry of the stores on the server."""
    from tdstore.cli.stores import list_store_infos, store_info

    stores = list_store_infos(opts, None)
    best, where = 0, None
    for summary in sorted(stores, key=lambda s: -int(s.get("bytes") or 0))[:LARGEST_STORES]:
        try:
            info = store_info(opts, summary["prefix"], summary["td_id"])
        except Exception:  # noqa: BLE001 - a store deleted or damaged meanwhile: the others still count
            continue
        for entry in info.get("entries", []):
            size = entry.get("bytes") or 0
            if size > best:
                best, where = size, f"{summary['td_id']} {'.'.join(entry['key'])}"
    return best, where, len(stores)


def _limit_item(name: str, limit: int | None, largest: int, where: str | None, nstores: int) -> dict[str, Any]:
    raise_it = f"CONFIG SET {name} {max(largest * 2, TYPICAL_ENTRY) // 1024**2}mb (and the same line in the " \
        "server's config file), or create stores with chunk_bytes= (docs/chunked.md)"
    if limit is None:
        return _item(name, "warn", None, "the server does not say (CONFIG GET refused); tdstore then assumes "
                     "512 MiB", "allow CONFIG GET to this user, or check the limit with the server's operator")
    if nstores and largest > limit:
        return _item(name, "fail", limit, f"{_mb(limit)}: less than the largest entry stored here "
                     f"({_mb(largest)}, {where}); a whole write of it is refused", raise_it)
    if limit < TYPICAL_ENTRY:
        against = f"largest entry here {_mb(largest)}" if nstores else "no store here yet"
        return _item(name, "warn", limit, f"{_mb(limit)}, under the usual 512 MiB ({against}): larger entries are "
                     "refused (EntryTooLargeError)", raise_it)
    against = f"largest entry here {_mb(largest)}" if nstores else "no store here yet; typical entries fit"
    return _item(name, "ok", limit, f"{_mb(limit)} ({against})")


def diagnose(opts: ConnOptions, *, pings: int = PINGS) -> list[dict[str, Any]]:
    """Every item of ``tdstore doctor`` for the server of ``opts`` (a :class:`~tdstore.cli.ConnOptions`)."""
    from tdstore._backend.probe import probe_server

    # with --cluster: the node given (doctor checks one server)
    return _diagnose(probe_server(opts.redis_kwargs(), pings=pings), opts)


def _diagnose(facts: Any, opts: ConnOptions) -> list[dict[str, Any]]:
    """The items for the facts a server answered (:class:`~tdstore._backend.probe.ServerFacts`)."""
    items: list[dict[str, Any]] = []
    info = facts.info
    config = facts.config
    if facts.info_refused is not None:
        items.append(_item("permissions", "warn", False, f"INFO is refused to this user ({facts.info_refused}): the "
                           "items below that depend on it (and on CONFIG GET) are incomplete",
                           "run tdstore doctor as a user allowed INFO and CONFIG GET (e.g. the server's admin)"))

    # -- server and cluster
    name = "valkey" if info.get("server_name") == "valkey" or "valkey_version" in info else "redis"
    if "dragonfly_version" in info:
        name = "dragonfly"
    elif any(k.startswith("keydb") for k in info) or "mvcc_depth" in info:
        name = "keydb"
    version = str(info.get(f"{name}_version") or info.get("redis_version") or "?")
    items.append(_item("server", "info", f"{name} {version}", f"{name} {version}, redis_version "
                       f"{info.get('redis_version', '?')}, {info.get('redis_mode', 'standalone')} mode"))
    cluster = bool(_int(info.get("cluster_enabled")))
    items.append(_item(
        "cluster", "info", cluster,
        "cluster mode on: each store lives in one hash slot (one node); ShardedStore spreads one over the nodes"
        if cluster else "not a cluster (standalone server)",
        ("connect with --cluster (cluster_nodes= in code)" if cluster and not opts.cluster else None),
    ))

    # -- scripts, script flags, Lua
    lua = facts.lua
    scripts = facts.eval_refused is None
    if not scripts:
        items.append(_item("scripts", "fail", False, f"EVAL is refused ({facts.eval_refused}): every tdstore write is "
                           "a Lua script, so stores cannot be written",
                           "allow EVAL, EVALSHA and SCRIPT to this user (ACL +@scripting), or use a server "
                           "with Lua scripting"))
    if scripts:
        flags = facts.script_flags
        items.append(_item(
            "scripts", "ok" if flags else "warn", {"eval": True, "flags": flags},
            "scripts run; script flags (#!lua) supported" if flags else
            "scripts run, but the server does not take script flags (#!lua; Redis 6, KeyDB): tdstore sends its "
            "scripts without them, so read-only scripts cannot run on replicas (EVAL_RO)",
            None if flags else "upgrade to Redis 7+ or Valkey 7+ for script flags"))
        items.append(_item("lua", "info", lua, lua or "?"))

    # -- eviction and memory
    policy = config.get("maxmemory-policy") or info.get("maxmemory_policy")
    maxmemory = _int(config.get("maxmemory") or info.get("maxmemory"))
    used = _int(info.get("used_memory"))
    noeviction = "SET maxmemory-policy noeviction (CONFIG SET maxmemory-policy noeviction, and in the config " \
        "file): the server then refuses writes when full instead of deleting keys"
    if policy is None:
        items.append(_item("eviction", "warn", None, "the server does not say its maxmemory-policy",
                           "check with the server's operator that it is noeviction"))
    elif policy != "noeviction" and maxmemory:
        items.append(_item("eviction", "fail", policy, f"maxmemory-policy {policy} with maxmemory {_mb(maxmemory)}: "
                           "when full, the server deletes keys; an evicted entry is lost data "
                           "(DataLostError)", noeviction))
    elif policy != "noeviction":
        items.append(_item("eviction", "warn", policy, f"maxmemory-policy {policy}, but no maxmemory: nothing is "
                           "evicted until a maxmemory is set", noeviction))
    else:
        items.append(_item("eviction", "ok", policy, "noeviction: when full, the server refuses writes and "
                           "deletes nothing"))
    if maxmemory:
        share = (used or 0) / maxmemory
        items.append(_item(
            "memory", "warn" if share > MEMORY_WARN else "ok", {"used": used, "maxmemory": maxmemory},
            f"{_mb(used)} used of maxmemory {_mb(maxmemory)} ({share:.0%})",
            "raise maxmemory, or delete stores (tdstore ls / rm)" if share > MEMORY_WARN else None))
    else:
        items.append(_item("memory", "info", {"used": used, "maxmemory": 0},
                           f"{_mb(used)} used; no maxmemory: the server grows until the machine runs out "
                           "(and the OS may kill it)", "set maxmemory (with noeviction) below the machine's RAM"))

    # -- string limits against the entries stored here
    try:
        largest, where, nstores = _largest_entry(opts)
    except Exception:  # noqa: BLE001 - the listing is a bonus; the limits are still checked
        largest, where, nstores = 0, None, 0
    for limit_name in ("proto-max-bulk-len", "client-query-buffer-limit"):
        items.append(_limit_item(limit_name, _int(config.get(limit_name)), largest, where, nstores))

    # -- persistence
    save = config.get("save")
    aof = config.get("appendonly")
    if aof is None:
        aof = "yes" if _int(info.get("aof_enabled")) else "no"
    rdb = bool(save and save.strip())
    bad_save = info.get("rdb_last_bgsave_status") not in (None, "ok")
    bad_aof = info.get("aof_last_write_status") not in (None, "ok")
    if save is None and "aof_enabled" not in info and config.get("appendonly") is None:
        items.append(_item("persistence", "warn", None, "the server does not say (CONFIG GET and INFO refused)",
                           "check with the server's operator that snapshots or the append-only file are on"))
    elif bad_save or bad_aof:
        items.append(_item("persistence", "fail", {"save": save, "appendonly": aof},
                           f"the last {'RDB snapshot' if bad_save else 'append-only write'} failed: writes since "
                           "then are not on disk (and the server may refuse writes)",
                           "read the server's log; free disk space or fix the data directory's permissions"))
    elif aof == "yes" or rdb:
        what = ", ".join(x for x in ("append-only file" if aof == "yes" else "", f"RDB snapshots ({save})"
                                     if rdb else "") if x)
        items.append(_item("persistence", "ok", {"save": save, "appendonly": aof}, what))
    else:
        items.append(_item("persistence", "warn", {"save": save, "appendonly": aof},
                           "neither RDB snapshots nor an append-only file: a restart of the server loses every "
                           "store on it", "CONFIG SET appendonly yes (and in the config file), or a save "
                           "schedule; or keep only data you can rebuild here"))

    # -- latency and transport
    times = facts.ping_times
    median_ms = statistics.median(times) * 1000
    items.append(_item("latency", "info", round(median_ms, 3),
                       f"median PING round trip {median_ms:.3f} ms (max {max(times) * 1000:.3f} ms, {len(times)} pings)"))
    if opts.unix_socket_path:
        transport, detail = "unix", f"unix socket {opts.unix_socket_path} (the fastest, same machine only)"
    elif opts.ssl:
        transport, detail = "tls", f"TLS to {opts.host}:{opts.port}"
    else:
        transport, detail = "tcp", f"TCP to {opts.host}:{opts.port}, not encrypted"
    fix = None
    if transport == "tcp" and opts.host not in ("localhost", "127.0.0.1", "::1"):
        fix = "use --tls (rediss://) over a network you do not control (docs/security.md)"
    items.append(_item("transport", "info", transport, detail, fix))
    return items


def format_doctor(items: list[dict[str, Any]], server: str) -> str:
    """The text report: one line per item, its fix below it."""
    lines = [f"tdstore doctor: {server}"]
    for item in items:
        lines.append(f"{item['status'].upper():<5} {item['name']:<26} {item['detail']}")
        if item["fix"] and item["status"] != "ok":
            lines.append(f"{'':<5} {'':<26} fix: {item['fix']}")
    fails = sum(item["status"] == "fail" for item in items)
    warns = sum(item["status"] == "warn" for item in items)
    verdict = (f"{fails} problem(s) that can lose data or stop tdstore from working" if fails
               else "fit to hold tdstore data")
    lines.append(f"verdict: {verdict}; {warns} warning(s)")
    return "\n".join(lines) + "\n"


def run_doctor(opts: ConnOptions, args: argparse.Namespace, out: TextIO) -> int:
    """Runs ``tdstore doctor``; 1 when an item fails, else 0."""
    import json

    items = diagnose(opts)
    ok = not any(item["status"] == "fail" for item in items)
    if args.json:
        json.dump({"server": opts.describe(), "ok": ok, "items": items}, out, indent=2)
        out.write("\n")
    else:
        out.write(format_doctor(items, opts.describe()))
    return 0 if ok else 1
