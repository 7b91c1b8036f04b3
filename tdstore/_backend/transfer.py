"""Long transfers in chunks, so that a progress bar can follow them; same guarantees as one step.

Used only when a transfer shows a progress bar (:mod:`tdstore._core.progress`); otherwise the
store writes with one MULTI/EXEC (:func:`tdstore._backend.ops.commit`) and reads with one
(:func:`tdstore._backend.ops.read_entries`).

* Upload (:func:`commit_staged`): the bytes of every "put" op go to their tmp keys before
  the commit, in chunks (``SET ... PX``, then ``APPEND``); zero-filled entries are grown
  in tmp keys chunk by chunk (``SETRANGE``). Then the ``commit`` script renames them all
  into place, registers them and bumps the versions in one step, exactly as it does when
  the SETs share its MULTI. Readers never see the tmp keys; if anything fails before the
  commit, the tmp keys are deleted (and carry a TTL in case the client dies).
* Download (:func:`read_staged`): the layout and the write version are read in one
  snapshot, then the entries in chunks (``GET``, or ``GETRANGE`` for large ones), each
  chunk followed on the same connection by the write and layout versions. Every write
  bumps one of them, so while both are unchanged no write came in between and the bytes
  form one snapshot; at the first change the read stops and the caller reads again (and
  after a few tries falls back to the one-MULTI read), having lost at most one chunk.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from tdstore._backend import lease as _lease
from tdstore._backend import memory as _memory
from tdstore._backend import ops as _backend
from tdstore._backend.ops import Layout, Op, ZeroBytes, byte_view, parse_layout
from tdstore._backend.protocols import AsyncClient, AsyncPipeline
from tdstore._backend.scripts import ScriptRunner
from tdstore._backend.step import read_snapshot
from tdstore._core import chunks as _chunks
from tdstore._core import progress as _progress
from tdstore._core.keys import StoreKeys
from tdstore._core.layout import Entry
from tdstore._core.progress import Progress

__all__ = ["CHUNK", "commit", "commit_staged", "read_staged", "STALE", "upload_bar", "download_bar", "leaf_sizes"]

#: Bytes per round trip of a chunked transfer (one progress step).
CHUNK = 16 * 1024 * 1024
#: Bytes a zero-filled entry grows by per SETRANGE (also keeps each server step short).
ZERO_CHUNK = 64 * 1024 * 1024
#: The tmp keys of a staged upload get this TTL again every :data:`REFRESH_S` seconds.
REFRESH_S = 60.0

#: Chunked reads tried before a read falls back to one MULTI/EXEC (under many writers).
STAGED_TRIES = 3

#: Returned by :func:`read_staged` when a write came in between: read again.
STALE = object()


class _Handle(Protocol):
    """A store handle as the bars read it: its connection, whose ``progress`` is ``progress=``."""

    @property
    def _conn(self) -> object: ...


def _choice(store: _Handle) -> bool | None:
    """The store's ``progress=`` (None when not given), shared by its nested handles."""
    return getattr(store._conn, "progress", None)


def upload_bar(store: _Handle, ops: Sequence[Op], progress: bool | None = None) -> Progress | None:
    """The bar of a commit of ``ops`` (None: this one shows none); ``progress``: the call's choice."""
    choice = _progress.enabled(progress, _choice(store))
    if choice is False:
        return None
    total = 0
    for op in ops:
        if op.op == "zero":
            total += int(op.nbytes or 0)
        elif op.op == "put":
            total += byte_view(op.payload).nbytes
    # automatic mode: small writes (the common case) are decided before asking the terminal
    if choice is None and (total < _progress.AUTO_MIN_BYTES or not _progress.stderr_is_tty()):
        return None
    if not any(op.op in ("put", "zero") for op in ops):
        return None
    return _progress.start(total, "upload", choice)


def download_bar(
    store: _Handle, leaves: Sequence[tuple[tuple[str, ...], Entry]], progress: bool | None = None
) -> tuple[Progress | None, list[int | None]]:
    """The bar of a read of ``leaves`` (path, metadata), and each leaf's byte size where known."""
    choice = _progress.enabled(progress, _choice(store))
    if choice is False or (choice is None and not _progress.stderr_is_tty()):
        return None, []
    sizes = leaf_sizes(leaves)
    return _progress.start(sum(size or 0 for size in sizes), "download", choice), sizes


def leaf_sizes(leaves: Sequence[tuple[tuple[str, ...], Entry]]) -> list[int | None]:
    """The byte size of each leaf (path, metadata) where the metadata tells it (tensors), else None."""
    return [meta.nbytes if meta.is_tensor else None for _, meta in leaves]


