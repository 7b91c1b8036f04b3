"""Every server operation of tdstore, as async functions. No TensorDict logic lives here.

The functions take a ``redis.asyncio`` client, the store's :class:`~tdstore._core.keys.StoreKeys`
and, for scripts, a :class:`~tdstore._backend.scripts.ScriptRunner`. Reads that must be consistent
(entry metadata with its bytes, several entries with each other) run in one MULTI/EXEC, so
the server executes them without interleaving another client's write. Writes that change
the layout go through the ``commit`` script; the bytes they carry travel in the same
MULTI as short-lived tmp keys, which the script renames into place (no byte passes
through Lua, and a refused write leaves nothing behind).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

import redis.exceptions

from tdstore._backend import large as _large
from tdstore._backend import lease as _lease
from tdstore._backend import loop as _io
from tdstore._backend import memory as _memory
from tdstore._backend import step as _step
from tdstore._backend.protocols import AsyncClient, SyncClient
from tdstore._backend.scripts import ScriptRunner
from tdstore._backend.step import _exec
from tdstore._backend.translate import translate
from tdstore._core import chunks as _chunks
from tdstore._core.keys import StoreKeys, decode_path, encode_path
from tdstore._core.layout import (
    SCRIPT_META_FIELDS,
    Command,
    Entry,
    Layout,
    Op,
    ZeroBytes,
    _s,
    byte_view,
    parse_entry,
    parse_layout,
    parse_lv,
    registry_lost,
)
from tdstore.errors import PartialWriteError

__all__ = [
    "FORMAT_VERSION",
    "Layout",
    "Op",
    "fetch_layout",
    "layout_step",
    "layout_version_step",
    "read_layout_version",
    "read_entries",
    "commit",
    "read_all",
    "parse_layout",
    "parse_entry",
    "registry_lost",
    "SCRIPT_META_FIELDS",
    "ttl_ms",
]

#: Version of the on-server format; written into every new store's meta hash.
FORMAT_VERSION = "1"

#: Seconds a tmp key lives if its MULTI never reaches the commit script.
TMP_TTL_MS = 600_000


def layout_step(keys: StoreKeys) -> _step.ReadStep[Layout | None]:
    """The store's metadata and registry in one snapshot, as a read step for either driver
    (``Connection.read_step`` sends it from the calling thread); None if there is no store."""

    def parse(replies: list[object]) -> Layout | None:
        return parse_layout(_hash(replies[0]), _hash(replies[1]), keys.base)

    return _step.ReadStep("snapshot", parse, [("HGETALL", keys.meta), ("HGETALL", keys.reg)])


def layout_version_step(keys: StoreKeys) -> _step.ReadStep[int | None]:
    """The store's layout version (None: no store), as a read step for either driver."""

    def parse(replies: list[object]) -> int | None:
        if isinstance(replies[0], Exception):
            raise replies[0]
        return parse_lv(replies[0], keys.base)

    return _step.ReadStep("packet", parse, [("HGET", keys.meta, "lv")])


async def fetch_layout(client: AsyncClient, keys: StoreKeys) -> Layout | None:
    """:func:`layout_step` on an asyncio client."""
    return await _step.run_async(client, keys, None, layout_step(keys))


async def read_layout_version(client: AsyncClient, keys: StoreKeys) -> int | None:
    """:func:`layout_version_step` on an asyncio client."""
    return await _step.run_async(client, keys, None, layout_version_step(keys))


async def ttl_ms(client: AsyncClient, keys: StoreKeys) -> int:
    """The store's remaining lifetime in ms (``PTTL`` of its meta hash): -1 none, -2 no store."""
    return int(await client.pttl(keys.meta))


