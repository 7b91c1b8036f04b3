"""ring_total.lua, the cursor set by the client (TorchRL's empty() and load_state_dict()), on
the in-memory shim.

It sets the cursor; the first min(total, capacity) rows are flagged as written, except rows
whose flag is clear (a reservation in flight there keeps its record), and the flags past
them are dropped; it bumps the fence and the write version, and gives what it writes the
store's expiry. On every error the key space is unchanged.
"""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import with_neighbour
from .test_expire import NOW, ClockRedis, with_exp
from .test_scripts import META, OTHER, RING, WV, expect_error, make_store

pytestmark = pytest.mark.lua

FLAGS, FENCE = b"td:{s}:rf", b"td:{s}:fence"
RATE = b"td:{s}:rate"
KEYS = [META, RING, FLAGS, FENCE, WV, RATE]
CAP = 8


@pytest.fixture
def r() -> ClockRedis:
    """The shim with a frozen clock and PEXPIREAT (overrides conftest's ``r``), with the neighbour store."""
    return with_neighbour(ClockRedis())


def set_total(r: ClockRedis, lua_version: str, total: Any, cap: Any = CAP) -> Any:
    return r.run("ring_total", KEYS, [str(total), str(cap)], lua_version)


def neighbour_unchanged(r: ClockRedis) -> None:
    assert {k: r.data[k] for k in OTHER} == OTHER


@pytest.mark.parametrize(
    ("flags", "total", "want"),
    [
        # rows 5-6 reserved and not written yet (in flight): their record is kept
        (b"\x01\x01\x01\x01\x01\x00\x00", 7, b"\x01\x01\x01\x01\x01\x00\x00"),
        # rows never reserved (past the flags) count as written
        (b"\x01\x01", 5, b"\x01\x01\x01\x01\x01"),
        (b"\x01\x00", 5, b"\x01\x00\x01\x01\x01"),
        # fewer rows: the flags past them are dropped (a reservation there cannot be kept)
        (b"\x01\x00\x01\x01\x01", 2, b"\x01\x00"),
        # no flags (a ring appended to before they existed): every counted row is written
        (None, 3, b"\x01\x01\x01"),
        # past the capacity: every row of the ring
        (b"\x01\x01\x00\x01\x01\x01\x01\x01", 21, b"\x01\x01\x00\x01\x01\x01\x01\x01"),
        (b"\x01\x01\x01", 100, b"\x01" * CAP),
    ],
)
def test_sets_the_cursor_and_flags_the_counted_rows(r: ClockRedis, lua_version: str, flags: Any, total: int,
                                                     want: bytes) -> None:
    make_store(r, cursor=7, wv="4")
    if flags is not None:
        r.data[FLAGS] = flags
    assert set_total(r, lua_version, total) == min(total, CAP)
    assert r.data[RING] == str(total).encode()
    assert r.data[FLAGS] == want
    assert r.data[FENCE] == b"1", "the fence moves: an append between its two steps checks its rows again"
    assert r.data[WV] == b"5"
    assert not r.ttls, "a store without expiry: nothing expires"
    neighbour_unchanged(r)


def test_zero_drops_the_flags(r: ClockRedis, lua_version: str) -> None:
    make_store(r, cursor=5)
    r.data[FLAGS] = b"\x01\x00\x01\x01\x01"
    r.data[FENCE] = b"3"
    assert set_total(r, lua_version, 0) == 0
    assert r.data[RING] == b"0" and FLAGS not in r.data
    assert r.data[FENCE] == b"4" and r.data[WV] == b"1"
    neighbour_unchanged(r)


def test_the_keys_written_get_the_store_expiry(r: ClockRedis, lua_version: str) -> None:
    make_store(r)  # no append yet: no cursor, no flags, no fence, no write version
    exp = with_exp(r, 60_000)
    assert set_total(r, lua_version, 3) == 3
    for key in (RING, FLAGS, FENCE, WV):
        assert r.ttls[key] == exp - NOW, key
    assert r.data[FLAGS] == b"\x01\x01\x01"
    neighbour_unchanged(r)


@pytest.mark.parametrize(
    ("code", "change", "total", "cap"),
    [
        ("TDS_NOSTORE", "no store", 3, CAP),
        ("TDS_BADARG", None, -1, CAP),
        ("TDS_BADARG", None, "1.5", CAP),
        ("TDS_BADARG", None, "nan", CAP),
        ("TDS_BADARG", None, "inf", CAP),
        ("TDS_BADARG", None, "x", CAP),
        ("TDS_BADARG", None, 3, 0),
        ("TDS_BADARG", None, 3, "-8"),
        ("TDS_BADARG", None, 3, "8.5"),
        ("TDS_BADARG", None, str(2**60), CAP),
        ("TDS_BADARG", None, str(2**52 + 1), CAP),  # past reserve.lua's cursor bound
        ("TDS_BADARG", "text fence", 3, CAP),
        ("TDS_BADARG", "text write version", 3, CAP),
    ],
)
def test_errors_change_nothing(r: ClockRedis, lua_version: str, code: str, change: str | None, total: Any,
                               cap: Any) -> None:
    make_store(r, cursor=5, wv="2")
    r.data[FLAGS] = b"\x01\x00\x01\x01\x01"
    with_exp(r, 60_000)
    if change == "no store":
        del r.data[META]
    elif change == "text fence":
        r.data[FENCE] = b"1.5"
    elif change == "text write version":
        r.data[WV] = b"x"
    expect_error(r, code, "ring_total", KEYS, [str(total), str(cap)], lua_version)


#: the behaviour test of each error code of ring_total.lua (see test_scripts.py)
RING_TOTAL_ERROR_TESTS = {
    "TDS_NOSTORE": test_errors_change_nothing,
    "TDS_BADARG": test_errors_change_nothing,
}
