"""Indexed reads: byte runs of several entries in one snapshot (MULTI of GETRANGEs, the gather
script, BITFIELD_RO for rows of 1-16 bytes, or one GETRANGE then the layout version), on the
IO loop's asyncio client or on a blocking client.

A chunked entry's runs become one piece per chunk they cross (:mod:`tdstore._core.chunks`), and
a gather over its rows one gather call per chunk, the rows put back in the order asked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tdstore._backend import placed as _placed
from tdstore._backend.ops import _raise_first_error
from tdstore._backend.protocols import AsyncClient
from tdstore._backend.scripts import ScriptRunner
from tdstore._backend.step import ReadStep, run_async
from tdstore._core import chunks as _chunks
from tdstore._core.keys import StoreKeys
from tdstore._core.layout import Arg, Command, PackedCommand, parse_lv
from tdstore.errors import CorruptMetadataError

if TYPE_CHECKING:
    import torch

__all__ = [
    "runs_step", "read_runs", "choose_read", "choose_read_rows", "unwritten_bracket", "READ_ONE_MAX", "GATHER_MAX_RUN",
    "GATHER_MIN_RUNS", "BITFIELD_ROWS", "SPLIT_COOL",
]


def runs_step(
    keys: StoreKeys,
    runner: ScriptRunner,
    plans: Sequence[tuple[tuple[str, ...], Sequence[tuple[int, int | None]]]],
    gathers: Sequence[tuple[int, str] | None] | None = None,
    sizes: Sequence[int | None] | None = None,
    place: bool = False,
) -> ReadStep[tuple[int | None, list[list[bytes]]]]:
    """The read of byte runs ``(offset, length)`` of several entries in one snapshot, as a
    step for either driver (:mod:`tdstore._backend.step`; ``Connection.read_step``).

    ``sizes[i]``, when given and not None, is the byte size of plan ``i``'s entry in the
    caller's layout: the length of its string (of its last chunk, for a chunked entry) is
    read in the same snapshot, and :class:`SizeMismatch` raised when it differs.

    ``length`` None reads the whole string. ``gathers[i]``, when given, is ``(row bytes,
    "row row ...")``: plan ``i`` is then read by the gather script in one call, and its
    runs are not used. The layout version comes back with the runs: the caller
    decodes them only if it is the version it planned with.

    ``place``: a plan whose runs are large (:mod:`tdstore._backend.placed`) may be
    received straight into one flat uint8 tensor of all its runs, back to back; its list
    then holds that tensor alone.

    The step's result: (layout version, list of run bytes per entry).
    """
    gathers = list(gathers) if gathers is not None else [None] * len(plans)
    checks = _size_checks(keys, plans, sizes)
    one = _single_run(keys, plans, gathers)
    if one is not None and len(checks) <= 1 and all(c[0] == one[0] and c[1] == one[1] for c in checks):
        which, data_key, offset, last, small = one

        def parse_one(replies: list[Any]) -> tuple[int | None, list[list[bytes]]]:
            if small:
                lv, data, strlen = replies[0]
            else:
                _raise_first_error(replies)
                data, strlen, lv = replies
            lv = parse_lv(lv, keys.base)
            _check_sizes(lv, checks, [strlen] * len(checks))
            return lv, [[data] if i == which else [] for i in range(len(plans))]

        if small:
            # One run: one script call returns the version with the bytes (cheaper for the
            # client than a MULTI of two commands).
            return ReadStep("script", parse_one, script=("read_one", [keys.meta, data_key], [str(offset), str(last)]))
        # Lua would copy the bytes (READ_ONE_MAX: all non-empty runs); the version is read
        # after them instead, and it only grows, so if it is the planned one no layout
        # change came before
        commands: list[Command] = [("GETRANGE", data_key, offset, last), ("STRLEN", data_key), ("HGET", keys.meta, "lv")]
        return ReadStep("packet", parse_one, commands)
    recipe = _read_recipe(keys, plans, gathers, {c[0] for c in checks} if runner.bitfield else set())

    def parse(replies: list[Any]) -> tuple[int | None, list[list[bytes]]]:
        _raise_first_error(replies)
        return _split_checked(replies, recipe, checks, keys.base)

    commands = _run_commands(keys, runner, recipe) + [("STRLEN", key) for _, key, _ in checks]
    return ReadStep("snapshot", parse, commands, placed=_placer(recipe, checks, keys.base) if place else None)


def _placer(recipe: _Recipe, checks: Sequence[tuple[int, str, int]], base: str) -> _Placed | None:
    """The ``placed`` of a runs step (:class:`~tdstore._backend.step.ReadStep`), or None
    when no plan's runs are large enough to be worth it."""
    items: list[tuple[int, int, list[int]]] = []  # (recipe item, its first command's index, run lengths)
    at = 1  # (command 0 reads the layout version)
    for j, (kind, commands, _extra) in enumerate(recipe):
        if kind == "runs" and commands:
            lengths = [c[3] - c[2] + 1 if c[3] >= 0 else -1 for c in commands]
            total = sum(lengths)
            if min(lengths) > 0 and total >= _placed.PLACE_MIN and total >= _placed.PLACE_MIN_PIECE * len(lengths):
                items.append((j, at, lengths))
        at += len(commands)
    if not items or sum(sum(lengths) for _, _, lengths in items) > _placed.PLACE_MAX:
        return None

    def placed() -> tuple[dict[int, memoryview], Callable[[list[object]], _RunsResult]]:
        import torch

        targets: dict[int, memoryview] = {}
        buffers: _Buffers = {}
        for j, first, lengths in items:
            buf = torch.empty(sum(lengths), dtype=torch.uint8)
            view = buf.numpy().data.cast("B")
            pos = 0
            for m, n in enumerate(lengths):
                targets[first + m] = view[pos : pos + n]
                pos += n
            buffers[j] = (buf, view, lengths)

        def parse(replies: list[object]) -> _RunsResult:
            _raise_first_error(replies)
            return _split_checked(replies, recipe, checks, base, buffers)

        return targets, parse

    return placed


