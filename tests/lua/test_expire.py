"""Lifetimes on the Lua shim (Lua 5.1 and 5.4): ``expire.lua``, and how ``commit``,
``reserve`` and ``write_runs`` give the keys they create the store's expiry.

The shim's clock stands still at :data:`NOW` ms; ``PEXPIREAT key t`` records the TTL
``t - NOW`` in ``ttls`` (deleting the key when it is not in the future), so each test
compares the whole key space and every TTL with the expected ones.
"""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import with_neighbour
from .shim import LuaRedis, RedisCommandError
from .test_scripts import (
    CK,
    META,
    OTHER,
    REG,
    RING,
    WV,
    D,
    M,
    commit_argv,
    expect_error,
    make_store,
    put,
    runs_argv,
    set_tmp,
    state,
    zero,
)

pytestmark = pytest.mark.lua

NOW = 1_700_000_000_123  # the shim's clock, ms since the epoch


class ClockRedis(LuaRedis):
    """The shim with a frozen clock, TIME, PEXPIREAT and PTTL."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.now_ms = NOW
        self._commands[b"TIME"] = (self._cmd_time, 0, 0)
        self._commands[b"PEXPIREAT"] = (self._cmd_pexpireat, 2, 2)
        self._commands[b"PTTL"] = (self._cmd_pttl, 1, 1)

    def _cmd_time(self) -> list[bytes]:
        return [str(self.now_ms // 1000).encode(), str(self.now_ms % 1000 * 1000 + 456).encode()]

    def _cmd_pexpireat(self, key: bytes, at: bytes) -> int:
        if not at.isdigit():
            raise RedisCommandError("ERR value is not an integer or out of range")
        return self._expire(key, int(at) - self.now_ms)

    def _cmd_pttl(self, key: bytes) -> int:
        if key not in self.data:
            return -2
        return self.ttls.get(key, -1)


@pytest.fixture
def r() -> ClockRedis:
    """The shim with a frozen clock (overrides conftest's ``r``), with the neighbour store."""
    return with_neighbour(ClockRedis())


def with_exp(r: LuaRedis, ttl: int) -> int:
    """Gives the store under test an expiry ``ttl`` ms from now, as expire.lua would; returns it."""
    exp = NOW + ttl
    r.data[META][b"exp"] = str(exp).encode()
    r.data[META][b"ttl"] = str(ttl).encode()
    for key in list(r.data):
        if key not in OTHER:
            r.ttls[key] = ttl
    return exp


def ttls(r: LuaRedis) -> dict[bytes, int]:
    assert all(key not in r.ttls for key in OTHER), "a script touched another store's TTLs"
    return dict(r.ttls)


# =========================================================================== #
# expire.lua
# =========================================================================== #
EK = [META, REG, WV, RING]


class TestExpire:
    def test_sets_one_expiry_on_every_key(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa", "b": b"bbb"}, nodes=("n",), wv="7", cursor=12)
        before = state(r)
        result = r.run("expire", [*EK, D("a"), D("b")], ["2", "3", "5000"], lua_version)
        assert result == NOW + 5000 and type(result) is int
        after = state(r)
        assert after[META] == {**before[META], b"exp": str(NOW + 5000).encode(), b"ttl": b"5000"}
        assert {k: v for k, v in after.items() if k != META} == {k: v for k, v in before.items() if k != META}
        assert ttls(r) == {key: 5000 for key in after}
        assert {args[1] for args in r.commands("PEXPIREAT")} == {str(NOW + 5000).encode()}

    def test_replaces_an_expiry(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa"}, wv="1")
        with_exp(r, 100)
        assert r.run("expire", [*EK, D("a")], ["2", "1", "987654"], lua_version) == NOW + 987654
        assert ttls(r) == {META: 987654, REG: 987654, WV: 987654, D("a"): 987654}
        assert state(r)[META][b"ttl"] == b"987654"

    def test_persist_removes_every_expiry(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa"}, wv="1", cursor=3)
        before = state(r)
        with_exp(r, 100)
        assert r.run("expire", [*EK, D("a")], ["2", "1", ""], lua_version) == 0
        assert state(r) == before, "the exp and ttl fields are gone, nothing else changed"
        assert ttls(r) == {}

    def test_persist_of_a_store_without_expiry_changes_nothing(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa"})
        before = r.snapshot()
        assert r.run("expire", [*EK, D("a")], ["", "1", ""], lua_version) == 0
        assert r.snapshot() == before

    def test_missing_keys_are_skipped(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa"})  # no wv, no ring yet
        r.run("expire", [*EK, D("a"), D("evicted")], ["2", "1", "10"], lua_version)
        assert set(state(r)) == {META, REG, D("a")}
        assert ttls(r) == {META: 10, REG: 10, D("a"): 10}

    def test_empty_expected_version_skips_the_check(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r, lv=9)
        assert r.run("expire", EK, ["", "0", "10"], lua_version) == NOW + 10

    def test_longest_lifetime(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r)
        ttl = "9" * 15
        assert r.run("expire", EK, ["2", "0", ttl], lua_version) == NOW + int(ttl)
        assert {args[1] for args in r.commands("PEXPIREAT")} == {str(NOW + int(ttl)).encode()}  # exact in Lua 5.1

    def test_missing_store(self, r: ClockRedis, lua_version: str) -> None:
        expect_error(r, "TDS_NOSTORE", "expire", [*EK, D("a")], ["2", "1", "10"], lua_version)

    def test_stale_version(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa"})
        exc = expect_error(r, "TDS_STALE", "expire", [*EK, D("a")], ["3", "1", "10"], lua_version)
        assert exc.message == "TDS_STALE layout version is 2, client assumed 3"

    def test_registry_size_mismatch(self, r: ClockRedis, lua_version: str) -> None:
        """A key registered since the client listed them would keep no expiry: refused."""
        make_store(r, entries={"a": b"aaa", "b": b"bbb"})
        exc = expect_error(r, "TDS_STALE", "expire", [*EK, D("a")], ["", "1", "10"], lua_version)
        assert exc.message == "TDS_STALE registry has 2 entries, client knows of 1"

    @pytest.mark.parametrize("ttl", ["0", "-5", "1.5", "x", " 10", "010", "1e3", "9" * 16])
    def test_bad_lifetime(self, r: ClockRedis, lua_version: str, ttl: str) -> None:
        make_store(r, entries={"a": b"aaa"})
        exc = expect_error(r, "TDS_BADARG", "expire", [*EK, D("a")], ["2", "1", ttl], lua_version)
        assert exc.message == f"TDS_BADARG the lifetime must be a positive number of ms, got {ttl}"

    def test_bad_lifetime_is_reported_before_missing_store(self, r: ClockRedis, lua_version: str) -> None:
        expect_error(r, "TDS_BADARG", "expire", EK, ["2", "0", "0"], lua_version)


# =========================================================================== #
# commit: a new store's lifetime (ARGV[9]) and keys created in a store with one
# =========================================================================== #


class TestCommitLifetime:
    def test_new_store_with_a_lifetime(self, r: ClockRedis, lua_version: str) -> None:
        tmp = set_tmp(r, "1", b"payload")
        keys = [*CK, tmp, D("a"), D("z")]
        ops = [put("a", 4, 5), zero("z", 6, "3"), {"op": "node", "f": "n", "m": '{"k":"td"}'}]
        argv = commit_argv("new", meta={"bs": "[4]"}, ops=ops, first="0") + ["60000"]
        assert r.run("commit", keys, argv, lua_version) == 1
        exp = str(NOW + 60000).encode()
        meta = {b"lv": b"1", b"fmt": b"1", b"lock": b"0", b"bs": b"[4]", b"exp": exp, b"ttl": b"60000", b"ne": b"3"}
        assert state(r)[META] == meta
        assert set(state(r)) == {META, REG, WV, D("a"), D("z")}
        assert ttls(r) == {key: 60000 for key in (META, REG, WV, D("a"), D("z"))}
        assert {args[1] for args in r.commands("PEXPIREAT")} == {exp}
        assert r.commands("PERSIST") == []

    def test_new_store_without_a_lifetime(self, r: ClockRedis, lua_version: str) -> None:
        tmp = set_tmp(r, "1", b"payload")
        argv = commit_argv("new", ops=[put("a", 4, 5)], first="0") + [""]
        r.run("commit", [*CK, tmp, D("a")], argv, lua_version)
        assert ttls(r) == {} and b"exp" not in state(r)[META]
        assert r.commands("TIME") == [] and r.commands("PEXPIREAT") == []

    def test_lifetime_is_ignored_unless_new(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa"})
        tmp = set_tmp(r, "1", b"bbb")
        r.run("commit", [*CK, tmp, D("b")], commit_argv(ops=[put("b", 4, 5)], first="0") + ["60000"], lua_version)
        assert ttls(r) == {} and r.commands("PEXPIREAT") == []

    @pytest.mark.parametrize("ttl", ["0", "-1", "2.5", "x", "9" * 16])
    def test_bad_lifetime_applies_nothing(self, r: ClockRedis, lua_version: str, ttl: str) -> None:
        tmp = set_tmp(r, "1", b"payload")
        argv = commit_argv("new", ops=[put("a", 4, 5)], first="0") + [ttl]
        exc = expect_error(r, "TDS_BADARG", "commit", [*CK, tmp, D("a")], argv, lua_version, deleted=(tmp,))
        assert exc.message == f"TDS_BADARG the lifetime must be a positive number of ms, got {ttl}"

    def test_lifetime_for_an_existing_store_is_refused_as_exists(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r)
        expect_error(r, "TDS_EXISTS", "commit", CK, commit_argv("new", first="0") + ["10"], lua_version)

    def test_put_into_a_store_with_an_expiry(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa"}, wv="4")
        with_exp(r, 777)
        tmp = set_tmp(r, "1", b"new")  # a tmp key's own TTL must not survive the rename
        r.run("commit", [*CK, tmp, D("a"), D("b")], commit_argv(ops=[put("a", 4, 5), zero("b", 6, "2")]), lua_version)
        assert state(r)[D("a")] == b"new" and state(r)[D("b")] == b"\0\0"
        assert ttls(r) == {key: 777 for key in (META, REG, WV, D("a"), D("b"))}
        assert (META, str(NOW + 777).encode()) not in r.commands("PEXPIREAT"), "writers WATCH the meta hash"

    def test_registry_and_counter_created_later_get_the_expiry(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r)  # no registry, no write version yet
        with_exp(r, 50)
        r.run("commit", [*CK, D("z")], commit_argv(ops=[zero("z", 4, "1")]), lua_version)
        assert ttls(r) == {META: 50, REG: 50, WV: 50, D("z"): 50}

    def test_move_gives_the_target_the_expiry(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa"}, wv="1")
        with_exp(r, 90)
        r.ttls[D("a")] = 5  # whatever the source carried
        op = {"op": "move", "f": "a", "t": "b", "m": M("b"), "src": "4", "dst": "5"}
        r.run("commit", [*CK, D("a"), D("b")], commit_argv(ops=[op]), lua_version)
        assert D("a") not in state(r) and state(r)[D("b")] == b"aaa"
        assert ttls(r) == {META: 90, REG: 90, WV: 90, D("b"): 90}

    def test_meta_only_commit_touches_no_expiry(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa"})
        with_exp(r, 90)
        r.run("commit", CK, commit_argv(meta={"lock": "1"}), lua_version)
        assert r.commands("PEXPIREAT") == [] and r.commands("PERSIST") == []

    @pytest.mark.parametrize("field", ["exp", "ttl"])
    def test_expiry_fields_cannot_be_set_by_a_meta_update(self, r: ClockRedis, lua_version: str, field: str) -> None:
        make_store(r)
        exc = expect_error(r, "TDS_BADARG", "commit", CK, commit_argv(meta={field: "1"}), lua_version)
        assert exc.message == f"TDS_BADARG meta field {field} cannot be set"


# =========================================================================== #
# reserve (the first step of an append) and write_runs
# =========================================================================== #

RESERVE_KEYS = [META, RING, b"td:{s}:rf", b"td:{s}:fence", WV, b"td:{s}:rate"]


class TestReserveLifetime:
    def test_cursor_and_flags_get_the_expiry(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r, entries={"x": b"abcdefgh"})
        exp = with_exp(r, 300)
        assert r.run("reserve", RESERVE_KEYS, ["2", "1", "4", "new", "0", "0"], lua_version) == [0, str(exp).encode(), b"2"]
        assert state(r)[RING] == b"1"
        rf = RESERVE_KEYS[2]
        assert ttls(r) == {META: 300, REG: 300, D("x"): 300, RING: 300, rf: 300}

    def test_a_takeover_gives_the_fence_the_expiry(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r, entries={"x": b"abcdefgh"}, cursor=4)
        with_exp(r, 300)
        r.data[RESERVE_KEYS[2]] = b"\x00\x01\x01\x01"  # row 0: an appender died between its steps
        r.run("reserve", RESERVE_KEYS, ["2", "1", "4", "new", "0", "0"], lua_version)
        assert r.data[RESERVE_KEYS[3]] == b"1" and ttls(r)[RESERVE_KEYS[3]] == 300

    def test_no_expiry_no_ttl(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r, entries={"x": b"abcdefgh"})
        r.run("reserve", RESERVE_KEYS, ["2", "1", "4", "new", "0", "0"], lua_version)
        assert ttls(r) == {} and r.commands("PEXPIREAT") == []


class TestWriteRunsLifetime:
    def test_counter_created_gets_the_expiry(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r, entries={"x": b"abcd"})
        with_exp(r, 40)
        r.run("write_runs", [META, WV, D("x")], runs_argv("2", ([(1, 2)], b"ZZ")), lua_version)
        assert state(r)[D("x")] == b"aZZd" and state(r)[WV] == b"1"
        assert ttls(r) == {META: 40, REG: 40, WV: 40, D("x"): 40}

    def test_existing_counter_is_left_alone(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r, entries={"x": b"abcd"}, wv="5")
        with_exp(r, 40)
        r.run("write_runs", [META, WV, D("x")], runs_argv("2", ([(0, 1)], b"Z")), lua_version)
        assert r.commands("PEXPIREAT") == [] and r.commands("HGET") == [], "no extra work on the hot path"
        assert ttls(r)[WV] == 40


#: the behaviour test of each error code of expire.lua (see test_scripts.py)
EXPIRE_ERROR_TESTS = {
    "TDS_NOSTORE": TestExpire.test_missing_store,
    "TDS_STALE": TestExpire.test_stale_version,
    "TDS_BADARG": TestExpire.test_bad_lifetime,
}
