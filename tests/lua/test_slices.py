"""The trajectory-slice scripts (lua/slice_draw.lua, lua/slice_check.lua) on the in-memory
shim, under Lua 5.1 and 5.4: windows drawn from chosen uniforms, rejected when they cross an
end, the write position, an unwritten row or another trajectory id; the exact scan; the
prioritized descent; the check; bad arguments and damage refused with the key space unchanged.
"""

from __future__ import annotations

import random

import pytest

from .conftest import with_neighbour
from .test_expire import ClockRedis
from .test_priorities import BUILD_KEYS, UPDATE_KEYS, build
from .test_scripts import META, RING, D, expect_error, make_store

pytestmark = pytest.mark.lua

FLAGS = b"td:{s}:rf"
PL, PT, PG, PM = b"td:{s}:pl", b"td:{s}:pt", b"td:{s}:pg", b"td:{s}:pm"
COL = D("done")
KEYS = [META, RING, FLAGS, COL, PL, PT, PG, PM]
CHECK_KEYS = [FLAGS, RING, PG]


@pytest.fixture
def r() -> ClockRedis:
    return with_neighbour(ClockRedis())


def ring(r: ClockRedis, done: list[int], cursor: int, flags: bytes | None = None, itemsize: int = 1) -> None:
    """A ring of len(done) rows at ``cursor``, its episode column ``done`` (little-endian items)."""
    make_store(r, cursor=cursor)
    r.data[COL] = b"".join((int(v) % (1 << 8 * itemsize)).to_bytes(itemsize, "little") for v in done)
    if flags is not None:
        r.data[FLAGS] = flags


def draw(r: ClockRedis, lua_version: str, mode: str, length: int, us: list[float], n: int | None = None,
         kind: str = "end", itemsize: int = 1, cap: int = 10) -> list:
    n = len(us) if n is None else n
    args = [r.data[META][b"lv"].decode(), kind, str(itemsize), str(cap), str(length), mode, str(n), *map(repr, us)]
    return r.run("slice_draw", KEYS, args, lua_version)


def test_uniform_draws_follow_the_uniforms_and_reject_ends(r: ClockRedis, lua_version: str) -> None:
    # 10 rows, cursor 10: episodes at rows 0-2 (end at 2), 3-6 (end at 6), 7-9 (no end yet)
    ring(r, [0, 0, 1, 0, 0, 0, 1, 0, 0, 0], 10, b"\x01" * 10)
    # L = 3: starts 0..7 (8 windows); valid: 0, 3, 4, 7 (1: rows 1-3 cross the end at 2)
    got = draw(r, lua_version, "u", 3, [0.0, 3.5 / 8, 4.5 / 8, 7.5 / 8])
    assert got == [1, [0, 3, 4, 7], b"10", 0, b"", b"", b"", b""]
    got = draw(r, lua_version, "u", 3, [1.5 / 8, 2.5 / 8, 5.5 / 8, 3.5 / 8], n=1)
    assert got[1] == [3]  # (1, 2 and 5 rejected: the next uniform each time)
    got = draw(r, lua_version, "u", 3, [1.5 / 8], n=1)
    assert got[1] == []  # (the uniforms ran out)
    r.data[FLAGS] = b"\x01" * 8 + b"\x00\x01"  # row 8 in flight
    assert draw(r, lua_version, "u", 3, [7.5 / 8, 0.0], n=1)[1] == [0]
    r.data[META][b"lim"] = b"1"
    assert draw(r, lua_version, "u", 3, [0.0])[3] == 1


def test_windows_wrap_and_stop_at_the_write_position(r: ClockRedis, lua_version: str) -> None:
    # cursor 14 on 10 rows: positions 4..13; row 4 (position 4) is the oldest, row 3 (13) the newest
    ring(r, [0, 0, 0, 1, 0, 0, 0, 0, 0, 0], 14, b"\x01" * 10)
    # L = 4: starts 4..10 (7 windows); window at 8 is rows 8, 9, 0, 1 (wraps); none may pass position 13
    got = draw(r, lua_version, "u", 4, [(i + 0.5) / 7 for i in range(7)])
    assert got[1] == [4, 5, 6, 7, 8, 9, 10] and got[2] == b"14"
    # the end at row 3 (position 13) may only be a window's last row: window 10 = rows 0..3
    r.data[COL] = bytes([0, 1, 0, 0, 0, 0, 0, 0, 0, 0])  # end at row 1 = position 11
    got = draw(r, lua_version, "u", 4, [(i + 0.5) / 7 for i in range(7)])
    assert got[1] == [4, 5, 6, 7, 8]  # (9 = rows 9, 0, 1, 2 and 10 cross the end at position 11)
    # a ring not full: positions 0..cursor-1 only
    ring(r, [0] * 10, 3, b"\x01\x01\x01")
    assert draw(r, lua_version, "u", 3, [0.9])[1] == [0]
    assert draw(r, lua_version, "u", 4, [0.5])[:3] == [-1, [], b"3"]  # (fewer rows than L)


