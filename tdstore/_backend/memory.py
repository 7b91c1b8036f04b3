"""The memory guard: refuses, before any byte is sent, a write that would take the server past ``maxmemory``.

Redis and Valkey refuse a write only while they are *already* over their ``maxmemory``: a
single large ``SETRANGE`` (a zero-filled entry), a script, or a ``SET`` whose bytes sit in
the query buffer once read, takes a server that is just under its limit far over it (without
this guard, a 16 MiB ``from_schema`` with 1 MiB free ended at 24 MB used against a 4 MiB
limit on Redis 7; a refused 16 MiB ``from_tensordict`` peaked at 45 MB). On a
machine without that much memory, that is how a server is OOM-killed, with every store on it.

So before a write that carries or allocates at least :data:`GUARD_MIN` bytes
(``from_schema``, whole-entry writes, in place or not, ``from_tensordict``, ``update``,
chunked allocation, entries created by an indexed write), the functions here read
``INFO memory`` (``used_memory``, ``maxmemory``, ``maxmemory_policy``: one command, about
0.15-0.3 ms on loopback, against ~3 ms for a 1 MiB ``SET``) and refuse the write with
:class:`~tdstore.errors.WouldExceedMaxmemoryError` when ``used_memory`` plus :func:`estimate`
of the write would pass ``maxmemory``. Row writes, ``extend``, smaller writes and reads send
nothing more: the server's own refusal covers them (it refuses every write once over the
limit; an indexed write briefly holds up to ~3x its bytes, see docs/deployment.md).

It is a best-effort pre-check: another client writing at the same moment can still take the
server over (the server then refuses the next write), and under an evicting policy the
server makes room by evicting keys (lost data: ``DataLostError``), so there the guard only
refuses a write that cannot fit even in an empty server. A server that refuses ``INFO``
(an ACL without ``+info``, some managed services) is found out once, at connection setup, and
then left to its own refusal. fakeredis has neither ``INFO`` nor a memory limit.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import redis.exceptions

from tdstore._backend.protocols import AsyncClient, AsyncPipeline
from tdstore._core import chunks as _chunks
from tdstore._core.keys import StoreKeys
from tdstore._core.layout import Op, ZeroBytes, byte_view
from tdstore.errors import WouldExceedMaxmemoryError

__all__ = ["GUARD_MIN", "GROWTH_SLACK", "alloc_size", "estimate", "note_setup", "check", "check_ops", "mib", "suggest_limit"]

#: Writes adding fewer bytes than this are not checked (no extra round trip on hot paths).
GUARD_MIN = 1024 * 1024
#: Room a string grown by SETRANGE/APPEND may get beyond its length (Redis's SDS_MAX_PREALLOC).
GROWTH_SLACK = 1024 * 1024
#: Bytes of the server's own bookkeeping per key and string (dict entry, object, SDS header).
KEY_OVERHEAD = 128

#: Clients (one per connection and IO loop) whose server refused ``INFO`` at setup.
_NO_INFO: weakref.WeakSet[Any] = weakref.WeakSet()


def alloc_size(nbytes: int) -> int:
    """The bytes the allocator hands out for a block of ``nbytes`` (jemalloc's size classes).

    Above 16 KiB jemalloc has four classes per power of two, so a block takes up to 25 %
    more than asked for (a 16 MiB string and its header take a 20 MiB block). Measured on
    Redis 7: a 16 MiB zero-filled entry raised ``used_memory`` by 20.0 MiB; Valkey 8 by 16.0.
    """
    if nbytes <= 16 * 1024:
        return -(-nbytes // 16) * 16
    spacing = 1 << ((nbytes - 1).bit_length() - 3)
    return -(-nbytes // spacing) * spacing


def _payload_nbytes(payload: Any) -> int:
    if isinstance(payload, ZeroBytes):
        return payload.n
    return byte_view(payload).nbytes


def estimate(ops: Sequence[Op], *, staged: bool = False, step: int = 16 * 1024 * 1024) -> tuple[int, int]:
    """``(bytes written, bytes the server may need at its peak)`` for committing ``ops``.

    Every string a "put" or "zero" op creates is counted at its allocator size with
    :data:`GROWTH_SLACK` (strings grown step by step keep it); the old value of a replaced
    entry is freed only after the new one is in place, so it is not subtracted. The bytes
    that travel sit in the server's query buffer too while they arrive: all of them for one
    MULTI, one step (``step`` bytes) of a staged upload (``staged``). Measured on Redis 7:
    ``from_tensordict`` of 16 MiB raised ``used_memory`` by 38.7 MiB right after (Valkey 8:
    31.0); :func:`estimate` says 36.0 MiB.
    """
    written = 0
    sent = 0
    needed = 0
    for op in ops:
        if op.op not in ("put", "zero"):
            continue
        if op.op == "zero":
            nbytes = int(op.nbytes or 0)
        else:
            nbytes = _payload_nbytes(op.payload)
            if op.op == "put" and not _is_zero(op.payload):
                sent += nbytes
        written += nbytes
        chunking = _chunks.of_meta(op.meta)
        sizes = [nbytes] if chunking is None else [chunking.length(k) for k in range(chunking.count)]
        needed += sum(alloc_size(size + GROWTH_SLACK + KEY_OVERHEAD) for size in sizes)
    in_flight = min(sent, step) if staged else sent
    return written, needed + (alloc_size(in_flight + KEY_OVERHEAD) if in_flight else 0)


def _is_zero(payload: Any) -> bool:
    return isinstance(payload, ZeroBytes)


def note_setup(client: AsyncClient, info_reply: Any) -> None:
    """Records what ``INFO memory`` answered when ``client`` set its connection up."""
    if isinstance(info_reply, Exception) or not isinstance(info_reply, dict):
        _NO_INFO.add(client)
    else:
        _NO_INFO.discard(client)


def _int(info: dict[Any, Any], name: str) -> int:
    try:
        return int(info.get(name) or 0)
    except (TypeError, ValueError):
        return 0


def mib(nbytes: int) -> str:
    """``nbytes`` in MiB, for messages."""
    return f"{nbytes / (1024 * 1024):.1f} MiB"


def suggest_limit(nbytes: int) -> str:
    """A round proto-max-bulk-len (whole MiB, rounded up to a power of two) that fits ``nbytes``."""
    size = 1
    while size * 1024 * 1024 < nbytes:
        size *= 2
    return f"{size}mb" if size < 1024 else f"{size // 1024}gb"


def _server(client: AsyncClient) -> str:
    try:
        kw = client.connection_pool.connection_kwargs
    except AttributeError:  # pragma: no cover - every redis.asyncio client has a pool
        return "the server"
    if kw.get("path"):
        return f"unix://{kw['path']}"
    return f"{kw.get('host', '?')}:{kw.get('port', '?')}"


async def check(
    client: AsyncClient, keys: StoreKeys, written: int, needed: int, what: str = "this write", *, via: AsyncPipeline | None = None
) -> None:
    """Raises :class:`~tdstore.errors.WouldExceedMaxmemoryError` when ``needed`` more bytes
    would take the server past its ``maxmemory``; reads ``INFO memory`` only when ``written``
    is at least :data:`GUARD_MIN`.

    ``what`` names the operation in the message; ``via``: where to send ``INFO`` (a pipeline
    in immediate mode, under WATCH) instead of ``client``.
    """
    if written < GUARD_MIN or client in _NO_INFO:
        return
    try:
        info = await (client if via is None else via).info("memory")
    except redis.exceptions.ResponseError:  # INFO refused (ACL, managed service): the server decides
        _NO_INFO.add(client)
        return
    limit = _int(info, "maxmemory")
    if not limit:
        return  # no limit: the machine's memory is (see docs/deployment.md)
    used = _int(info, "used_memory")
    policy = str(info.get("maxmemory_policy") or "noeviction")
    if policy == "noeviction":
        if used + needed <= limit:
            return
        room = max(0, limit - used)
        state = f"used_memory is {used:,} bytes, {mib(room)} left"
    else:
        # the server evicts keys to make room (lost data, reported as DataLostError): refuse
        # only what cannot fit even once everything evictable is gone
        base = _int(info, "used_memory_startup")
        if base + needed <= limit:
            return
        room = max(0, limit - base)
        state = f"an empty server uses {base:,} bytes, {mib(room)} left even after evicting every key"
    raise WouldExceedMaxmemoryError(
        f"{what} to TensorDictStore(td_id={keys.td_id!r}, prefix={keys.prefix!r}) writes {written:,} bytes "
        f"({mib(written)}; about {mib(needed)} of server memory at its peak), which would take the server "
        f"{_server(client)} past its maxmemory of {limit:,} bytes ({mib(limit)}; {state}, policy "
        f"{policy}). Nothing of this operation was applied: it was refused before anything was sent. "
        "Free memory on the server (clear_redis() the stores you no longer need), raise its limit "
        f"(CONFIG SET maxmemory, at least {mib(used + needed)} here), or write less at once "
        "(see docs/deployment.md, 'Memory and eviction')."
    )


async def check_ops(
    client: AsyncClient, keys: StoreKeys, ops: Sequence[Op], *, staged: bool = False, what: str = "this write", via: AsyncPipeline | None = None
) -> None:
    """:func:`check` for committing ``ops`` (see :func:`estimate`); the message names their entries."""
    written, needed = estimate(ops, staged=staged)
    if written < GUARD_MIN:
        return
    if what == "this write":
        paths = [op.path for op in ops if op.op in ("put", "zero")]
        named = ", ".join(repr(p[0] if len(p) == 1 else p) for p in paths[:3])
        more = f" (+{len(paths) - 3} more)" if len(paths) > 3 else ""
        what = f"writing {'entry' if len(paths) == 1 else 'entries'} {named}{more}"
    await check(client, keys, written, needed, what, via=via)
