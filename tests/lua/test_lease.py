"""Read leases on the Lua shim (Lua 5.1 and 5.4): ``lease.lua``, and how ``commit`` refuses a
layout change while a reader's lease is live (``TDS_BUSY``, tmp keys kept for the next call).

The shim's clock stands still at :data:`~tests.lua.test_expire.NOW` ms (``ClockRedis``); a lease
"ends" when the test moves ``now_ms`` past its deadline.
"""

from __future__ import annotations

import pytest

from . import test_expire
from .test_expire import NOW, ClockRedis
from .test_scripts import CK, META, D, commit_argv, expect_error, make_store, put, set_tmp, state

r = test_expire.r  # the shim with a clock (TIME, PEXPIREAT); lua_version comes from conftest.py

pytestmark = pytest.mark.lua

RL = b"td:{s}:rl"
LK = [RL, META]  # KEYS of lease.lua


class TestLease:
    def test_take_renew_drop(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r, lv=7)
        assert r.run("lease", LK, ["take", "a", "2000"], lua_version) == 7
        assert r.data[RL] == {b"a": str(NOW + 2000).encode()} and r.ttls[RL] == 2000
        r.now_ms += 500
        assert r.run("lease", LK, ["take", "b", "1000"], lua_version) == 7
        # the hash lives as long as its longest lease
        assert r.data[RL] == {b"a": str(NOW + 2000).encode(), b"b": str(NOW + 1500).encode()}
        assert r.ttls[RL] == 1500
        r.run("lease", LK, ["take", "b", "3000"], lua_version)  # renewed
        assert r.data[RL][b"b"] == str(NOW + 3500).encode() and r.ttls[RL] == 3000
        assert r.run("lease", LK, ["drop", "a"], lua_version) == 1
        assert r.run("lease", LK, ["drop", "a"], lua_version) == 0
        assert r.run("lease", LK, ["drop", "b"], lua_version) == 1
        assert RL not in r.data, "the last drop leaves no key behind"

    def test_take_drops_ended_leases(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r)
        r.data[RL] = {b"dead": str(NOW - 1).encode(), b"junk": b"x", b"live": str(NOW + 10).encode()}
        r.run("lease", LK, ["take", "me", "100"], lua_version)
        assert r.data[RL] == {b"live": str(NOW + 10).encode(), b"me": str(NOW + 100).encode()}

    def test_missing_store(self, r: ClockRedis, lua_version: str) -> None:
        expect_error(r, "TDS_NOSTORE", "lease", LK, ["take", "a", "100"], lua_version)
        assert RL not in r.data

    @pytest.mark.parametrize("argv", [["take", "", "100"], ["grab", "a", "100"], ["take", "a", "0"],
                                      ["take", "a", "1.5"], ["take", "a", "x"], ["take", "a", "1234567890"]])
    def test_bad_args(self, r: ClockRedis, lua_version: str, argv: list[str]) -> None:
        make_store(r)
        expect_error(r, "TDS_BADARG", "lease", LK, argv, lua_version)


class TestCommitBusy:
    def _add(self, r: ClockRedis, keys: list[bytes], lua_version: str, bump: str = "1") -> object:
        tmp = set_tmp(r, "1", b"new")
        return r.run("commit", [*keys[:3], tmp, D("n"), *keys[3:]], commit_argv("2", bump=bump, ops=[put("n", 4, 5)]), lua_version)

    def test_live_lease_refuses_a_layout_change(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"A"})
        r.data[RL] = {b"reader": str(NOW + 700).encode()}
        tmp = set_tmp(r, "1", b"new")
        err = expect_error(r, "TDS_BUSY", "commit", [*CK, tmp, D("n"), RL], commit_argv("2", ops=[put("n", 4, 5)]), lua_version)
        assert "700 ms" in err.message
        assert r.data[tmp] == b"new", "the tmp key is kept for the call after the wait"
        # the lease ends: the same call goes through
        r.now_ms += 700
        assert r.run("commit", [*CK, tmp, D("n"), RL], commit_argv("2", ops=[put("n", 4, 5)]), lua_version) == 3
        assert state(r)[D("n")] == b"new"

    def test_no_bump_or_no_lease_key_is_not_refused(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"A"})
        r.data[RL] = {b"reader": str(NOW + 700).encode()}
        # a write that keeps the layout (no bump) goes through: readers do not care
        assert self._add(r, [*CK, RL], lua_version, bump="0") == 2
        # a caller that does not name the lease key (an older client) is not refused
        assert self._add(r, list(CK), lua_version) == 3

    def test_ended_or_foreign_lease_is_not_refused(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"A"})
        r.data[RL] = {b"reader": str(NOW).encode()}  # ended just now
        r.data[b"td:{o}:rl"] = {b"x": str(NOW + 5000).encode()}  # another store's lease
        assert self._add(r, [*CK, RL], lua_version) == 3
        r.run("commit", [*CK, D("n"), b"td:{o}:rl"], commit_argv("3", ops=[{"op": "del", "f": "n", "dst": "4"}]), lua_version)
        assert b"n" not in state(r)[b"td:{s}:reg"]
        del r.data[b"td:{o}:rl"]

    def test_no_time_call_without_leases(self, r: ClockRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"A"})
        self._add(r, [*CK, RL], lua_version)
        assert r.commands("TIME") == [], "no extra server-clock call on the hot path"


#: the behaviour test of each error code of lease.lua, and commit's TDS_BUSY (see test_scripts.py)
LEASE_ERROR_TESTS = {
    "TDS_NOSTORE": TestLease.test_missing_store,
    "TDS_BADARG": TestLease.test_bad_args,
}
COMMIT_BUSY_TESTS = {"TDS_BUSY": TestCommitBusy.test_live_lease_refuses_a_layout_change}