async def read_runs(
    client: AsyncClient,
    keys: StoreKeys,
    runner: ScriptRunner,
    plans: Sequence[tuple[tuple[str, ...], Sequence[tuple[int, int | None]]]],
    gathers: Sequence[tuple[int, str] | None] | None = None,
    sizes: Sequence[int | None] | None = None,
) -> tuple[int | None, list[list[bytes]]]:
    """:func:`runs_step` sent on the IO loop's client (for code that runs there already)."""
    return await run_async(client, keys, runner, runs_step(keys, runner, plans, gathers, sizes))


class SizeMismatch(Exception):
    """The string of an entry does not have the length its metadata (the caller's layout)
    says: damage when ``lv`` is the layout version the caller planned with, else a stale plan."""

    def __init__(self, lv: int | None, index: int, expected: int, got: int) -> None:
        super().__init__(f"plan {index}: expected {expected} bytes, the server holds {got}")
        self.lv, self.index, self.expected, self.got = lv, index, expected, got


def _size_checks(
    keys: StoreKeys, plans: Sequence[tuple[tuple[str, ...], Any]], sizes: Sequence[int | None] | None
) -> list[tuple[int, str, int]]:
    """``(plan index, key, expected length)`` of the strings whose length is checked."""
    out: list[tuple[int, str, int]] = []
    for i, size in enumerate(sizes or ()):
        if size is None:
            continue
        path = plans[i][0]
        chunking = keys.chunks.get(path)
        if chunking is None:
            out.append((i, keys.data(path), size))
        elif chunking.nbytes == size:  # else the cached chunking is not the caller's: no check
            last = chunking.count - 1
            out.append((i, keys.chunk(path, last), chunking.length(last)))
    return out


def _check_sizes(lv: int | None, checks: Sequence[tuple[int, str, int]], lengths: Sequence[Any]) -> None:
    for (i, _, expected), got in zip(checks, lengths, strict=True):
        if int(got) != expected:
            raise SizeMismatch(lv, i, expected, int(got))


def _split_checked(
    replies: list[Any], recipe: _Recipe, checks: Sequence[tuple[int, str, int]], base: str,
    buffers: _Buffers | None = None,
) -> tuple[int | None, list[list[bytes]]]:
    if checks:
        lengths = replies[-len(checks):]
        replies = replies[: -len(checks)]
    lv, out = _split_runs(replies, recipe, base, buffers)
    if checks:
        _check_sizes(lv, checks, lengths)
    return lv, out