if TYPE_CHECKING:
    import torch
    from typing_extensions import TypedDict, Unpack

    from tdstore._core.chunks import Chunking

    class ReadOptions(TypedDict, total=False):
        """The keyword arguments of :func:`read_entries` and :func:`read_entries_direct`."""

        large: Mapping[tuple[str, ...], int] | None  # the byte size the caller expects of some entries
        device: torch.device | None  # the store's device (pinned buffers for CUDA)
        under: Layout | None  # read at this layout: its version, not the registry, comes with the bytes


def _big_entries(paths: Sequence[tuple[str, ...]], options: ReadOptions) -> tuple[dict[tuple[str, ...], int], torch.device | None]:
    """The entries among ``paths`` to read in pieces, with their expected sizes; and the device."""
    large = options.get("large") or {}
    return {p: n for p, n in large.items() if n >= _large.READ_MIN and p in paths}, options.get("device")


#: What :func:`read_entries` gives: the layout version (None: no store); each path's registry
#: metadata and bytes (None when absent; a flat uint8 tensor for an entry read in pieces); the
#: layout, when asked for.
EntriesRead: TypeAlias = "tuple[int | None, list[Entry | None], list[bytes | torch.Tensor | None], Layout | None]"


async def read_entries(
    client: AsyncClient, keys: StoreKeys, paths: Sequence[tuple[str, ...]], with_layout: bool = False, **options: Unpack[ReadOptions]
) -> EntriesRead:
    """Reads entries whole, with their metadata, in one snapshot.

    ``large``: the byte size the caller expects of some tensor entries (from its cached
    layout). Those of at least :data:`tdstore._backend.large.READ_MIN` bytes are read in pieces
    into preallocated tensors (pinned when ``device`` is CUDA), still as one snapshot
    (see :func:`tdstore._backend.large.read_pieces`); their "bytes" are then flat uint8 tensors.

    ``under``: a layout the caller holds (its cached one). The snapshot then reads the layout
    version and the bytes only, with the entries' keys named by that layout; every change of
    the registry bumps the version in the same step (see docs/guarantees.md, 2), so when the
    version read is ``under.lv`` the registry is ``under``'s and its entries are returned as
    the metadata. When it is not, nothing is decoded: the metadata and bytes come back as
    None, and the caller refreshes its layout and reads again.

    Returns:
        (layout version, raw registry metadata per path (None when absent), bytes per
        path (None when absent), the full layout when ``with_layout``).
    """
    big, device = _big_entries(paths, options)
    under = options.get("under")
    # the chunking each entry is read with: the cached layout's, then the one read with
    # the bytes if that differs (the entry was re-created meanwhile)
    chunking = _chunking_of(keys, paths, under)

    async def once(big: Mapping[tuple[str, ...], int]) -> EntriesRead | None:
        nonlocal chunking
        for attempt in range(1, _CHUNK_TRIES + 1):
            got = await _read_entries_once(client, _EntriesTry(keys, paths, with_layout, big, device, chunking, under))
            if not isinstance(got, dict):
                return got
            chunking = got
            # writers keep re-creating the entry with another chunking: wait for a gap,
            # as optimistic writes do
            await asyncio.sleep(_io.backoff_seconds(attempt))
        from tdstore.errors import StaleLayoutError

        raise StaleLayoutError(f"the entries of {keys.base} kept changing their chunking during a read")

    if big and _large.streams(client):
        for _ in range(_LARGE_TRIES):
            got = await once(big)
            if got is not None:
                return got
    got = await once({})
    assert got is not None
    return got


def read_entries_direct(
    client: SyncClient, keys: StoreKeys, paths: Sequence[tuple[str, ...]], with_layout: bool = True, **options: Unpack[ReadOptions]
) -> EntriesRead | None:
    """One try of :func:`read_entries` on a blocking ``redis.Redis`` (see ``Connection.read``):
    the same MULTI, without the hop to the IO loop, and large entries received straight into
    their tensors (:func:`tdstore._backend.large.read_pieces_direct`). None when that try
    does not settle it (an entry's chunking is not the cached one, or a large entry changed
    meanwhile): the caller reads again through :func:`read_entries`. Any error raises, and
    the caller does the same.
    """
    big, device = _big_entries(paths, options)

    under = options.get("under")
    attempt = _EntriesTry(keys, paths, with_layout, big, device, _chunking_of(keys, paths, under), under)
    got = _step.run_blocking(client, None, attempt.step())
    if isinstance(got, _Pieces):
        if not _large.read_pieces_direct(client, got.read):
            return None
        return got.result
    return None if isinstance(got, dict) else got