async def commit(
    client: AsyncClient,
    keys: StoreKeys,
    runner: ScriptRunner,
    ops: Sequence[Op],
    *,
    progress: Progress | None = None,
    **commit_kwargs: Any,
) -> int:
    """:func:`tdstore._backend.ops.commit`, or :func:`commit_staged` when ``progress`` is a bar (closed here).

    Zero-filled chunked entries and large writes of chunked entries are staged too (without
    a bar): their chunks are grown or sent in separate steps before the commit, so no server
    step moves or zero-fills much more than one chunk.
    """
    if progress is None:
        if _needs_staging(ops):
            return await commit_staged(client, keys, runner, ops, _Silent(), **commit_kwargs)  # type: ignore[arg-type]
        return await _backend.commit(client, keys, runner, ops, **commit_kwargs)
    try:
        return await commit_staged(client, keys, runner, ops, progress, **commit_kwargs)
    finally:
        progress.close()


#: Writes of chunked entries from this many bytes on are staged chunk by chunk (see commit()).
STAGE_CHUNKED_MIN = 32 * 1024 * 1024


def _needs_staging(ops: Sequence[Op]) -> bool:
    """Whether ``ops`` zero-fill a chunked entry, or carry :data:`STAGE_CHUNKED_MIN` bytes of chunked entries."""
    total = 0
    for op in ops:
        if op.meta is None or op.meta.chunk is None:
            continue
        if op.op == "zero":
            return True
        if op.op == "put":
            total += byte_view(op.payload).nbytes
    return total >= STAGE_CHUNKED_MIN


class _Silent:
    """A progress object that shows nothing (a staged commit without a bar)."""

    what = ""

    def update(self, nbytes: int) -> None:
        pass

    def set_status(self, status: str) -> None:
        pass


async def grow_zeros(client: AsyncClient, tmp: str, n: int, on_step: Any) -> None:
    """Creates the tmp key ``tmp`` holding ``n`` zero bytes, :data:`ZERO_CHUNK` bytes per
    server step; ``on_step(nbytes)`` after each step."""
    await client.set(tmp, b"", px=_backend.TMP_TTL_MS)
    grown = 0
    while grown < n:
        end = min(grown + ZERO_CHUNK, n)
        await client.setrange(tmp, end - 1, b"\0")  # the bytes up to end are zeros
        on_step(end - grown)
        grown = end


async def commit_staged(
    client: AsyncClient,
    keys: StoreKeys,
    runner: ScriptRunner,
    ops: Sequence[Op],
    progress: Progress,
    **commit_kwargs: Any,
) -> int:
    """:func:`tdstore._backend.ops.commit`, with the bytes sent ahead in chunks; returns the layout version."""
    staged = [
        Op("put", op.path, op.meta, payload=ZeroBytes(int(op.nbytes))) if op.op == "zero" and op.nbytes else op
        for op in ops
    ]
    key_list, args, tmp_payloads = _backend.commit_args(keys, staged, **commit_kwargs)
    # refuses what would take the server past maxmemory, before the first step
    await _memory.check_ops(client, keys, staged, staged=True)
    sent: list[str] = []
    try:
        refreshed = time.monotonic()
        batch: list[tuple[str, Any]] = []
        batch_bytes = 0

        async def flush() -> None:
            nonlocal batch, batch_bytes
            if batch:
                async with client.pipeline(transaction=False) as pipe:
                    for tmp, view in batch:
                        pipe.set(tmp, view, px=_backend.TMP_TTL_MS)
                    _raise_first(await pipe.execute(raise_on_error=False))
                progress.update(batch_bytes)
            batch, batch_bytes = [], 0

        for tmp, payload in tmp_payloads:
            sent.append(tmp)
            if time.monotonic() - refreshed > REFRESH_S:
                # a long upload: keep the tmp keys sent so far alive until the commit
                await flush()
                async with client.pipeline(transaction=False) as pipe:
                    for key in sent:
                        pipe.pexpire(key, _backend.TMP_TTL_MS)
                    await pipe.execute()
                refreshed = time.monotonic()
            if isinstance(payload, ZeroBytes):
                await flush()
                await grow_zeros(client, tmp, payload.n, progress.update)
                continue
            view = byte_view(payload)
            if view.nbytes <= CHUNK:
                batch.append((tmp, view))
                batch_bytes += view.nbytes
                if batch_bytes >= CHUNK:
                    await flush()
                continue
            await flush()
            await client.set(tmp, view[:CHUNK], px=_backend.TMP_TTL_MS)
            progress.update(CHUNK)
            for off in range(CHUNK, view.nbytes, CHUNK):
                part = view[off : off + CHUNK]
                await client.append(tmp, part)
                progress.update(part.nbytes)
        await flush()
        what = progress.what
        progress.set_status(f"{what} (committing)")
        # the script deletes every tmp key of its "put" ops when it refuses the commit
        lv = await _lease.call_commit(client, runner, key_list, args)  # waits out readers' leases
        progress.set_status(what)
        return lv
    except BaseException:
        if sent:
            try:
                await client.delete(*sent)
            except Exception:  # noqa: BLE001 - the TTL removes them; report the first error
                pass
        raise


