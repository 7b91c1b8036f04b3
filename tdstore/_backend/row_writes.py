"""Indexed writes: ``(path, runs, payload)`` groups of row runs written in one atomic step,
by the ``write_runs`` script (many small runs) or by SETRANGEs in a WATCH-guarded MULTI
(few large runs, bytes straight from the tensor's memory; :func:`choose_write` picks), with
the entries, chunks and non-tensor values such a write creates in the same MULTI.

Moved out of :mod:`tdstore._backend.ops` as they were; the blocking-client form of the
guarded MULTI is :mod:`tdstore._backend.armed_write`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import redis.exceptions

from tdstore._backend import large as _large
from tdstore._backend import lease as _lease
from tdstore._backend import memory as _memory
from tdstore._backend import wire as _wire
from tdstore._backend.ops import _nbytes, _raise_first_error
from tdstore._backend.protocols import AsyncClient
from tdstore._backend.scripts import ScriptRunner
from tdstore._core import chunks as _chunks
from tdstore._core.keys import StoreKeys, encode_path
from tdstore._core.layout import Arg, _s, counter_damage, data_key_commands, data_key_damage, parse_entry

if TYPE_CHECKING:
    from redis.asyncio.connection import AbstractConnection

    from tdstore._backend.ops import Op

__all__ = ["MULTI_MIN_RUN", "choose_write", "write_runs_call", "write_runs_watched"]


def write_runs_call(
    keys: StoreKeys, groups: Sequence[tuple[tuple[str, ...], Sequence[tuple[int, int]], Any]], *, expected: str
) -> tuple[str, list[str], list[Arg]]:
    """The one script call that writes ``(path, runs, payload)`` groups atomically: (name,
    keys, args) for ``Connection.script`` (sent twice, it lands the same bytes)."""
    key_list, args = _write_runs_args(keys, groups, expected)
    return "write_runs", key_list, args


def _write_runs_args(
    keys: StoreKeys, groups: Sequence[Any], expected: str, extra: Mapping[tuple[str, ...], Any] | None = None
) -> tuple[list[str], list[Any]]:
    key_list: list[str] = [keys.meta, keys.wv]
    args: list[Any] = [expected]
    for key, runs, payload in _chunks.key_groups(keys, groups, extra):
        key_list.append(key)
        args.append(str(len(runs)))
        for offset, length in runs:
            args.append(str(offset))
            args.append(str(length))
        args.append(payload)
    return key_list, args


#: Runs at least this long (bytes, on average) are written by SETRANGE commands in a
#: WATCH-guarded MULTI instead of through the write_runs script.
MULTI_MIN_RUN = 4096


def choose_write(groups: Sequence[tuple[tuple[str, ...], Sequence[tuple[int, int]], Any]]) -> str:
    """How to write indexed runs: "lua" (the write_runs script) or "multi" (SETRANGEs).

    Measured (benchmarks/bench_index.py): Lua costs little per command but copies every
    byte twice more than a plain SETRANGE, so few large runs go faster as commands whose
    bytes come straight from the tensor's memory, and many small runs through Lua.
    """
    return "multi" if any(_large_runs(runs) for _, runs, _ in groups) else "lua"


def _large_runs(runs: Sequence[tuple[int, int]]) -> bool:
    total = sum(length for _, length in runs)
    return bool(runs) and total >= MULTI_MIN_RUN * len(runs)


async def write_runs_watched(
    client: AsyncClient,
    keys: StoreKeys,
    runner: ScriptRunner,
    groups: Sequence[tuple[tuple[str, ...], Sequence[tuple[int, int]], Any]],
    *,
    expected: str,
    check_lock: bool = False,
    small_via_script: bool = True,
    creates: Sequence[Op] = (),
    nontensor: Sequence[tuple[tuple[str, ...], Any]] = (),
) -> bool:
    """Writes runs with SETRANGE in one MULTI, guarded by WATCH on the store's meta hash.

    The meta hash changes only with the layout (keys, shapes, dtypes, lock, batch size),
    so the server runs the transaction only if the layout is still the one the runs
    were planned against; concurrent row writers do not abort each other. Same guarantee
    as the write_runs script: all runs of all entries land in one step, or none. Entries
    with small runs go through the write_runs script inside the same MULTI (its script is
    checked to be loaded before MULTI, so it cannot fail there with NOSCRIPT).

    In the same step it can create zero-filled entries (``creates``: "zero" ops) and
    update non-tensor entries element-wise: for each ``(path, update)`` of ``nontensor``
    the current bytes and metadata are read under WATCH (so a concurrent write of that
    entry aborts and retries this one), ``update(meta, bytes)`` returns the new
    ``(meta, bytes)``, and both are written in the MULTI.

    Returns:
        True when the layout changed (new entries, or a non-tensor entry's metadata).

    Raises:
        StaleLayoutError: the layout version differs, or something watched changed.
        StoreNotFoundError: the store does not exist.
    """
    from tdstore.errors import StaleLayoutError, StoreLockedError, StoreNotFoundError

    def large(runs: Sequence[tuple[int, int]]) -> bool:
        return not small_via_script or _large_runs(runs)

    nt_keys = [keys.data(path) for path, _ in nontensor]
    created = {op.path: _chunks.of_meta(op.meta) for op in creates}
    # the keys the MULTI's SETRANGEs (and write_runs) write, but those it creates
    data_keys = sorted(_chunks.written_keys(keys, groups, created) - {key for op in creates for key in _created_keys(keys, op)})
    async with client.pipeline(transaction=True) as pipe:
        await pipe.watch(keys.meta, *nt_keys)
        # one packet: the layout, the write version and the data keys' types. The MULTI's INCR
        # (or write_runs' check) of a damaged write version, or a SETRANGE into a key of
        # another type, would be refused after writes a server does not roll back
        meta, wv_raw, *checks = await _wire.exchange(
            cast("AbstractConnection", pipe.connection),  # (watch() took one; the pipeline holds it)
            [("HMGET", keys.meta, "lv", "lock", "exp", "ne"), ("GET", keys.wv), *data_key_commands(data_keys)]
        )
        if isinstance(meta, Exception):
            raise meta
        lv, lock, exp, count = meta
        if lv is None:
            raise StoreNotFoundError(f"no store at {keys.meta}")
        if _s(lv) != expected:
            raise StaleLayoutError(f"layout version is {_s(lv)}, client assumed {expected}")
        if check_lock and _s(lock) == "1":
            raise StoreLockedError(f"the store at {keys.meta} is locked")
        damage = counter_damage(wv_raw, keys.wv)
        if damage is not None:
            raise damage
        damage, exists = data_key_damage(data_keys, checks, keys.base)
        if damage is not None:
            raise damage
        nt_writes = []
        layout_changed = bool(creates)
        new_fields = len(creates)  # registry fields this step adds (the meta field "ne")
        if nontensor:
            fields = [encode_path(path) for path, _ in nontensor]
            metas = await pipe.hmget(keys.reg, fields)
            for (_path, update), key, field, meta_raw in zip(nontensor, nt_keys, fields, metas, strict=True):
                old_meta = parse_entry(_path, meta_raw, keys.base) if meta_raw is not None else None
                old = await pipe.get(key) if old_meta is not None else None
                try:
                    new_meta, payload = update(old_meta, old)
                except Exception:
                    # metadata and bytes come from two reads: a whole write of the entry in
                    # between pairs them wrongly (the WATCH would abort this step). A stale
                    # read, retried as any other; the same pair read again is real damage.
                    if await pipe.hget(keys.reg, field) != meta_raw or await pipe.get(key) != old:
                        raise StaleLayoutError(f"the non-tensor entry {_path!r} of {keys.base} changed while read") from None
                    raise
                nt_writes.append((key, field, new_meta, payload))
                if old_meta is None:
                    new_fields += 1
                if new_meta != old_meta:
                    layout_changed = True
        if small_via_script and not exists:
            # a SETRANGE into an evicted key would recreate it zero-padded: refuse instead (a
            # whole entry written in place recreates its key whole)
            from tdstore.errors import DataLostError

            raise DataLostError(f"an entry written at {keys.base} is registered but its bytes are gone from the server")
        if creates:  # zero-filled entries allocate on the server: refuse what would pass maxmemory
            await _memory.check_ops(client, keys, creates, via=pipe)
        elif not small_via_script:
            # a whole-entry write in place (its only caller): no new string, but its bytes sit in
            # the server's query buffer until EXEC; row writes (small_via_script) are not checked
            sent = sum(_nbytes(p) for _, _, p in groups)
            await _memory.check(
                client, keys, sent, _memory.alloc_size(sent + _memory.KEY_OVERHEAD),
                "writing " + ", ".join(repr(g[0][0] if len(g[0]) == 1 else g[0]) for g in groups[:3]), via=pipe,
            )
        if layout_changed:
            # readers' leases hold the layout still (tdstore/_backend/lease.py): optimistic() waits
            await pipe.watch(keys.rl)
            left = await _lease.leased(pipe, keys)
            if left is not None:
                raise _lease.busy_error(keys, left)
        small = [g for g in groups if not large(g[1])]
        if small:
            await runner.ensure_loaded(pipe, "write_runs")
        pipe.multi()
        for op in creates:
            chunking = _chunks.of_meta(op.meta)
            sizes = [int(op.nbytes or 0)] if chunking is None else [chunking.length(k) for k in range(chunking.count)]
            for data_key, size in zip(_created_keys(keys, op), sizes, strict=True):
                pipe.delete(data_key)
                if size:
                    pipe.setrange(data_key, size - 1, b"\0")
                else:
                    pipe.set(data_key, b"")
            assert op.meta is not None
            pipe.hset(keys.reg, encode_path(op.path), op.meta.to_json())
        if small:
            key_list, args = _write_runs_args(keys, small, expected, created)
            runner.queue(pipe, "write_runs", key_list, args)  # checks the version, bumps wv
        else:
            pipe.incr(keys.wv)
        for key, offset, data in _chunks.setrange_commands(keys, [g for g in groups if large(g[1])], created):
            pipe.setrange(key, offset, data)
        for key, field, new_meta, payload in nt_writes:
            pipe.set(key, payload)
            pipe.hset(keys.reg, field, new_meta.to_json())
        exp_ms = _s(exp)
        if exp_ms:
            # a store with an expiry: the keys this step creates (or SET, which drops a
            # TTL) expire with it; the meta hash is WATCHed, so "exp" cannot change meanwhile
            for key in [key for op in creates for key in _created_keys(keys, op)] + [key for key, _, _, _ in nt_writes]:
                pipe.pexpireat(key, int(exp_ms))
            if creates or nt_writes:
                pipe.pexpireat(keys.reg, int(exp_ms))
            pipe.pexpireat(keys.wv, int(exp_ms))
        if new_fields and count is not None:
            pipe.hincrby(keys.meta, "ne", new_fields)  # the registry's field count (commit.lua)
        if layout_changed:
            pipe.hincrby(keys.meta, "lv", 1)
        try:
            async with _large.streamed(pipe, sum(_nbytes(p) for _, _, p in groups)):
                replies = await pipe.execute(raise_on_error=False)
        except redis.exceptions.WatchError:
            raise StaleLayoutError("the layout changed during an indexed write") from None
    _raise_first_error(replies)
    return layout_changed


def _created_keys(keys: StoreKeys, op: Op) -> list[str]:
    """The keys a "zero" op creates."""
    return keys.entry_keys(op.path, _chunks.of_meta(op.meta))
