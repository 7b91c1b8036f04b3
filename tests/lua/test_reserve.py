"""reserve.lua, the first step of an append (tdstore/_backend/append.py), on the in-memory shim.

It reserves rows through the cursor and clears their "written" flags; where the ring came
round, a row whose flag is still clear is an append in flight (or dead) there: it takes it
over, bumping the fence. It re-checks a reservation made before ("keep") by its start and
the layout version it was made under; on every error the key space is unchanged.
"""

from __future__ import annotations

from typing import Any

import pytest

from .shim import LuaRedis
from .test_scripts import META, RING, WV, D, expect_error, make_store

pytestmark = pytest.mark.lua

FLAGS, FENCE, RATE = b"td:{s}:rf", b"td:{s}:fence", b"td:{s}:rate"
KEYS = [META, RING, FLAGS, FENCE, WV, RATE]
CAP = 4


def argv(n: Any, mode: str = "new", lv: str = "2", cap: Any = CAP, start: Any = "0", lv0: Any = "0",
         groups: Any = ((2, 0),)) -> list[Any]:
    out: list[Any] = [lv, str(n), str(cap), mode, str(start), str(lv0)]
    for row_bytes, chunk in groups:
        out += [str(row_bytes), str(chunk)]
    return out


def store(r: LuaRedis, **kw: Any) -> None:
    make_store(r, entries={"x": b"abcdefgh"}, **kw)


def reserve(r: LuaRedis, lua_version: str, n: int, keys: Any = None, **kw: Any) -> Any:
    return r.run("reserve", keys or [*KEYS, D("x")], argv(n, **kw), lua_version)


def test_reserves_rows_and_clears_their_flags(r: LuaRedis, lua_version: str) -> None:
    store(r)
    r.data[FLAGS] = b"\x01\x01\x01\x01"
    assert reserve(r, lua_version, 3) == [0, b"", b"2"]
    assert r.data[RING] == b"3"
    assert r.data[FLAGS] == b"\x00\x00\x00\x01"
    assert FENCE not in r.data  # rows never reserved before: nothing to take over
    assert r.data[D("x")] == b"abcdefgh"  # no byte of a row is written here
    # rows 3 and 0: row 0 was reserved by the first and is not written yet (flag clear): taken over
    assert reserve(r, lua_version, 2) == [3, b"", b"2"]
    assert r.data[RING] == b"5"
    assert r.data[FLAGS] == b"\x00\x00\x00\x00"
    assert r.data[FENCE] == b"1"


def test_wraps_around_and_takes_over_a_row_in_flight(r: LuaRedis, lua_version: str) -> None:
    store(r, cursor=7)
    r.data[FLAGS] = b"\x01\x00\x01\x01"  # row 1 still in flight (a slow or dead appender)
    assert reserve(r, lua_version, 3) == [7, b"", b"2"]  # rows 3, 0, 1
    assert r.data[FLAGS] == b"\x00\x00\x01\x00"
    assert r.data[FENCE] == b"1"
    assert r.data[RING] == b"10"


def test_no_takeover_when_the_rows_come_round_written(r: LuaRedis, lua_version: str) -> None:
    store(r, cursor=4)
    r.data[FLAGS] = b"\x01\x01\x00\x00"  # rows 2-3 of the previous lap still in flight: not these
    assert reserve(r, lua_version, 2) == [4, b"", b"2"]  # rows 0-1
    assert r.data[FLAGS] == b"\x00\x00\x00\x00"
    assert FENCE not in r.data


def test_rows_reserved_for_the_first_time_are_not_checked(r: LuaRedis, lua_version: str) -> None:
    store(r, cursor=3)
    r.data[FLAGS] = b"\x01\x00\x00"  # rows 1-2 in flight; row 3 never reserved
    assert reserve(r, lua_version, 2) == [3, b"", b"2"]  # rows 3 (new) and 0 (came round, written)
    assert FENCE not in r.data
    assert r.data[FLAGS] == b"\x00\x00\x00\x00"
    assert r.commands("GETRANGE") == [(FLAGS, b"0", b"0")], "only the row that came round is read"


def test_keep_finds_its_reservation_without_moving_the_cursor(r: LuaRedis, lua_version: str) -> None:
    store(r, cursor=5)
    r.data[FLAGS] = b"\x01\x01\x00\x00"
    before, _ = r.snapshot()
    # rows 2, 3, 0 from cursor 2, made under layout version 1: a layout change since, same store
    assert reserve(r, lua_version, 3, mode="keep", start=2, lv0=1) == [2, b"", b"2"]
    assert r.data == before
    for start, lv0 in [
        (0, 1),  # the cursor (5) is more than a ring past cursor 0: a later append came round to its rows
        (3, 1),  # the rows end past the cursor: not a reservation of this store
        (2, 3),  # made under a later layout version: another store
        (2, 2 - (1 << 20)),  # a layout version too far below: another store (created anew)
    ]:
        assert reserve(r, lua_version, 3, mode="keep", start=start, lv0=lv0) == [-1, b"", b"2"]
        assert r.data == before


