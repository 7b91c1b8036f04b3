"""extend.lua's per-sub-store append counters and commit.lua's ARGV[10] compare-and-set
(issue 16 goal 5: appends do not conflict with a read-modify-write of other entries).

The appends of ``extend()`` now count in the hash ``<base>:ac`` (tdstore/_backend/append.py),
which commit.lua reads (the number of appends is the sum of its fields); extend.lua, kept
for its own tests, still counts in the meta hash."""

from __future__ import annotations

import json

import pytest

from .shim import LUA_VERSIONS, LuaRedis
from .test_scripts import CK, META, OTHER, WV, D, commit_argv, expect_error, extend_argv, make_store, put, set_tmp

pytestmark = pytest.mark.lua


@pytest.fixture(params=LUA_VERSIONS, ids=[f"lua{v}" for v in LUA_VERSIONS])
def lua_version(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def r() -> LuaRedis:
    """The in-memory shim with a neighbour store no script may touch (as in test_scripts.py)."""
    shim = LuaRedis()
    for key, value in OTHER.items():
        shim.data[key] = dict(value) if isinstance(value, dict) else value
    return shim

RING_KEYS = [META, WV, b"td:{s}:ring"]
AC = b"td:{s}:ac"  # the append counters (see tdstore/_core/keys.py)


def cas(w: int, **fields: str) -> str:
    return json.dumps({"w": str(w), "f": {k.replace("_", ":", 1): v for k, v in fields.items()}})


def commit_cas(expected_cas: str, **kw: object) -> list[str]:
    return [*commit_argv(first="0", **kw), "", expected_cas]  # type: ignore[arg-type]


def test_extend_counts_appends_per_substore(r: LuaRedis, lua_version: str) -> None:
    make_store(r, entries={"x": b"abcdefgh"}, wv="3")
    argv = extend_argv("2", 1, 4, (2, b"11"))
    assert r.run("extend", [*RING_KEYS, D("x")], [*argv, "a:buf"], lua_version) == 0
    assert r.run("extend", [*RING_KEYS, D("x")], [*argv, "a:buf"], lua_version) == 1
    assert r.run("extend", [*RING_KEYS, D("x")], [*argv, "a:"], lua_version) == 2
    meta = r.data[META]
    assert (meta[b"ac"], meta[b"a:buf"], meta[b"a:"]) == (b"3", b"2", b"1")
    assert r.data[WV] == b"6"  # every append still bumps the write version
    assert r.data[D("x")] == b"111111gh"


def test_extend_without_the_counter_leaves_meta_alone(r: LuaRedis, lua_version: str) -> None:
    make_store(r, entries={"x": b"abcdefgh"})
    before = dict(r.data[META])
    r.run("extend", [*RING_KEYS, D("x")], extend_argv("2", 1, 4, (2, b"11")), lua_version)
    assert r.data[META] == before


@pytest.mark.parametrize(
    "stored_wv,ac,field,sent,ok",
    [
        ("7", "5", "3", cas(2, a_buf="3"), True),  # 7 writes, 5 of them appends
        ("7", "5", "3", cas(2, a_stats=""), True),  # absent counter expected absent
        ("8", "6", "4", cas(2, a_stats=""), True),  # an append elsewhere since: no conflict
        ("8", "6", "4", cas(2, a_buf="3"), False),  # an append into "buf" since
        ("8", "5", "3", cas(2, a_buf="3"), False),  # a write other than an append since
        ("7", "5", "3", cas(2, a_stats="0"), False),  # "" and "0" differ: only "" is absent
    ],
)
def test_commit_cas(r: LuaRedis, lua_version: str, stored_wv: str, ac: str, field: str, sent: str, ok: bool) -> None:
    make_store(r, entries={"a": b"old"}, wv=stored_wv)
    # ac appends in all: field of them into "buf", the others into a sub-store "other"
    r.data[AC] = {b"a:buf": field.encode(), b"a:other": str(int(ac) - int(field)).encode()}
    tmp = set_tmp(r, "1", b"new")
    keys = [*CK, tmp, D("a")]
    argv = commit_cas(sent, ops=[put("a", 4, 5)], bump="0")
    if ok:
        r.run("commit", keys, argv, lua_version)
        assert r.data[D("a")] == b"new"
        assert r.data[WV] == str(int(stored_wv) + 1).encode()
    else:
        exc = expect_error(r, "TDS_CONFLICT", "commit", keys, argv, lua_version, deleted=(tmp,))
        assert exc.message == "TDS_CONFLICT the entries read were written since the client read them"