def test_a_draw_reads_only_the_bytes_of_the_windows_it_tests(r: ClockRedis, lua_version: str) -> None:
    """On a ring larger than the windows the uniforms would test, each window costs a GETRANGE
    of its L items of the column and one of its L flags, and no command writes."""
    cap = 1000
    ring(r, [0] * cap, 1500, b"\x01" * cap, itemsize=4)
    got = draw(r, lua_version, "u", 5, [0.25, 0.5], kind="traj", itemsize=4, cap=cap)
    assert got[1] == [500 + 249, 500 + 498]  # (996 window starts: 500 .. 1495)
    col = [c for c in r.commands("GETRANGE") if c[0] == COL]
    fl = [c for c in r.commands("GETRANGE") if c[0] == FLAGS]
    assert [(int(c[1]), int(c[2])) for c in col] == [(749 % cap * 4, 749 % cap * 4 + 19), (998 * 4, 998 * 4 + 7), (0, 11)]
    assert [int(c[2]) - int(c[1]) + 1 for c in fl] == [5, 2, 3]  # (window 998: rows 998, 999 then 0, 1, 2)
    assert not {c[0] for c in r.log} & {b"SET", b"SETRANGE", b"DEL", b"HSET", b"INCR", b"INCRBY"}


def test_traj_mode_and_wide_items(r: ClockRedis, lua_version: str) -> None:
    ring(r, [5, 5, 5, 7, 7, 7, 7, 5, 5, 5], 10, b"\x01" * 10, itemsize=8)
    got = draw(r, lua_version, "u", 3, [(i + 0.5) / 8 for i in range(8)], kind="traj", itemsize=8)
    assert got[1] == [0, 3, 4, 7]
    ring(r, [0, 0, 300, 0, 0, 0, -1, 0, 0, 0], 10, b"\x01" * 10, itemsize=2)  # int16 ends (non-zero)
    got = draw(r, lua_version, "u", 3, [(i + 0.5) / 8 for i in range(8)], itemsize=2)
    assert got[1] == [0, 3, 4, 7]


def test_scan_draws_exactly_among_the_valid_windows(r: ClockRedis, lua_version: str) -> None:
    ring(r, [0, 0, 1, 0, 0, 0, 1, 0, 0, 0], 10, b"\x01" * 10)
    got = draw(r, lua_version, "us", 3, [0.0, 0.3, 0.6, 0.99])
    assert got[1] == [0, 3, 4, 7]  # (the valid windows 0, 3, 4, 7, one quarter each)
    r.data[COL] = b"\x01" * 10
    assert draw(r, lua_version, "us", 2, [0.5])[0] == -1  # (every row an end: no window of 2)
    assert draw(r, lua_version, "us", 1, [0.5])[1] == [5]  # (a slice of 1 row may be an end)
    del r.data[FLAGS]  # (no flags: every row the cursor counts is written)
    r.data[COL] = b"\x00" * 10
    assert draw(r, lua_version, "us", 10, [0.5])[1] == [0]


@pytest.mark.parametrize("kind", ["end", "traj"])
def test_the_scan_finds_exactly_the_valid_windows_of_random_rings(r: ClockRedis, lua_version: str, kind: str) -> None:
    """The scan against the Python reference (tests/_slice_workers.py): uniforms at the middle
    of each of the V valid windows' shares give back every valid window, in order; and
    every start the rejection draws is one of them."""
    import _slice_workers as w

    rng = random.Random(7)
    for trial in range(40):
        cap = rng.randint(1, 40)
        cursor = rng.randint(0, 3 * cap)
        length = rng.randint(1, cap)
        itemsize = rng.choice([1, 2, 8])
        ends = [rng.random() < 0.25 for _ in range(cap)]
        ids, tid = [], 0
        for e in ends:
            ids.append(tid)
            tid += int(e)
        flags = [rng.random() < 0.9 for _ in range(cap)]
        column = [int(e) * rng.choice([1, 255, 256]) for e in ends] if kind == "end" else ids
        ring(r, column, cursor, bytes(int(f) for f in flags), itemsize=itemsize)
        want = w.valid_starts(ends, flags, ids if kind == "traj" else None, cursor, length)
        if kind == "end" and itemsize == 1:
            want = w.valid_starts([c % 256 != 0 for c in column], flags, None, cursor, length)  # (256: 0 in 1 byte)
        us = [(i + 0.5) / len(want) for i in range(len(want))] or [0.5]
        got = draw(r, lua_version, "us", length, us, kind=kind, itemsize=itemsize, cap=cap)
        if not want:
            assert got[0] == -1, (trial, got)
        else:
            assert got[1] == want, (trial, cap, cursor, length)
        # rejection: every start returned is a valid window
        got = draw(r, lua_version, "u", length, [rng.random() for _ in range(60)], n=30, kind=kind, itemsize=itemsize, cap=cap)
        assert set(got[1]) <= set(want) and (got[0] == 1 or not want)