def test_a_ring_without_flags_counts_its_first_rows_as_written(r: LuaRedis, lua_version: str) -> None:
    """A store appended to before the flags existed (or whose cursor the client set)."""
    store(r, cursor=2)
    assert reserve(r, lua_version, 1) == [2, b"", b"2"]
    assert r.data[FLAGS] == b"\x01\x01\x00"


def test_a_ring_without_flags_that_came_round(r: LuaRedis, lua_version: str) -> None:
    store(r, cursor=5)
    assert reserve(r, lua_version, 1) == [5, b"", b"2"]  # row 1
    assert r.data[FLAGS] == b"\x01\x00\x01\x01"
    assert FENCE not in r.data, "rows written before the flags existed are not appends in flight"


def test_chunked_entry_keys_are_checked(r: LuaRedis, lua_version: str) -> None:
    store(r)
    c0, c1 = b"td:{s}:c:0:y", b"td:{s}:c:1:y"
    r.data[c0], r.data[c1] = b"12345", b"678"  # 4 rows of 2 bytes in chunks of 5
    keys = [*KEYS, D("x"), c0, c1]
    assert r.run("reserve", keys, argv(1, groups=((2, 0), (2, 5))), lua_version) == [0, b"", b"2"]
    r.data[c1] = b"67"
    expect_error(r, "TDS_RANGE", "reserve", keys, argv(1, groups=((2, 0), (2, 5))), lua_version)
    del r.data[c1]
    expect_error(r, "TDS_NOENTRY", "reserve", keys, argv(1, groups=((2, 0), (2, 5))), lua_version)


@pytest.mark.parametrize(
    "code,change,args",
    [
        ("TDS_STALE", None, argv(1, lv="3")),
        ("TDS_NOSTORE", "no store", argv(1)),
        ("TDS_NOENTRY", "no data", argv(1)),
        ("TDS_RANGE", "short data", argv(1)),
        ("TDS_BADARG", None, argv(5)),  # more rows than the capacity
        ("TDS_BADARG", None, argv(0)),
        ("TDS_BADARG", None, argv("nan")),
        ("TDS_BADARG", None, argv(1, mode="other")),
        ("TDS_BADARG", None, argv(1, groups=())[:5]),  # no layout version for "keep"
        ("TDS_BADARG", None, argv(1, groups=((2, 0), (2, 0)))),  # a group without its key
        ("TDS_BADARG", None, argv(1)[:-1]),  # half a group
        ("TDS_BADARG", None, argv(1, groups=())),  # a key without its group
        ("TDS_CORRUPT", "bad cursor", argv(1)),
        ("TDS_CORRUPT", "text cursor", argv(1)),
        ("TDS_CORRUPT", "huge cursor", argv(1)),  # 2**62: doubles would give two appends the same rows
        ("TDS_CORRUPT", "huge cursor", argv(1, mode="keep")),
        # the MULTI after the reserve bumps the write version after the rows' SETRANGEs (issue 24)
        ("TDS_CORRUPT", "text write version", argv(1)),
        ("TDS_CORRUPT", "float write version", argv(1)),
        ("TDS_CORRUPT", "text write version", argv(1, mode="keep")),
    ],
)
def test_errors_change_nothing(r: LuaRedis, lua_version: str, code: str, change: str | None, args: list[Any]) -> None:
    store(r, cursor=1)
    r.data[FLAGS] = b"\x00"
    if change == "no store":
        del r.data[META]
    elif change == "no data":
        del r.data[D("x")]
    elif change == "short data":
        r.data[D("x")] = b"abc"
    elif change == "bad cursor":
        r.data[RING] = b"-1"
    elif change == "text cursor":
        r.data[RING] = b"1.5"
    elif change == "huge cursor":
        r.data[RING] = str(2**62).encode()
    elif change == "text write version":
        r.data[WV] = b"abc"
    elif change == "float write version":
        r.data[WV] = b"1.5"
    expect_error(r, code, "reserve", [*KEYS, D("x")], args, lua_version)


#: the behaviour test of each error code of reserve.lua (see test_scripts.py)
RESERVE_ERROR_TESTS = {
    "TDS_NOSTORE": test_errors_change_nothing,
    "TDS_STALE": test_errors_change_nothing,
    "TDS_NOENTRY": test_chunked_entry_keys_are_checked,
    "TDS_RANGE": test_chunked_entry_keys_are_checked,
    "TDS_BADARG": test_errors_change_nothing,
    "TDS_CORRUPT": test_errors_change_nothing,
}