def _chunking_of(keys: StoreKeys, paths: Sequence[tuple[str, ...]], under: Layout | None) -> dict[tuple[str, ...], Chunking | None]:
    """The chunking each entry is read with: ``under``'s when given (its version is the one
    checked), else the handle's cached layout's (``keys.chunks``)."""
    if under is not None:
        return {p: _chunks.of_meta(under.entries.get(p)) for p in paths}
    return {p: keys.chunks.get(p) for p in paths}


#: Reads in pieces tried before falling back to one MULTI (writes kept coming in between).
_LARGE_TRIES = 3
#: Reads tried while the chunking of an entry keeps changing under them (as many as an
#: optimistic write re-plans, with the same randomized backoff).
_CHUNK_TRIES = _io.MAX_RETRIES


@dataclass
class _Pieces:
    """A read whose large entries are still to be read in pieces into ``result``'s buffers."""

    read: _large.PieceRead
    result: EntriesRead


#: What one try of :func:`read_entries` gives (see :meth:`_EntriesTry.parse`).
_EntriesResult: TypeAlias = "EntriesRead | dict[tuple[str, ...], Chunking | None] | _Pieces | None"


@dataclass
class _EntriesTry:
    """One try of :func:`read_entries`, with each entry's chunking given: its snapshot
    commands and the meaning of their replies, without I/O (the IO loop's and the direct
    client's reads send the same)."""

    keys: StoreKeys
    paths: Sequence[tuple[str, ...]]
    with_layout: bool
    big: Mapping[tuple[str, ...], int]
    device: torch.device | None
    chunking: dict[tuple[str, ...], Chunking | None]
    #: read at this layout (see read_entries): the registry is not read
    under: Layout | None = None
    entry_keys: list[list[str]] = field(init=False)

    def __post_init__(self) -> None:
        self.entry_keys = [self.keys.entry_keys(p, self.chunking[p]) for p in self.paths]

    def step(self) -> _step.ReadStep[_EntriesResult]:
        """The snapshot as a :class:`~tdstore._backend.step.ReadStep` for either driver."""
        return _step.ReadStep("snapshot", self.parse, self.commands())

    def commands(self) -> list[Command]:
        """The snapshot's commands: the metadata, one MGET of the strings read whole (one
        command costs the server a fifth to a third less than a GET per string), a STRLEN
        per string read in pieces."""
        keys, paths, with_layout, big, entry_keys = self.keys, self.paths, self.with_layout, self.big, self.entry_keys
        out: list[Command] = []
        if with_layout:
            out += [("HGETALL", keys.meta), ("HGETALL", keys.reg), ("GET", keys.wv)]
        else:
            out.append(("HGET", keys.meta, "lv"))
            if paths and self.under is None:
                out.append(("HMGET", keys.reg, *[encode_path(p) for p in paths]))
        whole = [name for path, names in zip(paths, entry_keys, strict=True) if path not in big for name in names]
        if whole:
            out.append(("MGET", *whole))
        for path, names in zip(paths, entry_keys, strict=True):
            if path in big:
                out += [("STRLEN", name) for name in names]  # read below, in pieces
        if big and not with_layout:
            out.append(("GET", keys.wv))
        return out

    def _data_replies(self, replies: list[Any]) -> list[Any]:
        """The replies of the data commands of :meth:`commands`, one per entry key in order (the MGET's
        values and the STRLENs of the strings read in pieces)."""
        whole = sum(len(names) for path, names in zip(self.paths, self.entry_keys, strict=True) if path not in self.big)
        values = iter(replies[0] if whole else ())
        lengths = iter(replies[1 if whole else 0 :])
        return [
            next(lengths) if path in self.big else next(values)
            for path, names in zip(self.paths, self.entry_keys, strict=True)
            for _ in names
        ]


    def parse(self, replies: list[Any]) -> _EntriesResult:
        """The result from the snapshot's replies: a :class:`_Pieces` when large entries are
        still to be read, the chunking read from the server when it differs, None when a large
        entry is not the one expected."""
        keys, paths, with_layout, big, device, chunking = self.keys, self.paths, self.with_layout, self.big, self.device, self.chunking
        under = self.under
        with_reg = not with_layout and bool(paths) and under is None
        if with_layout:
            layout = parse_layout(_hash(replies[0]), _hash(replies[1]), keys.base)
        elif with_reg and isinstance(replies[1], Exception):
            layout = parse_layout({}, replies[1], keys.base)  # raises: the registry is not a hash
        _raise_first_error(replies)
        if with_layout:
            if layout is not None:
                layout.wv = _s(replies[2]) or "0"
            lv = None if layout is None else layout.lv
            metas = [None if layout is None else layout.entries.get(p) for p in paths]
            parts, wv, lv_raw = self._data_replies(replies[3:]), replies[2], (None if layout is None else layout.meta.get("lv"))
        else:
            lv = parse_lv(replies[0], keys.base)
            layout = None
            if under is not None:
                if lv is None or lv != under.lv:
                    return lv, [None] * len(paths), [None] * len(paths), None  # not read at ``under``
                metas = [under.entries.get(p) for p in paths]
            else:
                metas = [parse_entry(p, m, keys.base) if m is not None else None for p, m in zip(paths, replies[1], strict=True)] if paths else []
            first = 2 if with_reg else 1
            parts = self._data_replies(replies[first:-1] if big else replies[first:])
            wv, lv_raw = (replies[-1] if big else None), replies[0]
        if lv is not None:
            found = {p: _chunks.of_meta(m) for p, m in zip(paths, metas, strict=True) if m is not None}
            if any(found[p] != chunking[p] for p in found):
                return {p: found.get(p) for p in paths}
        blobs: list[Any] = []
        pos = 0
        for path, names in zip(paths, self.entry_keys, strict=True):
            got = parts[pos : pos + len(names)]
            pos += len(names)
            if path in big:
                blobs.append(sum(got) if all(isinstance(g, int) for g in got) else None)
            elif len(got) == 1:
                blobs.append(got[0])
            else:
                blobs.append(None if any(g is None for g in got) else b"".join(got))
        if big and lv is not None:
            pieces: list[tuple[tuple[str, ...], torch.Tensor, Chunking | None]] = []
            for i, (path, meta) in enumerate(zip(paths, metas, strict=True)):
                if path not in big:
                    continue
                size = big[path]
                if meta is None or not meta.is_tensor or blobs[i] != size or meta.nbytes != size:
                    return None  # not the entry the caller expected (or it is gone): read it whole
                blobs[i] = _large.empty_buffer(size, device)
                pieces.append((path, blobs[i], chunking[path]))
            return _Pieces(_large.PieceRead(keys, pieces, wv, lv_raw), (lv, metas, list(blobs), layout))
        return lv, metas, list(blobs), layout


