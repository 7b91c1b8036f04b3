"""reserve.lua, the first step of an append (tdstore/_backend/append.py), on the in-memory shim.

It reserves rows through the cursor, records them in flight, clears their "written" flags,
takes over the reservations in flight its rows would overlap (bumping the fence), and
re-checks a reservation made before ("keep"); on every error the key space is unchanged.
"""

from __future__ import annotations

from typing import Any

import pytest

from .shim import LuaRedis
from .test_scripts import META, RING, D, expect_error, make_store

pytestmark = pytest.mark.lua

FLAGS, INFLIGHT, FENCE = b"td:{s}:rf", b"td:{s}:rif", b"td:{s}:fence"
KEYS = [META, RING, FLAGS, INFLIGHT, FENCE]
CAP = 4


def argv(n: Any, rid: str = "a", mode: str = "new", lv: str = "2", cap: Any = CAP, groups: Any = ((2, 0),)) -> list[Any]:
    out: list[Any] = [lv, str(n), str(cap), rid, mode]
    for row_bytes, chunk in groups:
        out += [str(row_bytes), str(chunk)]
    return out


def store(r: LuaRedis, **kw: Any) -> None:
    make_store(r, entries={"x": b"abcdefgh"}, **kw)


def reserve(r: LuaRedis, lua_version: str, n: int, rid: str = "a", mode: str = "new", keys: Any = None, **kw: Any) -> Any:
    return r.run("reserve", keys or [*KEYS, D("x")], argv(n, rid, mode, **kw), lua_version)


def test_reserves_rows_and_clears_their_flags(r: LuaRedis, lua_version: str) -> None:
    store(r)
    r.data[FLAGS] = b"\x01\x01\x01\x01"
    assert reserve(r, lua_version, 3) == [0, b""]
    assert r.data[RING] == b"3"
    assert r.data[FLAGS] == b"\x00\x00\x00\x01"
    assert r.data[INFLIGHT] == {b"a": b"0:3:4"}
    assert FENCE not in r.data  # nothing was taken over
    assert r.data[D("x")] == b"abcdefgh"  # no byte of a row is written here
    # rows 3 and 0: row 0 is still "a"'s, in flight: "a" is taken over
    assert reserve(r, lua_version, 2, rid="b") == [3, b""]
    assert r.data[RING] == b"5"
    assert r.data[INFLIGHT] == {b"b": b"3:2:4"}
    assert r.data[FENCE] == b"1"


def test_wraps_around_and_takes_over_an_overlapped_reservation(r: LuaRedis, lua_version: str) -> None:
    store(r, cursor=3)
    r.data[FLAGS] = b"\x01\x01\x01\x01"
    r.data[INFLIGHT] = {b"slow": b"1:1:4", b"other": b"2:1:4"}
    assert reserve(r, lua_version, 3, rid="new") == [3, b""]  # rows 3, 0, 1
    assert r.data[FLAGS] == b"\x00\x00\x01\x00"
    # "slow" held row 1, which the new rows overlap: dropped, the fence moved; row 2 is still "other"'s
    assert r.data[INFLIGHT] == {b"other": b"2:1:4", b"new": b"3:3:4"}
    assert r.data[FENCE] == b"1"
    assert r.data[RING] == b"6"


def test_no_takeover_without_overlap(r: LuaRedis, lua_version: str) -> None:
    store(r, cursor=4)
    r.data[INFLIGHT] = {b"old": b"2:2:4"}  # rows 2-3 of the previous lap, still in flight
    assert reserve(r, lua_version, 2, rid="new") == [4, b""]  # rows 0-1
    assert r.data[INFLIGHT] == {b"old": b"2:2:4", b"new": b"4:2:4"}
    assert FENCE not in r.data


def test_a_reservation_for_another_capacity_is_dropped(r: LuaRedis, lua_version: str) -> None:
    store(r, cursor=1)
    r.data[INFLIGHT] = {b"old": b"0:1:8"}
    reserve(r, lua_version, 1, rid="new")
    assert r.data[INFLIGHT] == {b"new": b"1:1:4"}
    assert r.data[FENCE] == b"1"


def test_keep_finds_its_reservation_without_moving_the_cursor(r: LuaRedis, lua_version: str) -> None:
    store(r, cursor=5)
    r.data[INFLIGHT] = {b"a": b"2:3:4"}
    r.data[FLAGS] = b"\x01\x01\x00\x00"
    before, _ = r.snapshot()
    assert reserve(r, lua_version, 3, mode="keep") == [2, b""]
    assert r.data == before
    # taken over meanwhile: -1, and nothing changes
    assert reserve(r, lua_version, 3, rid="gone", mode="keep") == [-1, b""]
    assert r.data == before
    # made for other rows (another n): -1, and the stale record is dropped
    assert reserve(r, lua_version, 2, mode="keep") == [-1, b""]
    assert INFLIGHT not in r.data  # (the hash emptied, so deleted)


def test_a_ring_without_flags_counts_its_first_rows_as_written(r: LuaRedis, lua_version: str) -> None:
    """A store appended to before the flags existed (or whose cursor the client set)."""
    store(r, cursor=2)
    assert reserve(r, lua_version, 1) == [2, b""]
    assert r.data[FLAGS] == b"\x01\x01\x00"


def test_chunked_entry_keys_are_checked(r: LuaRedis, lua_version: str) -> None:
    store(r)
    c0, c1 = b"td:{s}:c:0:y", b"td:{s}:c:1:y"
    r.data[c0], r.data[c1] = b"12345", b"678"  # 4 rows of 2 bytes in chunks of 5
    keys = [*KEYS, D("x"), c0, c1]
    assert r.run("reserve", keys, argv(1, groups=((2, 0), (2, 5))), lua_version) == [0, b""]
    r.data[c1] = b"67"
    expect_error(r, "TDS_RANGE", "reserve", keys, argv(1, rid="b", groups=((2, 0), (2, 5))), lua_version)
    del r.data[c1]
    expect_error(r, "TDS_NOENTRY", "reserve", keys, argv(1, rid="b", groups=((2, 0), (2, 5))), lua_version)


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
        ("TDS_BADARG", None, argv(1, rid="a:b")),
        ("TDS_BADARG", None, argv(1, groups=((2, 0), (2, 0)))),  # a group without its key
        ("TDS_BADARG", None, argv(1)[:-1]),  # half a group
        ("TDS_BADARG", None, argv(1, groups=())),  # a key without its group
        ("TDS_BADARG", "bad cursor", argv(1)),
        ("TDS_BADARG", "text cursor", argv(1)),
    ],
)
def test_errors_change_nothing(r: LuaRedis, lua_version: str, code: str, change: str | None, args: list[Any]) -> None:
    store(r, cursor=1)
    r.data[INFLIGHT] = {b"z": b"0:1:4"}
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
    expect_error(r, code, "reserve", [*KEYS, D("x")], args, lua_version)


#: the behaviour test of each error code of reserve.lua (see test_scripts.py)
RESERVE_ERROR_TESTS = {
    "TDS_NOSTORE": test_errors_change_nothing,
    "TDS_STALE": test_errors_change_nothing,
    "TDS_NOENTRY": test_chunked_entry_keys_are_checked,
    "TDS_RANGE": test_chunked_entry_keys_are_checked,
    "TDS_BADARG": test_errors_change_nothing,
}
