"""The rate limiter's scripts on the in-memory shim: rate_limit.lua (set, clear),
rate_sample.lua (a sample counted, or held back), and the limiter's part of reserve.lua
(an append counted in its reserve step, or held back) and of ring_total.lua (an emptied ring
starts its counts again).

The limits follow DeepMind Reverb's ``RateLimiter``: a sample of n needs ``size >= min`` and
``ins * spi - smp - n >= lo``; an insert of n goes while the ring holds at most ``min`` rows
after it, or while ``(ins + n) * spi - smp <= hi``. A property test runs random sequences of
inserts and samples against a Python model of those rules.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from .shim import LuaRedis
from .test_scripts import META, RING, WV, D, expect_error, make_store

pytestmark = pytest.mark.lua

FLAGS, FENCE, RATE = b"td:{s}:rf", b"td:{s}:fence", b"td:{s}:rate"
CAP = 8
RESERVE_KEYS = [META, RING, FLAGS, FENCE, WV, RATE]


def set_limit(r: LuaRedis, lua_version: str, min_size: int = 2, spi: float = 1.0, lo: float = -1e300,
              hi: float = 1e300, to: str = "") -> Any:
    return r.run("rate_limit", [META, RATE], ["set", str(min_size), repr(spi), repr(lo), repr(hi), to], lua_version)


def sample(r: LuaRedis, lua_version: str, n: int, cap: int = CAP) -> Any:
    return r.run("rate_sample", [META, RING, RATE], [str(n), str(cap)], lua_version)


def reserve(r: LuaRedis, lua_version: str, n: int, mode: str = "new", start: int = 0) -> Any:
    return r.run("reserve", RESERVE_KEYS, ["2", str(n), str(CAP), mode, str(start), "2"], lua_version)


def store(r: LuaRedis, cursor: int | None = None) -> None:
    make_store(r, entries={"x": b"ab" * CAP}, cursor=cursor)


# --------------------------------------------------------------------------- rate_limit
def test_set_starts_the_counts_and_marks_the_meta_hash(r: LuaRedis, lua_version: str) -> None:
    store(r)
    r.data[RATE] = {b"ins": b"99", b"smp": b"7", b"min": b"1"}  # an old limiter: replaced whole
    assert set_limit(r, lua_version, 3, 2.0, 1.0, 11.0, "250") == 1
    assert r.data[RATE] == {b"min": b"3", b"spi": b"2.0", b"lo": b"1.0", b"hi": b"11.0", b"to": b"250", b"ins": b"0", b"smp": b"0"}
    assert r.data[META][b"lim"] == b"1"
    assert r.run("rate_limit", [META, RATE], ["clear"], lua_version) == 1
    assert RATE not in r.data and b"lim" not in r.data[META]


def test_set_errors_change_nothing(r: LuaRedis, lua_version: str) -> None:
    store(r)
    for argv in (
        ["set", "2", "0", "0", "1", ""],  # samples per insert 0
        ["set", "-1", "1", "0", "1", ""],
        ["set", "2", "1", "5", "1", ""],  # lo > hi
        ["set", "2", "nan", "0", "1", ""],
        ["set", "2", "1", "0", "1", "1.5"],  # a timeout not in whole ms
        ["set", "2", "1", "0"],
        ["other"],
    ):
        expect_error(r, "TDS_BADARG", "rate_limit", [META, RATE], argv, lua_version)


def test_set_on_a_missing_store(r: LuaRedis, lua_version: str) -> None:
    expect_error(r, "TDS_NOSTORE", "rate_limit", [META, RATE], ["clear"], lua_version)


# --------------------------------------------------------------------------- rate_sample
def test_no_limiter_counts_nothing(r: LuaRedis, lua_version: str) -> None:
    store(r, cursor=3)
    before = r.snapshot()
    assert sample(r, lua_version, 2) == [-1, b""]
    assert r.snapshot() == before


def test_a_sample_waits_for_min_size_then_is_counted(r: LuaRedis, lua_version: str) -> None:
    store(r, cursor=1)
    set_limit(r, lua_version, min_size=2, to="40")
    before = r.snapshot()
    assert sample(r, lua_version, 4) == [0, b"40"]
    assert r.snapshot() == before  # held back: nothing changed
    r.data[RING] = b"2"
    assert sample(r, lua_version, 4) == [1, b""]
    assert r.data[RATE][b"smp"] == b"4"


def test_sample_errors_change_nothing(r: LuaRedis, lua_version: str) -> None:
    store(r, cursor=3)
    set_limit(r, lua_version)
    expect_error(r, "TDS_BADARG", "rate_sample", [META, RING, RATE], ["0", str(CAP)], lua_version)
    expect_error(r, "TDS_BADARG", "rate_sample", [META, RING, RATE], ["1", "nan"], lua_version)
    r.data[RATE][b"smp"] = b"1.5"
    expect_error(r, "TDS_CORRUPT", "rate_sample", [META, RING, RATE], ["1", str(CAP)], lua_version)
    r.data[RATE] = b"a string"
    expect_error(r, "TDS_CORRUPT", "rate_sample", [META, RING, RATE], ["1", str(CAP)], lua_version)
    set_limit(r, lua_version)
    r.data[RING] = b"-4"
    expect_error(r, "TDS_CORRUPT", "rate_sample", [META, RING, RATE], ["1", str(CAP)], lua_version)
    del r.data[META]
    expect_error(r, "TDS_NOSTORE", "rate_sample", [META, RING, RATE], ["1", str(CAP)], lua_version)


# --------------------------------------------------------------------------- reserve
def test_reserve_counts_its_rows_and_a_held_one_changes_nothing(r: LuaRedis, lua_version: str) -> None:
    store(r, cursor=4)
    r.data[FLAGS] = b"\x01" * 4
    set_limit(r, lua_version, min_size=2, spi=1.0, lo=0.0, hi=3.0, to="")
    assert reserve(r, lua_version, 3)[0] == 4  # (0 + 3) * 1 - 0 = 3 <= hi
    assert r.data[RATE][b"ins"] == b"3"
    before = r.snapshot()
    assert reserve(r, lua_version, 1) == [-2, b"", b"2", b""]  # 4 > hi: held back
    assert r.snapshot() == before
    # a "keep" re-check of rows reserved before is not a new insert: never held back nor counted
    assert reserve(r, lua_version, 3, mode="keep", start=4)[0] == 4
    assert r.data[RATE][b"ins"] == b"3"


def test_reserve_refuses_a_damaged_limiter(r: LuaRedis, lua_version: str) -> None:
    store(r, cursor=0)
    set_limit(r, lua_version)
    r.data[RATE][b"hi"] = b"lots"
    expect_error(r, "TDS_CORRUPT", "reserve", [*RESERVE_KEYS, D("x")],
                 ["2", "1", str(CAP), "new", "0", "0", "2", "0"], lua_version)


def test_an_emptied_ring_starts_its_counts_again(r: LuaRedis, lua_version: str) -> None:
    store(r, cursor=5)
    set_limit(r, lua_version)
    r.data[RATE][b"ins"], r.data[RATE][b"smp"] = b"5", b"9"
    r.run("ring_total", RESERVE_KEYS, ["3", str(CAP)], lua_version)
    assert (r.data[RATE][b"ins"], r.data[RATE][b"smp"]) == (b"5", b"9")  # (a cursor set, not emptied)
    r.run("ring_total", RESERVE_KEYS, ["0", str(CAP)], lua_version)
    assert (r.data[RATE][b"ins"], r.data[RATE][b"smp"]) == (b"0", b"0")


# --------------------------------------------------------------------------- against Reverb's rules
class Model:
    """Reverb's RateLimiter over a ring of ``cap`` rows (size: rows held, FIFO removal)."""

    def __init__(self, min_size: int, spi: float, lo: float, hi: float, cap: int) -> None:
        self.min, self.spi, self.lo, self.hi, self.cap = min_size, spi, lo, hi, cap
        self.ins = self.smp = self.cursor = 0

    def insert(self, n: int) -> bool:
        size_after = min(self.cursor + n, self.cap)
        if size_after > self.min and (self.ins + n) * self.spi - self.smp > self.hi:
            return False
        self.ins += n
        self.cursor += n
        return True

    def sample(self, n: int) -> bool:
        if min(self.cursor, self.cap) < self.min or self.ins * self.spi - self.smp - n < self.lo:
            return False
        self.smp += n
        return True