def _hash(reply: Any) -> Any:
    """An HGETALL reply as a dict: RESP2 sends a flat list of fields and values where no
    parsing callback made it one (the direct client's :func:`~tdstore._backend.blocking.transaction`)."""
    if isinstance(reply, list):
        return dict(zip(reply[::2], reply[1::2], strict=True))
    return reply


async def _read_entries_once(
    client: AsyncClient, attempt: _EntriesTry
) -> EntriesRead | dict[tuple[str, ...], Chunking | None] | None:
    """One try of :func:`read_entries`: None when a large entry changed meanwhile; the
    chunking read from the server when it differs."""
    got = await _step.run_async(client, attempt.keys, None, attempt.step())
    if isinstance(got, _Pieces):
        if not await _large.read_pieces(client, got.read):
            return None
        return got.result
    return got




#: The most bytes a one-step read (:func:`read_all`) returns: every byte goes through the
#: server's Lua and into one reply, so a larger store keeps to optimistic reads.
READ_ALL_MAX_BYTES = 64 * 2**20


async def read_all(
    client: AsyncClient, keys: StoreKeys, runner: ScriptRunner, max_bytes: int | None = None
) -> tuple[Layout | None, dict[tuple[str, ...], bytes | None] | None]:
    """The layout and the bytes of every entry kept as one string, in one step (the
    ``read_all`` script): what a whole-store read falls back to when writers keep changing
    the layout between its optimistic layout and data reads. Chunked entries (and nested
    tensordicts) have no bytes in the result.

    Returns:
        (the layout with its write version, or None when there is no store; registry path ->
        bytes or None, or None altogether when the store's strings hold more than ``max_bytes``,
        default :data:`READ_ALL_MAX_BYTES`)
    """
    limit = READ_ALL_MAX_BYTES if max_bytes is None else max_bytes
    meta_flat, reg_flat, wv, data = await runner.call(
        client, "read_all", [keys.meta, keys.reg, keys.wv], [f"{keys.base}:d:", str(int(limit))]
    )
    meta_raw = dict(zip(meta_flat[::2], meta_flat[1::2], strict=True))
    reg_raw = dict(zip(reg_flat[::2], reg_flat[1::2], strict=True))
    layout = parse_layout(meta_raw, reg_raw, keys.base)
    if layout is None:
        return None, {}
    layout.wv = _s(wv) or "0"
    if not data:
        return layout, None  # too large for one step
    blobs = {}
    for field_name, blob in zip(reg_flat[::2], data, strict=True):
        blobs[decode_path(field_name)] = blob
    return layout, blobs