def _single_run(
    keys: StoreKeys,
    plans: Sequence[tuple[tuple[str, ...], Sequence[tuple[int, int | None]]]], gathers: Sequence[tuple[int, str] | None]
) -> tuple[int, str, int, int, bool] | None:
    """``(plan index, data key, first byte, last byte, small)`` when the plans read one run, else None."""
    which = -1
    for i, (_, runs) in enumerate(plans):
        if gathers[i] is not None or len(runs) > 1 or (runs and which >= 0):
            return None
        if runs:
            which = i
    if which < 0:
        return None
    path, ((offset, length),) = plans[which]
    chunking = keys.chunks.get(path)
    if chunking is None:
        last = -1 if length is None else offset + length - 1
        return which, keys.data(path), offset, last, length is not None and length <= READ_ONE_MAX
    if length is None:
        return None
    parts = list(_chunks.pieces(chunking, offset, length))
    if len(parts) != 1:
        return None  # across chunks: several GETRANGEs in one MULTI
    k, local, n = parts[0]
    return which, keys.chunk(path, k), local, local + n - 1, n <= READ_ONE_MAX


# One plan's reads: ("runs", commands, pieces per run), ("gather", commands, None),
# ("bitfield", commands, (the width of its integers in bytes, their count)), or ("cgather", commands, (row
# bytes, where each row asked for lies in the replies joined)) for a gather over the chunks of
# a chunked entry. A command is ("getrange", key, first, last), ("gather", key, (row bytes,
# "row row ...")) or ("bitfield", key, (integer width, integers per row, "row row ...")).
_Recipe = list[tuple[str, list[tuple[Any, ...]], Any]]
# A placed read's buffers: recipe item -> (its flat uint8 tensor, that tensor's memory, run lengths)
_Buffers = dict[int, tuple["torch.Tensor", memoryview, list[int]]]
_RunsResult = tuple[int | None, list[list[bytes]]]
_Placed = Callable[[], tuple[dict[int, memoryview], Callable[[list[object]], _RunsResult]]]


def _read_recipe(
    keys: StoreKeys,
    plans: Sequence[tuple[tuple[str, ...], Sequence[tuple[int, int | None]]]],
    gathers: Sequence[tuple[int, str] | None],
    bitfield: set[int],
) -> _Recipe:
    """``bitfield``: the plans whose gather may go by BITFIELD_RO (the server has it, and
    their string's length is checked in the same snapshot: BITFIELD reads past a string's
    end as zeros, where a gather comes back short)."""
    out: _Recipe = []
    for i, ((path, runs), gather) in enumerate(zip(plans, gathers, strict=True)):
        chunking = keys.chunks.get(path)
        if gather is not None:
            if chunking is None:
                if i in bitfield and gather[0] in BITFIELD_ROWS:
                    width = min(gather[0], 8)
                    per_row = gather[0] // width
                    count = per_row * (gather[1].count(" ") + 1)
                    out.append(("bitfield", [("bitfield", keys.data(path), (width, per_row, gather[1]))], (width, count)))
                else:
                    out.append(("gather", [("gather", keys.data(path), gather)], None))
                continue
            row_bytes = gather[0]
            rows = [int(r) for r in gather[1].split()]
            if chunking.size % row_bytes == 0:
                # row-block chunks: one gather per chunk, the rows put back in order after
                per_chunk = chunking.size // row_bytes
                groups: dict[int, list[int]] = {}
                where: list[tuple[int, int]] = []
                for row in rows:
                    k = row // per_chunk
                    group = groups.setdefault(k, [])
                    where.append((k, len(group)))
                    group.append(row - k * per_chunk)
                base: dict[int, int] = {}
                count = 0
                for k, group in groups.items():
                    base[k] = count
                    count += len(group)
                perm = [base[k] + i for k, i in where]
                gathers_of_chunks: list[tuple[Any, ...]] = [
                    ("gather", keys.chunk(path, k), (row_bytes, " ".join(map(str, g)))) for k, g in groups.items()
                ]
                out.append(("cgather", gathers_of_chunks, (row_bytes, perm)))
                continue
            runs = [(row * row_bytes, row_bytes) for row in rows]
        commands: list[tuple[Any, ...]] = []
        counts: list[int] = []
        if chunking is None:
            key = keys.data(path)
            for offset, length in runs:
                # length None reads the whole string (non-tensor entries)
                commands.append(("getrange", key, offset, -1 if length is None else offset + length - 1))
                counts.append(1)
        else:
            names: dict[int, str] = {}  # (the chunks' keys, made once each)
            for offset, length in runs:
                n = 0
                for k, local, size in _chunks.pieces(chunking, offset, chunking.nbytes - offset if length is None else length):
                    name = names.get(k)
                    if name is None:
                        name = names[k] = keys.chunk(path, k)
                    commands.append(("getrange", name, local, local + size - 1))
                    n += 1
                counts.append(n)
        out.append(("runs", commands, counts))
    return out