@pytest.mark.parametrize("seed", range(12))
def test_random_sequences_follow_reverbs_rules(r: LuaRedis, lua_version: str, seed: int) -> None:
    rng = random.Random(seed)
    min_size = rng.randint(1, CAP)
    spi = rng.choice([0.5, 1.0, 2.0, 3.0])
    buffer = max(1.0, spi) * rng.choice([1, 1.5, 3])
    lo, hi = spi * min_size - buffer, spi * min_size + buffer
    store(r, cursor=0)
    r.data[FLAGS] = b""
    set_limit(r, lua_version, min_size, spi, lo, hi)
    model = Model(min_size, spi, lo, hi, CAP)
    went = {"insert": 0, "sample": 0, "held": 0}
    for _ in range(150):
        if rng.random() < 0.5:
            n = rng.randint(1, 3)
            got = reserve(r, lua_version, n)
            ok = got[0] != -2
            if ok:  # the client's write sets the rows' flags
                for row in range(int(got[0]), int(got[0]) + n):
                    flags = bytearray(r.data.get(FLAGS, b""))
                    flags.extend(b"\0" * (CAP - len(flags)))
                    flags[row % CAP] = 1
                    r.data[FLAGS] = bytes(flags)
            assert ok == model.insert(n), (seed, "insert", n, model.__dict__)
            went["insert" if ok else "held"] += 1
        else:
            n = rng.randint(1, 4)
            ok = sample(r, lua_version, n)[0] == 1
            assert ok == model.sample(n), (seed, "sample", n, model.__dict__)
            went["sample" if ok else "held"] += 1
        assert int(r.data[RATE][b"ins"]) == model.ins and int(r.data[RATE][b"smp"]) == model.smp
    assert went["insert"] and went["held"], went  # both paths were taken


#: the behaviour test of each error code of the limiter's scripts (see test_scripts.py)
RATE_LIMIT_ERROR_TESTS = {"TDS_NOSTORE": test_set_on_a_missing_store, "TDS_BADARG": test_set_errors_change_nothing}
RATE_SAMPLE_ERROR_TESTS = {
    "TDS_NOSTORE": test_sample_errors_change_nothing,
    "TDS_BADARG": test_sample_errors_change_nothing,
    "TDS_CORRUPT": test_sample_errors_change_nothing,
}