def _raise_first(replies: list[Any]) -> None:
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply


async def read_staged(
    client: AsyncClient,
    keys: StoreKeys,
    expected_lv: int,
    paths: Sequence[tuple[str, ...]],
    sizes: Sequence[int | None],
    progress: Progress,
) -> Any:
    """Reads the entries at ``paths`` in chunks; one consistent snapshot, or :data:`STALE`.

    ``sizes``: the byte size of each entry where the layout tells it (tensors), else None.

    Returns:
        ``(layout, blobs)``: the layout read with the entries (None when there is no store;
        when its version is not ``expected_lv``, ``blobs`` is empty), and the bytes of each
        path (None where the key is missing); or :data:`STALE` when a write came in
        between.
    """

    def build(pipe: AsyncPipeline) -> None:
        pipe.hgetall(keys.meta)
        pipe.hgetall(keys.reg)
        pipe.get(keys.wv)

    meta_raw, reg_raw, wv = await read_snapshot(client, keys, build)
    layout: Layout | None = parse_layout(meta_raw, reg_raw)
    if layout is None or layout.lv != expected_lv:
        return layout, []
    layout.wv = (wv.decode() if isinstance(wv, bytes) else wv) or "0"
    blobs: list[Any] = [None] * len(paths)
    # the strings of each entry, by the chunking of the layout just read
    chunks = _chunks.chunk_map(layout.entries)
    strings = [keys.entry_keys(p, chunks.get(p)) for p in paths]
    batch: list[int] = []
    batch_bytes = 0
    lv_raw = str(layout.lv).encode()

    def unchanged(wv_now: Any, lv_now: Any) -> bool:
        # every write bumps the write or the layout version: both as read first, no write yet
        if lv_now is None:
            return False
        return wv_now == wv and (lv_now if isinstance(lv_now, bytes) else str(lv_now).encode()) == lv_raw

    async def flush() -> bool:
        """Reads the batched entries, then the versions (same connection, in order)."""
        nonlocal batch, batch_bytes
        ok = True
        if batch:
            async with client.pipeline(transaction=False) as pipe:
                for i in batch:
                    for key in strings[i]:
                        pipe.get(key)
                pipe.get(keys.wv)
                pipe.hget(keys.meta, "lv")
                replies = await pipe.execute(raise_on_error=False)
            _raise_first(replies)
            pos = 0
            for i in batch:
                got = replies[pos : pos + len(strings[i])]
                pos += len(strings[i])
                blobs[i] = got[0] if len(got) == 1 else (None if None in got else b"".join(got))
            progress.update(batch_bytes)
            ok = unchanged(*replies[-2:])
        batch, batch_bytes = [], 0
        return ok

    for i, (path, size) in enumerate(zip(paths, sizes, strict=True)):
        if size is None or size <= CHUNK:
            batch.append(i)
            batch_bytes += size or 0
            if batch_bytes >= CHUNK and not await flush():
                return STALE  # stop at the first chunk read after a write: read again
            continue
        if not await flush():
            return STALE
        buf = bytearray(size)
        complete = True
        chunking = chunks.get(path)
        segments = (
            [(keys.plain(path), 0, size)] if chunking is None
            else [(keys.chunk(path, k), k * chunking.size, chunking.length(k)) for k in range(chunking.count)]
        )
        for key, base, length in segments:
            for off in range(0, length, CHUNK):
                async with client.pipeline(transaction=False) as pipe:
                    pipe.getrange(key, off, min(off + CHUNK, length) - 1)
                    pipe.get(keys.wv)
                    pipe.hget(keys.meta, "lv")
                    part, wv_now, lv_now = await pipe.execute(raise_on_error=False)
                _raise_first([part, wv_now, lv_now])
                if not unchanged(wv_now, lv_now):
                    return STALE
                if len(part) != min(CHUNK, length - off):
                    complete = False  # missing, though no write came: the entry was evicted
                    break
                buf[base + off : base + off + len(part)] = part
                progress.update(len(part))
            if not complete:
                break
        blobs[i] = buf if complete else None
    if not await flush():
        return STALE

    def check(pipe: AsyncPipeline) -> None:
        pipe.get(keys.wv)
        pipe.hget(keys.meta, "lv")

    if not unchanged(*await read_snapshot(client, keys, check)):
        return STALE
    return layout, blobs