def _run_commands(keys: StoreKeys, runner: ScriptRunner, recipe: _Recipe) -> list[Command]:
    """The snapshot's commands: the layout version, then the runs' GETRANGEs and gathers."""
    out: list[Command] = [("HGET", keys.meta, "lv")]
    for _, commands, _ in recipe:
        for command in commands:
            if command[0] == "bitfield":
                _, key, (width, per_row, rows) = command
                out.append(_bitfield_command(key, width, per_row, rows))
            elif command[0] == "gather":
                _, key, (row_bytes, rows) = command
                out.append(("EVALSHA", runner.sha("gather"), 1, key, str(row_bytes), rows))
            else:
                out.append(("GETRANGE", command[1], command[2], command[3]))
    return out


def _split_runs(
    replies: list[Any], recipe: _Recipe, base: str, buffers: _Buffers | None = None
) -> tuple[int | None, list[list[bytes]]]:
    """Each plan's runs from the replies; a placed plan's (``buffers``: recipe item ->
    (tensor, its memory, run lengths)) is its tensor, unless a reply of it was not placed
    (another length: the caller's size check then names the problem)."""
    lv = parse_lv(replies[0], base)
    out: list[list[bytes]] = []
    pos = 1
    for j, (kind, commands, extra) in enumerate(recipe):
        got = replies[pos : pos + len(commands)]
        pos += len(commands)
        placed = buffers.get(j) if buffers else None
        if placed is not None:
            buf, view, lengths = placed
            if all(r is _placed.PLACED for r in got):
                out.append([buf])  # type: ignore[list-item]  # (a flat uint8 tensor: tensor_from_reply takes it as it takes bytes)
                continue
            at = 0
            for m, n in enumerate(lengths):
                if got[m] is _placed.PLACED:
                    got[m] = bytes(view[at : at + n])
                at += n
        if kind == "gather":
            out.append(got)
        elif kind == "bitfield":
            out.append([_bitfield_bytes(got[0], extra[0], extra[1], base)])
        elif kind == "cgather":
            row_bytes, perm = extra
            joined = b"".join(got)
            if perm != list(range(len(perm))):
                joined = b"".join(joined[i * row_bytes : (i + 1) * row_bytes] for i in perm)
            out.append([joined])
        else:
            runs: list[bytes] = []
            at = 0
            for n in extra:
                runs.append(got[at] if n == 1 else b"".join(got[at : at + n]))
                at += n
            out.append(runs)
    return lv, out


#: Indexed reads that go in one MULTI after one read between two MULTIs
#: (:func:`unwritten_bracket`) found a write in between: where writes keep coming, a read
#: that has to go again costs more than the MULTI's queueing saves.
SPLIT_COOL = 16


def unwritten_bracket(
    keys: StoreKeys, on_broken: Callable[[], None]
) -> tuple[list[Command], tuple[list[Command], Callable[[list[object], list[object]], bool]]]:
    """``(prefix, bracket)`` for ``step.with_prefix``: an indexed read of many runs that may go
    between two MULTIs (``step.Split``), each reading the layout version and the write
    version; it holds where both are the same after as before (every write moves the write
    version, in its MULTI or script: no write came between), else the read goes again in
    one MULTI and ``on_broken()`` is called."""
    reads: list[Command] = [("HGET", keys.meta, "lv"), ("GET", keys.wv)]

    def holds(before: list[object], after: list[object]) -> bool:
        same = before == after and before[0] is not None and not any(isinstance(r, Exception) for r in before)
        if not same:
            on_broken()
        return same

    return reads, (reads, holds)


#: Rows of these sizes (bytes) that would go by the gather script go by BITFIELD_RO instead,
#: where the server has it: one GET of a signed integer of the row's size per row (two of 8
#: bytes for a row of 16), no Lua. BITFIELD reads its integers big-endian, so each one's
#: big-endian bytes are the row's bytes as stored. Measured (2026-12-07, Valkey 8.1 over TCP,
#: 256 random rows of 1, 4 or 8 B from 100,000): the script cost the server 0.27 ms a call,
#: BITFIELD_RO 0.12-0.13 ms (a MULTI of a GETRANGE each, 0.19-0.22 ms); a uniform sample of
#: 256 rows of obs uint8[84, 84, 3], action and reward went from 5.1-5.3 to 4.0-4.3 ms of server
#: CPU. Its RESP is made in one pass (:func:`_bitfield_command`): 0.08 ms for 256 rows, where
#: packing its 770 arguments one by one took 0.2 ms and the gather's call 0.03 ms.
BITFIELD_ROWS = (1, 2, 4, 8, 16)