def test_prioritized_draws_by_the_start_row(r: ClockRedis, lua_version: str) -> None:
    ring(r, [0, 0, 1, 0, 0, 0, 1, 0, 0, 0], 10, b"\x01" * 10)
    assert draw(r, lua_version, "p", 3, [0.5])[0] == 0  # (priorities off)
    build(r, lua_version)
    r.run("prio_update", UPDATE_KEYS, [" ".join(map(str, range(10))), "1 2 3 4 5 6 7 8 9 10", ""], lua_version)
    # masses of 55: row 3 holds 6..10, row 1 holds 1..3 (rejected: crosses the end), row 7 holds 28..36
    got = draw(r, lua_version, "p", 3, [7.0 / 55, 2.0 / 55, 30.0 / 55])
    assert got[0] == 1 and got[1] == [3, 7]
    assert [float(v) for v in got[4].split()] == [4.0, 8.0] and got[5] == b"0" * 32 and got[6] == b"1"
    got = draw(r, lua_version, "ps", 3, [0.0, 0.99])  # valid starts 0, 3, 4, 7: p 1, 4, 5, 8 (cum 1, 5, 10, 18)
    assert got[1] == [0, 7]
    assert draw(r, lua_version, "ps", 3, [0.5 / 18 * 18 * 0.3])[1] == [3]  # (0.15 * 18 = 2.7: in 1..5)


def test_check_reads_cursor_flags_and_generations(r: ClockRedis, lua_version: str) -> None:
    ring(r, [0] * 10, 12, b"\x01" * 10)
    assert r.run("slice_check", CHECK_KEYS, ["10", "3", "2", "9"], lua_version) == [b"12", b"11", b""]
    r.data[FLAGS] = b"\x01\x00" + b"\x01" * 8
    assert r.run("slice_check", CHECK_KEYS, ["10", "3", "2", "9"], lua_version) == [b"12", b"10", b""]
    r.data[PG] = b"".join(b"%016d" % g for g in range(10))
    assert r.run("slice_check", CHECK_KEYS, ["10", "3", "12"], lua_version)[2] == b"%016d" % 2
    expect_error(r, "TDS_BADARG", "slice_check", CHECK_KEYS, ["10", "11", "0"], lua_version)
    expect_error(r, "TDS_BADARG", "slice_check", CHECK_KEYS, ["10", "3", "-1"], lua_version)


def test_draw_refuses_bad_arguments_a_stale_layout_and_damage(r: ClockRedis, lua_version: str) -> None:
    expect_error(r, "TDS_NOSTORE", "slice_draw", KEYS, ["2", "end", "1", "10", "3", "u", "1", "0.5"], lua_version)
    ring(r, [0] * 10, 10, b"\x01" * 10)
    expect_error(r, "TDS_STALE", "slice_draw", KEYS, ["3", "end", "1", "10", "3", "u", "1", "0.5"], lua_version)
    for args in (
        ["2", "ends", "1", "10", "3", "u", "1", "0.5"], ["2", "end", "9", "10", "3", "u", "1", "0.5"],
        ["2", "end", "1", "10", "11", "u", "1", "0.5"], ["2", "end", "1", "10", "3", "x", "1", "0.5"],
        ["2", "end", "1", "10", "3", "u", "2", "0.5"], ["2", "end", "1", "10", "3", "u", "1", "1.0"],
    ):
        expect_error(r, "TDS_BADARG", "slice_draw", KEYS, args, lua_version)
    r.data[COL] = b"\x00" * 9  # (a column of 9 rows in a ring of 10: damaged)
    expect_error(r, "TDS_CORRUPT", "slice_draw", KEYS, ["2", "end", "1", "10", "3", "u", "1", "0.5"], lua_version)
    del r.data[COL]
    expect_error(r, "TDS_CORRUPT", "slice_draw", KEYS, ["2", "end", "1", "10", "3", "u", "1", "0.5"], lua_version)
    r.data[COL] = b"\x00" * 10
    r.data[RING] = b"lots"
    expect_error(r, "TDS_CORRUPT", "slice_draw", KEYS, ["2", "end", "1", "10", "3", "u", "1", "0.5"], lua_version)
    r.data[RING] = b"10"
    r.run("prio_build", BUILD_KEYS, ["enable", '{"alpha": 1, "beta": 1, "eps": 0, "k": 4, "cap": 10}'], lua_version)
    r.data[PT] = b"x" * len(r.data[PT])
    expect_error(r, "TDS_CORRUPT", "slice_draw", KEYS, ["3", "end", "1", "10", "3", "p", "1", "0.5"], lua_version)


#: the behaviour tests of each script's error codes (tests/lua/test_scripts.py checks them all)
SLICE_ERROR_TESTS = {
    "slice_draw": {
        "TDS_NOSTORE": test_draw_refuses_bad_arguments_a_stale_layout_and_damage,
        "TDS_STALE": test_draw_refuses_bad_arguments_a_stale_layout_and_damage,
        "TDS_BADARG": test_draw_refuses_bad_arguments_a_stale_layout_and_damage,
        "TDS_CORRUPT": test_draw_refuses_bad_arguments_a_stale_layout_and_damage,
    },
    "slice_check": {"TDS_BADARG": test_check_reads_cursor_flags_and_generations},
}