def _raise_first_error(replies: list[Any]) -> None:
    for reply in replies:
        if isinstance(reply, redis.exceptions.ResponseError):
            exc = translate(reply)
            raise exc from (reply if exc is not reply else None)
        if isinstance(reply, Exception):
            raise reply


def _nbytes(payload: object) -> int:
    return payload.nbytes if isinstance(payload, memoryview) else len(payload) if isinstance(payload, bytes) else 0


if TYPE_CHECKING:
    from typing_extensions import NotRequired, TypedDict, Unpack

    class CommitOptions(TypedDict):
        """The keyword arguments of :func:`commit_args` and :func:`commit` (see lua/commit.lua)."""

        expected: str  # the layout version planned with; "" any; "new" a store that does not exist yet
        bump: bool  # whether the layout version moves on (a key change)
        check_lock: bool  # refuse when the store is locked
        meta_updates: NotRequired[dict[str, str] | None]  # fields of the meta hash to set
        expected_wv: NotRequired[str]  # the write version planned with ("" any)
        ttl_ms: NotRequired[int | None]  # the lifetime of a new store
        expected_cas: NotRequired[str]  # a compare-and-set of appends to other sub-stores


def commit_args(
    keys: StoreKeys, ops: Sequence[Op], **options: Unpack[CommitOptions]
) -> tuple[list[str], list[str], list[tuple[str, Any]]]:
    """KEYS and ARGV of the commit script for ``ops``, and the ``(tmp key, bytes)`` of its "put" ops."""
    expected = options["expected"]
    meta_updates = options.get("meta_updates")
    ttl_ms = options.get("ttl_ms")
    expected_cas = options.get("expected_cas", "")
    key_list: list[str] = [keys.meta, keys.reg, keys.wv]
    tmp_payloads: list[tuple[str, Any]] = []
    wire_ops: list[dict[str, str]] = []

    def index_of(key: str) -> str:
        key_list.append(key)
        return str(len(key_list))

    def index_run(run: Sequence[str]) -> str:
        """Appends keys side by side; the KEYS index of the first."""
        first = len(key_list) + 1
        key_list.extend(run)
        return str(first)

    for op in ops:
        field_name = encode_path(op.path)
        meta_json = op.meta.to_json() if op.meta is not None else None

        def wire_op(kind: str, **fields: str) -> None:
            wire: dict[str, str] = {"op": kind, "f": field_name}  # noqa: B023 - used at once
            if meta_json is not None and kind != "del":  # noqa: B023
                wire["m"] = meta_json  # noqa: B023
            wire.update(fields)
            wire_ops.append(wire)

        def run_op(kind: str, srcs: Sequence[str] | None, dsts: Sequence[str], **fields: str) -> None:
            """One op over a run of keys (the strings of a chunked entry), "r" of them."""
            if srcs is not None:
                fields["src"] = index_run(srcs)
            fields["dst"] = index_run(dsts)
            if len(dsts) != 1:
                fields["r"] = str(len(dsts))
            wire_op(kind, **fields)

        old = keys.chunks.get(op.path)
        new = _chunks.of_meta(op.meta) if op.op in ("put", "zero") else None
        if op.op in ("put", "zero") and (old is not None or new is not None):
            # the entry's strings change: drop the ones the new value does not overwrite
            # (the layout version the commit checks is the one these were planned from)
            stale = _stale_keys(keys, op.path, old, new)
            if stale:
                run_op("del", None, stale)
        if op.op == "put" and new is not None:
            view = op.payload if isinstance(op.payload, ZeroBytes) else byte_view(op.payload)
            tmps = [keys.tmp() for _ in range(new.count)]
            for k, tmp in enumerate(tmps):
                start, size = k * new.size, new.length(k)
                tmp_payloads.append((tmp, ZeroBytes(size) if isinstance(view, ZeroBytes) else view[start : start + size]))
            run_op("put", tmps, keys.entry_keys(op.path, new))
        elif op.op == "put":
            tmp = keys.tmp()
            tmp_payloads.append((tmp, op.payload))
            run_op("put", [tmp], [keys.plain(op.path)])
        elif op.op == "zero" and new is not None:
            # grown chunk by chunk in tmp keys before the commit (see commit()): no server
            # step zero-fills more than one chunk
            tmps = [keys.tmp() for _ in range(new.count)]
            tmp_payloads.extend((tmp, ZeroBytes(new.length(k))) for k, tmp in enumerate(tmps))
            run_op("put", tmps, keys.entry_keys(op.path, new))
        elif op.op == "zero":
            wire_op("zero", dst=index_of(keys.plain(op.path)), n=str(op.nbytes))
        elif op.op == "del":
            if op.has_data:
                run_op("del", None, keys.entry_keys(op.path, keys.chunks.get(op.path)))
            else:
                wire_op("del")
        elif op.op == "move":
            assert op.new_path is not None
            target = encode_path(op.new_path)
            chunking = keys.chunks.get(op.path)
            target_old = keys.chunks.get(op.new_path)
            if chunking is not None or target_old is not None:
                # a replaced target: drop its strings the moved entry does not take the place of
                stale = _stale_keys(keys, op.new_path, target_old, chunking)
                if stale:
                    run_op("del", None, stale)
            run_op("move", keys.entry_keys(op.path, chunking), keys.entry_keys(op.new_path, chunking), t=target)
        else:
            wire_op(op.op)
    if expected == "new":
        # when the store was made (ms since the epoch, the creating client's clock): shown
        # as its age by `tdstore ls` / `tdstore info`; a store re-created after
        # clear_redis() is a new one
        meta_updates = {**(meta_updates or {}), "created": str(int(time.time() * 1000))}
    args = [
        expected,
        "1" if options["bump"] else "0",
        "1" if options["check_lock"] else "0",
        json.dumps(meta_updates, separators=(",", ":")) if meta_updates else "",
        json.dumps(wire_ops, separators=(",", ":")),
        FORMAT_VERSION,
        options.get("expected_wv", ""),
        # a new store starts at a random layout version (see lua/commit.lua, ARGV[8])
        str(secrets.randbits(40) * 1024) if expected == "new" else "0",
    ]
    if ttl_ms is not None and expected == "new":
        args.append(str(int(ttl_ms)))  # ARGV[9], sent only when set: older callers send 8
    if options["bump"] and expected != "new":
        key_list.append(keys.rl)  # last: readers' leases refuse the change meanwhile (TDS_BUSY)
    if expected_cas:
        # ARGV[10]: a compare-and-set that appends to other sub-stores leave alone (lua/commit.lua)
        args.extend([""] * (9 - len(args)) + [expected_cas])
    return key_list, args, tmp_payloads