def _bitfield_command(key: str, width: int, per_row: int, rows: str) -> PackedCommand:
    """``BITFIELD_RO key GET i<8 width> #<n> ...`` over ``rows`` ("row row ..."), ``per_row``
    integers a row (the n of row r: r * per_row .. r * per_row + per_row - 1), with its RESP
    encoding made here in one pass (a quarter of what packing its arguments one by one costs)."""
    kind = f"i{8 * width}"
    numbers = rows.split()
    if per_row != 1:
        numbers = [str(int(r) * per_row + j) for r in numbers for j in range(per_row)]
    args: list[Arg] = ["BITFIELD_RO", key]
    for n in numbers:
        args += ("GET", kind, "#" + n)
    kb = key.encode()
    get = b"$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(kind), kind.encode())
    resp = b"".join(
        [b"*%d\r\n$11\r\nBITFIELD_RO\r\n$%d\r\n%s\r\n" % (len(args), len(kb), kb)]
        + [b"%s$%d\r\n#%s\r\n" % (get, len(n) + 1, n.encode()) for n in numbers]
    )
    return PackedCommand(tuple(args), resp)


def _bitfield_bytes(reply: object, width: int, count: int, base: str) -> bytes:
    """The rows' bytes from a BITFIELD_RO reply: its ``count`` signed integers, big-endian."""
    if not isinstance(reply, list) or len(reply) != count or not all(type(v) is int for v in reply):
        raise CorruptMetadataError(f"a read of {base} got {reply!r:.100} from BITFIELD_RO, not a list of {count} integers")
    return np.array(reply, dtype=f">i{width}").tobytes()


#: A single run at most this long is read with the read_one script (one command); longer
#: ones with GETRANGE then HGET of the layout version, pipelined (not in a MULTI). 0: every
#: non-empty run goes the second way. Measured (benchmarks/bench_server_cpu.py, one row of
#: 21,168 B): the script cost the server 2-3.5x the CPU of a raw GETRANGE (23-41 vs 11-14
#: us: Lua copies every byte it returns) and 1.0-1.3x its wall time; GETRANGE + HGET costs
#: 1.00-1.07x the server CPU and 0.93-0.98x the wall time (one round trip all the same).
#: For a row of 64 B the pipeline costs the server 7.7-9.2 us instead of 11.6-12.6, and the
#: client 4-6 us more (53-56 us instead of 49-50): the server's time is what caps many clients.
READ_ONE_MAX = 0

#: Runs at most this long (bytes, on average) are read through the gather script. The
#: script saves the client a reply per row (85 random rows of 16-256 B: 350-460 us instead of
#: 470-580 us), but it costs the server more CPU per row than a GETRANGE each, and the gap
#: grows with the row, since Lua copies every byte it returns. Measured per row (85 random
#: rows, unpinned, gather / one GETRANGE each): Valkey 8 1.6 / 1.1 us at 16-256 B, 2.1 / 1.4
#: at 512, 3.6 / 1.9 at 1 KiB, 7.9 / 2.2 at 4 KiB; Redis 7 2.1-2.7 / 0.9-1.0 at 16-256 B,
#: 3.6 / 0.9 at 512, 6.3 / 1.4 at 1 KiB, 21 / 2.3 at 4 KiB, where the wall time was also
#: worse (2.1 ms against 0.7). Above 256 B the wall time gained is under 10% (or lost).
GATHER_MAX_RUN = 256
#: ... when there are at least this many of them.
GATHER_MIN_RUNS = 8


def choose_read(runs: Sequence[tuple[int, int | None]]) -> str:
    """How to read the runs of one entry: "gather" (one Lua call) or "getrange" (a command each).

    The gather script takes the row numbers as one argument, so the choice also saves
    redis-py from packing two arguments per run.

    Measured (benchmarks/bench_index.py): redis-py spends 15-20 us of Python per pipelined
    command, while Lua concatenates small runs cheaply but is slow per byte; over 256
    runs the script wins up to about 4 KiB per run and loses from 16 KiB on.
    """
    if len(runs) < GATHER_MIN_RUNS or any(length is None for _, length in runs):
        return "getrange"
    total = sum(length for _, length in runs if length is not None)
    return choose_read_rows(len(runs), total)


def choose_read_rows(nruns: int, total_bytes: int) -> str:
    """:func:`choose_read` from the number of runs and their total size."""
    if nruns < GATHER_MIN_RUNS:
        return "getrange"
    return "gather" if total_bytes <= GATHER_MAX_RUN * nruns else "getrange"