async def commit(
    client: AsyncClient, keys: StoreKeys, runner: ScriptRunner, ops: Sequence[Op], **options: Unpack[CommitOptions]
) -> int:
    """Applies ``ops`` in one atomic step; returns the new layout version.

    The bytes of "put" ops are SET into tmp keys (with a TTL, in case the MULTI is cut
    short) inside the same MULTI as the script that renames them into place.
    ``ttl_ms``: the lifetime of a new store (``expected="new"``); every key it creates
    expires then (see lua/expire.lua).
    """
    key_list, args, tmp_payloads = commit_args(keys, ops, **options)
    await _memory.check_ops(client, keys, ops)  # refuses what would take the server past maxmemory
    if not tmp_payloads:
        return await _lease.call_commit(client, runner, key_list, args)  # waits out readers' leases
    if any(isinstance(p, ZeroBytes) for _, p in tmp_payloads):
        # grown on the server step by step before the commit: tdstore._backend.transfer.commit does it
        raise AssertionError("zero-filled chunks must be committed through tdstore._backend.transfer.commit")

    async def send() -> list[Any]:
        async with client.pipeline(transaction=True) as pipe:
            for tmp, payload in tmp_payloads:
                pipe.set(tmp, payload, px=TMP_TTL_MS)
            runner.queue(pipe, "commit", key_list, args)
            async with _large.streamed(pipe, sum(_nbytes(p) for _, p in tmp_payloads)):
                return await _exec(pipe)

    async def undo(replies: list[Any]) -> None:
        # the SETs ran: remove the tmp keys now rather than wait for their TTL
        await client.delete(*[tmp for tmp, _ in tmp_payloads])

    replies = await runner.run_pipeline(client, send, undo)
    result = replies[-1]
    for reply in replies[:-1]:
        if isinstance(reply, Exception) and not isinstance(result, Exception):
            raise PartialWriteError(f"a SET of the commit failed: {reply}")
    if isinstance(result, Exception):
        if isinstance(result, redis.exceptions.ResponseError):
            exc = translate(result)
            if _lease.busy_ms(exc) is not None:  # readers' leases: the tmp keys are kept, wait
                return await _lease.call_commit(client, runner, key_list, args, [t for t, _ in tmp_payloads], exc)
            if exc is not result:
                # say why a tmp key went missing, e.g. the server is out of memory
                set_errors = [r for r in replies[:-1] if isinstance(r, Exception)]
                if set_errors and isinstance(exc, PartialWriteError):
                    exc = PartialWriteError(f"{exc}: {set_errors[0]}")
                raise exc from result
        raise result
    return int(result)


def _stale_keys(keys: StoreKeys, path: tuple[str, ...], old: Chunking | None, new: Chunking | None) -> list[str]:
    """The strings of the entry at ``path`` chunked as ``old`` that chunked as ``new`` it does not have."""
    return sorted(set(keys.entry_keys(path, old)) - set(keys.entry_keys(path, new)))
