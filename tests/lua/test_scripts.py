"""Behaviour of every Lua script on the in-memory shim, under Lua 5.1 and Lua 5.4.

Each test checks the exact effect on the key space: the happy paths compare the whole
key space after the call with the expected one, the error paths check the error code,
the exception class the client maps it to, and that the key space is byte-for-byte
unchanged (for ``commit``: except that the tmp keys of its "put" ops are deleted, which
the script does on every error).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import redis.exceptions

from tdstore._backend.scripts import get_script, script_names
from tdstore.errors import LUA_ERRORS, translate_response_error

from .shim import (
    LUA_VERSIONS,
    LuaRedis,
    LuaScriptError,
    VirtualString,
    compile_source,
    tdstore_error,
)

pytestmark = pytest.mark.lua

# keys of the store under test (see tdstore/_core/keys.py), and of a neighbour store no
# script may touch
META, REG, WV, RING = b"td:{s}:meta", b"td:{s}:reg", b"td:{s}:wv", b"td:{s}:ring"
OTHER = {
    b"td:{o}:meta": {b"lv": b"5", b"fmt": b"1", b"lock": b"0"},
    b"td:{o}:reg": {b"a": b'{"k":"t"}'},
    b"td:{o}:wv": b"9",
    b"td:{o}:ring": b"6",
    b"td:{o}:d:a": b"neighbour bytes",
}


def D(path: str) -> bytes:
    return b"td:{s}:d:" + path.encode()


def TMP(nonce: str) -> bytes:
    return b"td:{s}:tmp:" + nonce.encode()


def M(path: str, **extra: Any) -> str:
    """Registry metadata of an entry (opaque to the scripts)."""
    return json.dumps({"k": "t", "p": path, **extra}, separators=(",", ":"))


def make_store(
    r: LuaRedis,
    *,
    lv: int = 2,
    lock: str = "0",
    entries: dict[str, bytes] | None = None,
    nodes: tuple[str, ...] = (),
    wv: str | None = None,
    cursor: int | None = None,
) -> None:
    """A store at layout version ``lv`` with leaf ``entries`` (path -> bytes) and ``nodes``.

    ``wv``: the write-version key ``WV``; None leaves it out (a store no write reached
    yet, which the scripts read as "0"). ``cursor``: the ring cursor key ``RING``; None
    leaves it out (no append yet).
    """
    r.data[META] = {b"lv": str(lv).encode(), b"fmt": b"1", b"lock": lock.encode(), b"bs": b"[4]"}
    if wv is not None:
        r.data[WV] = wv.encode()
    if cursor is not None:
        r.data[RING] = str(cursor).encode()
    reg: dict[bytes, bytes] = {}
    for path, data in (entries or {}).items():
        reg[path.encode()] = M(path).encode()
        r.data[D(path)] = data
    for path in nodes:
        reg[path.encode()] = json.dumps({"k": "td"}).encode()
    if reg:
        r.data[REG] = reg


def state(r: LuaRedis) -> dict[bytes, Any]:
    """The key space of the store under test (the neighbour checked separately)."""
    neighbour = {k: v for k, v in r.data.items() if k in OTHER}
    assert neighbour == OTHER, "a script touched another store's keys"
    return {k: v for k, v in r.data.items() if k not in OTHER}


def wv_bumped(snapshot: tuple[dict[bytes, Any], dict[bytes, int]], by: int = 1) -> tuple[dict[bytes, Any], dict[bytes, int]]:
    """``snapshot`` (of ``r.snapshot()``) with the store's write-version key raised by ``by``."""
    data, ttls = copy.deepcopy(snapshot)
    data[WV] = str(int(data.get(WV, b"0")) + by).encode()
    return data, ttls


def wv_of(r: LuaRedis) -> bytes | None:
    return r.data.get(WV)


def expect_error(
    r: LuaRedis,
    code: str,
    script: str,
    keys: list[Any],
    argv: list[Any],
    lua_version: str,
    *,
    deleted: tuple[bytes, ...] = (),
) -> LuaScriptError:
    """Runs a call that must fail with ``code``; the key space must be unchanged but for ``deleted``."""
    data_before, ttls_before = r.snapshot()
    with pytest.raises(LuaScriptError) as info:
        r.run(script, keys, argv, lua_version)
    exc = info.value
    assert exc.code == code, exc.message
    assert code in get_script(script).header.errors, f"{code} is not in the Errors list of {script}"
    assert type(tdstore_error(exc)) is LUA_ERRORS[code]
    # the client maps the same text, with and without Redis 6's wrapping, to the same class
    for text in (exc.message, f"Error running script (call to f_0123): @user_script:1: {exc.message}"):
        translated = translate_response_error(redis.exceptions.ResponseError(text))
        assert type(translated) is LUA_ERRORS[code]
    for key in deleted:
        data_before.pop(key, None)
        ttls_before.pop(key, None)
    assert r.data == data_before
    assert r.ttls == ttls_before
    return exc


# =========================================================================== #
# All scripts compile in both dialects
# =========================================================================== #


@pytest.mark.parametrize("name", script_names())
def test_script_compiles(name: str, lua_version: str) -> None:
    compile_source(get_script(name).source, lua_version)


def test_compile_check_catches_dialect_errors() -> None:
    from .shim import LuaCompileError

    with pytest.raises(LuaCompileError):
        compile_source("local x = 7 // 2 return x", "5.1")  # floor division: 5.3+
    compile_source("local x = 7 // 2 return x", "5.4")
    with pytest.raises(LuaCompileError):
        compile_source("goto done ::done::", "5.1")


# =========================================================================== #
# commit
# =========================================================================== #


def commit_argv(
    expected: str = "2",
    *,
    bump: str = "1",
    lock: str = "0",
    meta: dict[str, Any] | None = None,
    ops: list[dict[str, Any]] | str = (),  # type: ignore[assignment]
    fmt: str = "1",
    wv: str = "",
    first: str | None = None,
) -> list[str]:
    """ARGV of commit; ``wv`` is ARGV[7], the expected write version ("" skips the check);
    ``first`` is ARGV[8], the first layout version of a new store (None leaves it out)."""
    argv = [
        expected,
        bump,
        lock,
        "" if meta is None else json.dumps(meta),
        ops if isinstance(ops, str) else json.dumps(list(ops)),
        fmt,
        wv,
    ]
    if first is not None:
        argv.append(first)
    return argv


def put(f: str, src: int, dst: int, m: str | None = None) -> dict[str, str]:
    return {"op": "put", "f": f, "m": m or M(f), "src": str(src), "dst": str(dst)}


def zero(f: str, dst: int, n: Any) -> dict[str, Any]:
    return {"op": "zero", "f": f, "m": M(f), "dst": str(dst), "n": n}


def set_tmp(r: LuaRedis, nonce: str, payload: bytes) -> bytes:
    r.call("SET", TMP(nonce), payload, "PX", "60000")
    return TMP(nonce)


# KEYS[1..3] of every commit: data and tmp keys start at KEYS[4]
CK = [META, REG, WV]
META2 = {b"lv": b"2", b"fmt": b"1", b"lock": b"0", b"bs": b"[4]"}  # make_store()'s meta hash


def meta_at(lv: int) -> dict[bytes, bytes]:
    """make_store()'s meta hash at layout version ``lv``."""
    return {**META2, b"lv": str(lv).encode()}


class TestCommitCreate:
    def test_new_store_with_entries(self, r: LuaRedis, lua_version: str) -> None:
        tmp = set_tmp(r, "1", b"\x00\x01payload\xff")
        keys = [*CK, tmp, D("a"), D("z")]
        ops = [put("a", 4, 5), zero("z", 6, "3"), {"op": "node", "f": "n", "m": '{"k":"td"}'}]
        result = r.run("commit", keys, commit_argv("new", meta={"bs": "[4]", "dev": "cpu"}, ops=ops, fmt="7"), lua_version)
        assert result == 1 and type(result) is int
        assert state(r) == {
            META: {b"lv": b"1", b"fmt": b"7", b"lock": b"0", b"bs": b"[4]", b"dev": b"cpu", b"ne": b"3"},
            REG: {b"a": M("a").encode(), b"z": M("z").encode(), b"n": b'{"k":"td"}'},
            WV: b"1",
            D("a"): b"\x00\x01payload\xff",
            D("z"): b"\0\0\0",
        }
        assert r.ttls == {}, "the tmp TTL must not follow the bytes into the entry"

    def test_new_store_without_bump_is_version_0(self, r: LuaRedis, lua_version: str) -> None:
        assert r.run("commit", CK, commit_argv("new", bump="0"), lua_version) == 0
        assert state(r) == {META: {b"lv": b"0", b"fmt": b"1", b"lock": b"0", b"ne": b"0"}}

    def test_new_on_existing_store(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"old"}, wv="4")
        tmp = set_tmp(r, "1", b"new")
        exc = expect_error(
            r, "TDS_EXISTS", "commit", [*CK, tmp, D("a")], commit_argv("new", ops=[put("a", 4, 5)]), lua_version,
            deleted=(tmp,),
        )
        assert exc.message == "TDS_EXISTS a store already exists at td:{s}:meta"

    def test_new_on_existing_store_even_if_locked_or_stale_args(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, lock="1")
        expect_error(r, "TDS_EXISTS", "commit", CK, commit_argv("new", lock="1", wv="99", first="5"), lua_version)

    def test_new_ignores_ARGV7_and_continues_a_leftover_counter(self, r: LuaRedis, lua_version: str) -> None:
        """ARGV[7] is not checked for "new"; a wv key left behind keeps counting up (never repeats)."""
        r.data[WV] = b"5"
        ops = [{"op": "node", "f": "n", "m": "{}"}]
        assert r.run("commit", CK, commit_argv("new", bump="0", ops=ops, wv="3"), lua_version) == 0
        assert wv_of(r) == b"6"
        assert r.commands("GET") == []


class TestCommitFirstVersion:
    """ARGV[8]: the first layout version of a new store (default "0")."""

    @pytest.mark.parametrize("first", ["0", "7", str((2**40 - 1) * 1024)], ids=["zero", "small", "client_max"])
    @pytest.mark.parametrize("bump", ["0", "1"])
    def test_set(self, r: LuaRedis, lua_version: str, first: str, bump: str) -> None:
        result = r.run("commit", CK, commit_argv("new", bump=bump, first=first), lua_version)
        assert result == int(first) + int(bump) and type(result) is int
        assert state(r) == {META: {b"lv": str(result).encode(), b"fmt": b"1", b"lock": b"0", b"ne": b"0"}}

    def test_set_with_ops(self, r: LuaRedis, lua_version: str) -> None:
        tmp = set_tmp(r, "1", b"abc")
        argv = commit_argv("new", ops=[put("a", 4, 5)], meta={"bs": "[3]"}, first="123456")
        assert r.run("commit", [*CK, tmp, D("a")], argv, lua_version) == 123457
        assert state(r) == {
            META: {b"lv": b"123457", b"fmt": b"1", b"lock": b"0", b"bs": b"[3]", b"ne": b"1"},
            REG: {b"a": M("a").encode()},
            WV: b"1",
            D("a"): b"abc",
        }
        # the store then takes the version it returned
        assert r.run("commit", CK, commit_argv("123457", bump="0", meta={"x": "1"}), lua_version) == 123457

    @pytest.mark.parametrize("bump", ["0", "1"])
    def test_default(self, r: LuaRedis, lua_version: str, bump: str) -> None:
        argv = commit_argv("new", bump=bump)
        assert len(argv) == 7, "ARGV[8] left out"
        assert r.run("commit", CK, argv, lua_version) == int(bump)
        assert r.data[META][b"lv"] == bump.encode()

    @pytest.mark.parametrize("first", ["-1", "1.5", "-0.5", "x", "", "nan", "1 2"])
    def test_invalid(self, r: LuaRedis, lua_version: str, first: str) -> None:
        tmp = set_tmp(r, "1", b"abc")
        argv = commit_argv("new", ops=[put("a", 4, 5)], first=first)
        exc = expect_error(r, "TDS_BADARG", "commit", [*CK, tmp, D("a")], argv, lua_version, deleted=(tmp,))
        assert exc.message == "TDS_BADARG the first layout version must be a non-negative integer"
        assert META not in r.data

    def test_invalid_is_reported_before_exists(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r)
        tmp = set_tmp(r, "1", b"abc")
        argv = commit_argv("new", ops=[put("a", 4, 5)], first="-3")
        expect_error(r, "TDS_BADARG", "commit", [*CK, tmp, D("a")], argv, lua_version, deleted=(tmp,))

    @pytest.mark.parametrize("first", ["x", "-1", "", "9"])
    def test_ignored_unless_new(self, r: LuaRedis, lua_version: str, first: str) -> None:
        make_store(r)
        assert r.run("commit", CK, commit_argv("2", first=first), lua_version) == 3
        assert r.run("commit", CK, commit_argv("", bump="0", first=first), lua_version) == 3

    @pytest.mark.parametrize(
        "lua_version,first",
        [
            pytest.param(v, f)
            for v in LUA_VERSIONS
            for f in ["007", "1e3", "0x10", " 5", "5 ", "5.0", "+5", "-0"] + (["inf"] if v == "5.1" else [])
        ]
        + [pytest.param("5.4", "inf")],
    )
    def test_non_canonical_integer_is_refused(self, r: LuaRedis, lua_version: str, first: str) -> None:
        """Only a canonical decimal can become the lv field: check_layout compares strings."""
        tmp = set_tmp(r, "1", b"abc")
        argv = commit_argv("new", ops=[put("a", 4, 5)], first=first)
        expect_error(r, "TDS_BADARG", "commit", [*CK, tmp, D("a")], argv, lua_version, deleted=(tmp,))


class TestCommitPut:
    def test_put_replaces_an_entry(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"old bytes", "b": b"bbb"})
        r.ttls[D("a")] = 5000  # even a TTL on the old entry must not survive
        tmp = set_tmp(r, "1", b"new")
        m = M("a", shape=[3])
        result = r.run("commit", [*CK, tmp, D("a")], commit_argv(ops=[put("a", 4, 5, m)]), lua_version)
        assert result == 3
        assert state(r) == {
            META: meta_at(3),
            REG: {b"a": m.encode(), b"b": M("b").encode()},
            WV: b"1",
            D("a"): b"new",
            D("b"): b"bbb",
        }
        assert r.ttls == {}
        assert r.commands("RENAME") == [(tmp, D("a"))]
        assert r.commands("PERSIST") == [(D("a"),)]

    def test_several_puts_and_binary_field_names(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r)
        t1, t2 = set_tmp(r, "1", b"x" * 1000), set_tmp(r, "2", bytes(range(256)))
        f2 = "d%2Ee.\u00e9"
        keys = [*CK, t1, D("a"), t2, D(f2)]
        assert r.run("commit", keys, commit_argv(bump="0", ops=[put("a", 4, 5), put(f2, 6, 7)]), lua_version) == 2
        assert r.data[D("a")] == b"x" * 1000
        assert r.data[D(f2)] == bytes(range(256))
        assert r.data[REG] == {b"a": M("a").encode(), f2.encode(): M(f2).encode()}
        assert t1 not in r.data and t2 not in r.data and r.ttls == {}

    def test_indices_as_json_numbers(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r)
        tmp = set_tmp(r, "1", b"abc")
        op = {"op": "put", "f": "a", "m": M("a"), "src": 4, "dst": 5}
        assert r.run("commit", [*CK, tmp, D("a")], commit_argv(ops=[op]), lua_version) == 3
        assert r.data[D("a")] == b"abc"

    def test_missing_tmp_is_partial_and_drops_every_tmp(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"old", "m": b"moved"}, wv="3")
        t1 = set_tmp(r, "1", b"new a")
        missing = TMP("2")  # its SET was refused
        t3 = set_tmp(r, "3", b"new c")
        keys = [*CK, t1, D("a"), missing, D("b"), t3, D("c"), D("m"), D("m2")]
        ops = [
            put("a", 4, 5),
            put("b", 6, 7),
            put("c", 8, 9),
            {"op": "move", "f": "m", "t": "m2", "m": M("m2"), "src": "10", "dst": "11"},
        ]
        exc = expect_error(r, "TDS_PARTIAL", "commit", keys, commit_argv(ops=ops), lua_version, deleted=(t1, t3))
        assert exc.message == "TDS_PARTIAL the bytes of b did not reach the server"
        assert D("m") in r.data, "only the tmp keys of put ops may be deleted"
        assert wv_of(r) == b"3"


def C(k: int, path: str) -> bytes:
    """The key of chunk ``k`` of a chunked entry."""
    return b"td:{s}:c:" + str(k).encode() + b":" + path.encode()


class TestCommitRuns:
    """"r": one op over a run of keys (the chunks of an entry); the registry changes once."""

    def test_put_renames_every_chunk(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r)
        tmps = [set_tmp(r, str(i), b"%d" % i * 3) for i in range(3)]
        keys = [*CK, *tmps, C(0, "a"), C(1, "a"), C(2, "a")]
        op = {**put("a", 4, 7), "r": "3"}
        assert r.run("commit", keys, commit_argv(ops=[op]), lua_version) == 3
        assert [r.data[C(k, "a")] for k in range(3)] == [b"000", b"111", b"222"]
        assert r.data[REG] == {b"a": M("a").encode()} and not any(t in r.data for t in tmps)
        assert r.commands("RENAME") == [(tmps[i], C(i, "a")) for i in range(3)]

    def test_a_missing_chunk_refuses_the_whole_put(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r)
        tmps = [set_tmp(r, "0", b"a"), TMP("gone"), set_tmp(r, "2", b"c")]
        keys = [*CK, *tmps, C(0, "a"), C(1, "a"), C(2, "a")]
        exc = expect_error(r, "TDS_PARTIAL", "commit", keys, commit_argv(ops=[{**put("a", 4, 7), "r": "3"}]), lua_version, deleted=(tmps[0], tmps[2]))
        assert "did not reach the server" in exc.message

    def test_del_and_move_runs(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"b": b"x"})
        for k in range(2):
            r.data[C(k, "a")] = b"%d" % k
        r.data[REG][b"a"] = M("a").encode()
        keys = [*CK, C(0, "a"), C(1, "a"), C(0, "z"), C(1, "z")]
        ops = [{"op": "move", "f": "a", "t": "z", "m": M("z"), "src": "4", "dst": "6", "r": "2"}]
        assert r.run("commit", keys, commit_argv(ops=ops), lua_version) == 3
        assert (r.data[C(0, "z")], r.data[C(1, "z")]) == (b"0", b"1") and C(0, "a") not in r.data
        ops = [{"op": "del", "f": "z", "dst": "4", "r": "2"}]
        assert r.run("commit", [*CK, C(0, "z"), C(1, "z")], commit_argv("3", ops=ops), lua_version) == 4
        assert C(0, "z") not in r.data and C(1, "z") not in r.data and r.data[REG] == {b"b": M("b").encode()}

    @pytest.mark.parametrize("run", ["0", "-1", "1.5", "x", "4"], ids=["zero", "negative", "fraction", "text", "past_keys"])
    def test_bad_run(self, r: LuaRedis, lua_version: str, run: str) -> None:
        make_store(r)
        tmps = [set_tmp(r, "0", b"a"), set_tmp(r, "1", b"b")]
        keys = [*CK, *tmps, C(0, "a"), C(1, "a")]
        argv = commit_argv(ops=[{**put("a", 4, 6), "r": run}])
        if run == "4":  # the src run fits in KEYS (its tmp keys are dropped), the dst run does not
            expect_error(r, "TDS_BADARG", "commit", keys, argv, lua_version, deleted=tuple(tmps))
            return
        # a malformed run names no key for sure: its tmp keys stay until their TTL ends
        expect_error(r, "TDS_BADARG", "commit", keys, argv, lua_version)
        assert all(r.ttls[t] == 60000 for t in tmps)

    def test_run_on_an_op_without_keys(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r)
        exc = expect_error(r, "TDS_BADARG", "commit", CK, commit_argv(ops=[{"op": "node", "f": "n", "m": M("n"), "r": "2"}]), lua_version)
        assert "bad run of keys r" in exc.message


class TestCommitZero:
    @pytest.mark.parametrize("n", [0, 1, 5, 4096])
    @pytest.mark.parametrize("as_number", [False, True], ids=["n_str", "n_num"])
    def test_zero_filled_entry(self, r: LuaRedis, lua_version: str, n: int, as_number: bool) -> None:
        make_store(r, entries={"a": b"previous content that is longer"})
        r.ttls[D("a")] = 1000
        result = r.run("commit", [*CK, D("a")], commit_argv(ops=[zero("a", 4, n if as_number else str(n))]), lua_version)
        assert result == 3
        assert r.data[D("a")] == b"\0" * n
        assert r.ttls == {}
        assert r.data[REG] == {b"a": M("a").encode()}
        if n:
            assert r.commands("SETRANGE") == [(D("a"), str(n - 1).encode(), b"\0")]
        else:
            assert r.commands("SETRANGE") == []

    def test_zero_of_a_huge_entry_formats_the_offset_as_an_integer(self, lua_version: str) -> None:
        r = LuaRedis(proto_max_bulk_len=1 << 40, virtual_above=1 << 20)
        make_store(r)
        n = 3_000_000_001
        r.run("commit", [*CK, D("big")], commit_argv(ops=[zero("big", 4, n)]), lua_version)
        assert r.commands("SETRANGE") == [(D("big"), b"3000000000", b"\0")]
        assert r.data[D("big")] == VirtualString(n, [(3_000_000_000, b"\0")])


class TestCommitEntryCount:
    """Meta field "ne": the number of registry fields, kept by every op that adds or removes one."""

    def _with_count(self, r: LuaRedis, **kw: Any) -> None:
        make_store(r, **kw)
        r.data[META][b"ne"] = str(len(r.data.get(REG, {}))).encode()

    def test_ops_keep_the_count(self, r: LuaRedis, lua_version: str) -> None:
        self._with_count(r, entries={"a": b"aaa", "b": b"bbb"}, nodes=("n",))
        assert r.data[META][b"ne"] == b"3"
        tmp = set_tmp(r, "1", b"new")
        ops = [
            {"op": "del", "f": "a", "dst": "4"},  # -1
            put("b", 6, 5),  # replaces an existing field: 0
            zero("z", 7, "2"),  # +1
            {"op": "move", "f": "z", "t": "y", "m": M("y"), "src": "7", "dst": "8"},  # 0
            {"op": "del", "f": "nope"},  # not registered: 0
        ]
        r.run("commit", [*CK, D("a"), D("b"), tmp, D("z"), D("y")], commit_argv(ops=ops), lua_version)
        assert set(r.data[REG]) == {b"b", b"y", b"n"}
        assert r.data[META][b"ne"] == str(len(r.data[REG])).encode() == b"3"

    def test_deleting_every_entry_counts_zero(self, r: LuaRedis, lua_version: str) -> None:
        self._with_count(r, entries={"a": b"aaa"})
        r.run("commit", [*CK, D("a")], commit_argv(ops=[{"op": "del", "f": "a", "dst": "4"}]), lua_version)
        assert REG not in r.data and r.data[META][b"ne"] == b"0"

    def test_a_store_without_the_count_gets_none(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa"})
        r.run("commit", [*CK, D("z")], commit_argv(ops=[zero("z", 4, "2")]), lua_version)
        assert b"ne" not in r.data[META]

    def test_the_count_cannot_be_set_as_metadata(self, r: LuaRedis, lua_version: str) -> None:
        self._with_count(r, entries={"a": b"aaa"})
        expect_error(r, "TDS_BADARG", "commit", CK, commit_argv(meta={"ne": "0"}), lua_version)
        assert r.data[META][b"ne"] == b"1"


class TestCommitDelNodeMove:
    def test_del_with_and_without_data_key(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa", "b": b"bbb"}, nodes=("n",))
        ops = [{"op": "del", "f": "a", "dst": "4"}, {"op": "del", "f": "n"}]
        assert r.run("commit", [*CK, D("a")], commit_argv(ops=ops), lua_version) == 3
        assert state(r) == {
            META: meta_at(3),
            REG: {b"b": M("b").encode()},
            WV: b"1",
            D("b"): b"bbb",
        }

    def test_del_of_the_last_entry_removes_the_registry(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa"})
        assert r.run("commit", [*CK, D("a")], commit_argv(ops=[{"op": "del", "f": "a", "dst": "4"}]), lua_version) == 3
        assert state(r) == {META: meta_at(3), WV: b"1"}

    def test_node(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa"})
        m = '{"k":"td","bs":[4]}'
        assert r.run("commit", CK, commit_argv(bump="0", ops=[{"op": "node", "f": "n", "m": m}]), lua_version) == 2
        assert state(r) == {
            META: META2,
            REG: {b"a": M("a").encode(), b"n": m.encode()},
            WV: b"1",
            D("a"): b"aaa",
        }

    def test_move_renames_bytes_and_registry(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa", "b": b"bbb"})
        op = {"op": "move", "f": "a", "t": "c", "m": M("c"), "src": "4", "dst": "5"}
        assert r.run("commit", [*CK, D("a"), D("c")], commit_argv(ops=[op]), lua_version) == 3
        assert state(r) == {
            META: meta_at(3),
            REG: {b"b": M("b").encode(), b"c": M("c").encode()},
            WV: b"1",
            D("b"): b"bbb",
            D("c"): b"aaa",
        }

    def test_move_without_bytes_moves_the_registry_only(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, nodes=("n",))
        op = {"op": "move", "f": "n", "t": "n2", "m": '{"k":"td"}', "src": "4", "dst": "5"}
        assert r.run("commit", [*CK, D("n"), D("n2")], commit_argv(ops=[op]), lua_version) == 3
        assert state(r) == {META: meta_at(3), REG: {b"n2": b'{"k":"td"}'}, WV: b"1"}

    def test_ops_apply_in_order(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa"})
        tmp = set_tmp(r, "1", b"fresh")
        ops = [
            {"op": "move", "f": "a", "t": "b", "m": M("b"), "src": "4", "dst": "5"},
            put("a", 6, 4),
            {"op": "del", "f": "b", "dst": "5"},
        ]
        assert r.run("commit", [*CK, D("a"), D("b"), tmp], commit_argv(ops=ops), lua_version) == 3
        assert state(r) == {META: meta_at(3), REG: {b"a": M("a").encode()}, WV: b"1", D("a"): b"fresh"}


class TestCommitMetaAndVersion:
    def test_meta_updates_only(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa"})
        meta = {"bs": "[2,3]", "names": '["x", null]', "dev": "caf\u00e9"}
        assert r.run("commit", CK, commit_argv(bump="0", meta=meta), lua_version) == 2
        assert r.data[META] == {
            b"lv": b"2", b"fmt": b"1", b"lock": b"0", b"bs": b"[2,3]", b"names": b'["x", null]', b"dev": "caf\u00e9".encode()
        }
        assert r.data[REG] == {b"a": M("a").encode()} and r.data[D("a")] == b"aaa"
        assert WV not in r.data, "a commit without ops writes no entry: wv stays"

    @pytest.mark.parametrize("field", ["lv", "fmt"])
    @pytest.mark.parametrize("expected", ["2", "", "new"])
    def test_meta_update_of_lv_or_fmt_is_refused(self, r: LuaRedis, lua_version: str, field: str, expected: str) -> None:
        """lv and fmt belong to the scripts: a meta update setting one refuses the whole commit."""
        if expected != "new":
            make_store(r, entries={"a": b"aaa"})
        tmp = set_tmp(r, "1", b"new")
        argv = commit_argv(expected, meta={"bs": "[5]", field: "9"}, ops=[put("a", 4, 5)])
        exc = expect_error(r, "TDS_BADARG", "commit", [*CK, tmp, D("a")], argv, lua_version, deleted=(tmp,))
        assert exc.message == f"TDS_BADARG meta field {field} cannot be set"
        assert r.commands("HSET") == [] and r.commands("INCR") == [] and r.commands("HINCRBY") == []

    @pytest.mark.parametrize("value", ["2", "", 3], ids=["same_value", "empty", "number"])
    def test_meta_update_of_lv_is_refused_whatever_the_value(self, r: LuaRedis, lua_version: str, value: Any) -> None:
        make_store(r)
        exc = expect_error(r, "TDS_BADARG", "commit", CK, commit_argv(bump="0", meta={"lv": value}), lua_version)
        assert exc.message == "TDS_BADARG meta field lv cannot be set"

    def test_reserved_meta_field_is_reported_before_missing_store(self, r: LuaRedis, lua_version: str) -> None:
        expect_error(r, "TDS_BADARG", "commit", CK, commit_argv(meta={"fmt": "2"}), lua_version)

    def test_wv_and_cursor_are_ordinary_meta_fields(self, r: LuaRedis, lua_version: str) -> None:
        """The counters live in their own keys: meta fields of the same names do not touch them."""
        make_store(r, wv="4", cursor=9)
        assert r.run("commit", CK, commit_argv(bump="0", meta={"wv": "x", "cursor": "7"}, wv="4"), lua_version) == 2
        assert r.data[META] == {**META2, b"wv": b"x", b"cursor": b"7"}
        assert r.data[WV] == b"4" and r.data[RING] == b"9"

    @pytest.mark.parametrize("meta", ['{"bs": 4}', '{"bs": ["x"]}', '{"bs": true}', '[1]'], ids=["number", "list", "bool", "array"])
    def test_meta_values_must_be_strings(self, r: LuaRedis, lua_version: str, meta: str) -> None:
        make_store(r)
        tmp = set_tmp(r, "1", b"new")
        argv = commit_argv(ops=[put("a", 4, 5)])
        argv[3] = meta
        exc = expect_error(r, "TDS_BADARG", "commit", [*CK, tmp, D("a")], argv, lua_version, deleted=(tmp,))
        assert exc.message == "TDS_BADARG meta updates must map strings to strings"

    def test_data_only_commit_leaves_the_meta_hash_alone(self, r: LuaRedis, lua_version: str) -> None:
        """Without a bump or meta updates, a commit writes no field of the meta hash."""
        make_store(r, entries={"a": b"aaa"}, wv="6")
        tmp = set_tmp(r, "1", b"new")
        assert r.run("commit", [*CK, tmp, D("a")], commit_argv("2", bump="0", ops=[put("a", 4, 5)], wv="6"), lua_version) == 2
        assert r.data[META] == META2 and r.data[WV] == b"7"
        assert {c[0] for c in r.commands("HSET")} == {REG} and r.commands("HINCRBY") == []

    def test_empty_commit(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa"})
        before = r.snapshot()
        assert r.run("commit", CK, commit_argv(bump="0"), lua_version) == 2
        assert r.snapshot() == before

    @pytest.mark.parametrize("lv", [0, 2, 41, 2**40])
    def test_bump_returns_the_new_version(self, r: LuaRedis, lua_version: str, lv: int) -> None:
        make_store(r, lv=lv)
        assert r.run("commit", CK, commit_argv(str(lv)), lua_version) == lv + 1
        assert r.data[META][b"lv"] == str(lv + 1).encode()
        assert r.run("commit", CK, commit_argv(str(lv + 1), bump="0"), lua_version) == lv + 1
        assert r.data[META][b"lv"] == str(lv + 1).encode()

    def test_empty_expected_version_skips_the_check(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, lv=7)
        assert r.run("commit", CK, commit_argv(""), lua_version) == 8

    def test_stale_version(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, lv=3, entries={"a": b"aaa"})
        tmp = set_tmp(r, "1", b"new")
        exc = expect_error(
            r, "TDS_STALE", "commit", [*CK, tmp, D("a")], commit_argv("2", ops=[put("a", 4, 5)]), lua_version,
            deleted=(tmp,),
        )
        assert exc.message == "TDS_STALE layout version is 3, client assumed 2"

    @pytest.mark.parametrize("expected", ["2", ""])
    def test_missing_store(self, r: LuaRedis, lua_version: str, expected: str) -> None:
        r.data[WV] = b"3"  # a counter without a store does not make one
        tmp = set_tmp(r, "1", b"new")
        exc = expect_error(
            r, "TDS_NOSTORE", "commit", [*CK, tmp, D("a")], commit_argv(expected, ops=[put("a", 4, 5)]),
            lua_version, deleted=(tmp,),
        )
        assert exc.message == "TDS_NOSTORE no store at td:{s}:meta"


class TestCommitLock:
    def test_locked_store_refuses_when_asked(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, lock="1", entries={"a": b"aaa"})
        tmp = set_tmp(r, "1", b"new")
        exc = expect_error(
            r, "TDS_LOCKED", "commit", [*CK, tmp, D("a")], commit_argv(lock="1", ops=[put("a", 4, 5)]),
            lua_version, deleted=(tmp,),
        )
        assert exc.message == "TDS_LOCKED the store at td:{s}:meta is locked"

    def test_locked_store_accepts_without_the_check(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, lock="1")
        assert r.run("commit", CK, commit_argv(lock="0", meta={"lock": "0"}), lua_version) == 3
        assert r.data[META][b"lock"] == b"0"

    @pytest.mark.parametrize("lock", ["0", "", "yes"])
    def test_unlocked_store_accepts_the_check(self, r: LuaRedis, lua_version: str, lock: str) -> None:
        make_store(r, lock=lock)
        assert r.run("commit", CK, commit_argv(lock="1"), lua_version) == 3

    def test_lock_check_skipped_for_other_flag_values(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, lock="1")
        assert r.run("commit", CK, commit_argv(lock="true"), lua_version) == 3

    def test_stale_is_reported_before_locked(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, lv=3, lock="1")
        expect_error(r, "TDS_STALE", "commit", CK, commit_argv("2", lock="1"), lua_version)


# each used as the third op of [put("a", 4, 5), del a, <bad>] with KEYS = [META, REG, WV, tmp, D("a")]
_BAD_OPS = {
    "unknown_kind": {"op": "copy", "f": "a", "src": "4", "dst": "5"},
    "no_kind": {"f": "a"},
    "no_field": {"op": "node", "m": "{}"},
    "numeric_field": {"op": "node", "f": 5, "m": "{}"},
    "put_no_src": {"op": "put", "f": "a", "m": "{}", "dst": "5"},
    "put_no_dst": {"op": "put", "f": "a", "m": "{}", "src": "4"},
    "put_src_is_meta": {"op": "put", "f": "a", "m": "{}", "src": "1", "dst": "5"},
    "put_src_is_registry": {"op": "put", "f": "a", "m": "{}", "src": "2", "dst": "5"},
    "put_src_is_wv": {"op": "put", "f": "a", "m": "{}", "src": "3", "dst": "5"},
    "put_dst_is_wv": {"op": "put", "f": "a", "m": "{}", "src": "4", "dst": "3"},
    "put_dst_out_of_range": {"op": "put", "f": "a", "m": "{}", "src": "4", "dst": "9"},
    "put_src_not_a_number": {"op": "put", "f": "a", "m": "{}", "src": "x", "dst": "5"},
    "move_no_dst": {"op": "move", "f": "a", "t": "b", "m": "{}", "src": "5"},
    "move_no_src": {"op": "move", "f": "a", "t": "b", "m": "{}", "dst": "5"},
    "move_src_is_wv": {"op": "move", "f": "a", "t": "b", "m": "{}", "src": "3", "dst": "5"},
    "zero_no_n": {"op": "zero", "f": "a", "m": "{}", "dst": "5"},
    "zero_bad_n": {"op": "zero", "f": "a", "m": "{}", "dst": "5", "n": "many"},
    "zero_no_dst": {"op": "zero", "f": "a", "m": "{}", "n": "3"},
    "zero_dst_is_wv": {"op": "zero", "f": "a", "m": "{}", "dst": "3", "n": "3"},
    "del_dst_is_wv": {"op": "del", "f": "a", "dst": "3"},
    "del_dst_is_registry": {"op": "del", "f": "a", "dst": "2"},
}


class TestCommitBadArg:
    @pytest.mark.parametrize("bad", list(_BAD_OPS), ids=list(_BAD_OPS))
    def test_malformed_op_applies_nothing(self, r: LuaRedis, lua_version: str, bad: str) -> None:
        """A malformed op anywhere refuses the whole commit, before any write."""
        make_store(r, entries={"a": b"aaa"}, wv="2")
        tmp = set_tmp(r, "1", b"new")
        ops = [put("a", 4, 5), {"op": "del", "f": "a", "dst": "5"}, _BAD_OPS[bad]]
        exc = expect_error(r, "TDS_BADARG", "commit", [*CK, tmp, D("a")], commit_argv(ops=ops), lua_version, deleted=(tmp,))
        assert "TDS_BADARG" in exc.message

    def test_badarg_wins_over_missing_store(self, r: LuaRedis, lua_version: str) -> None:
        expect_error(r, "TDS_BADARG", "commit", CK, commit_argv(ops=[_BAD_OPS["unknown_kind"]]), lua_version)

    def test_badarg_message_names_the_op(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r)
        exc = expect_error(r, "TDS_BADARG", "commit", CK, commit_argv(ops=[_BAD_OPS["put_no_src"]]), lua_version)
        assert exc.message.startswith("TDS_BADARG op put needs src and dst keys")

    def test_string_op(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r)
        exc = expect_error(r, "TDS_BADARG", "commit", CK, commit_argv(ops='["put"]'), lua_version)
        assert exc.message == 'TDS_BADARG malformed op: "put"'

    @pytest.mark.parametrize("ops", ["[1]", "[true]"])
    def test_non_object_op(self, r: LuaRedis, lua_version: str, ops: str) -> None:
        make_store(r)
        expect_error(r, "TDS_BADARG", "commit", CK, commit_argv(ops=ops), lua_version)

    @pytest.mark.parametrize(
        "bad",
        [
            {"op": "move", "f": "a", "m": "{}", "src": "4", "dst": "5"},
            {"op": "node", "f": "n"},
            {"op": "zero", "f": "z", "dst": "6", "n": "3"},
        ],
        ids=["move_no_t", "node_no_m", "zero_no_m"],
    )
    def test_op_missing_a_string_field(self, r: LuaRedis, lua_version: str, bad: dict[str, str]) -> None:
        make_store(r, entries={"a": b"aaa"})
        expect_error(r, "TDS_BADARG", "commit", [*CK, D("a"), D("b"), D("z")], commit_argv(ops=[bad]), lua_version)

    @pytest.mark.parametrize("n", ["-1", "2.5"])
    def test_zero_with_a_count_that_is_not_a_byte_count(self, r: LuaRedis, lua_version: str, n: str) -> None:
        make_store(r, entries={"z": b"zzz"})
        expect_error(r, "TDS_BADARG", "commit", [*CK, D("z")], commit_argv(ops=[zero("z", 4, n)]), lua_version)

    def test_del_with_a_dst_out_of_range(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa"})
        ops = [{"op": "del", "f": "a", "dst": "9"}]
        expect_error(r, "TDS_BADARG", "commit", [*CK, D("a")], commit_argv(ops=ops), lua_version)

    def test_old_key_layout_is_refused(self, r: LuaRedis, lua_version: str) -> None:
        """A client still sending tmp and data keys from KEYS[3] cannot make KEYS[3] an entry
        (its tmp key, KEYS[3] there, is not a valid src, so it stays until its TTL ends)."""
        make_store(r, entries={"a": b"aaa"})
        tmp = set_tmp(r, "1", b"new")
        argv = commit_argv(ops=[put("a", 3, 4)])
        exc = expect_error(r, "TDS_BADARG", "commit", [META, REG, tmp, D("a")], argv, lua_version)
        assert exc.message.startswith("TDS_BADARG op put needs src and dst keys")
        assert r.ttls[tmp] == 60000


class TestCommitErrorPrecedence:
    """Every error path deletes the tmp keys of put ops and nothing else."""

    @pytest.mark.parametrize(
        "setup,expected,lock,wv,code",
        [
            ("none", "2", "0", "", "TDS_NOSTORE"),
            ("none", "2", "0", "3", "TDS_NOSTORE"),
            ("store", "new", "0", "", "TDS_EXISTS"),
            ("store", "1", "0", "", "TDS_STALE"),
            ("store", "1", "0", "4", "TDS_STALE"),  # stale before conflict
            ("store", "2", "0", "4", "TDS_CONFLICT"),
            ("locked", "2", "1", "4", "TDS_CONFLICT"),  # conflict before locked
            ("locked", "2", "1", "", "TDS_LOCKED"),
            ("locked", "2", "1", "3", "TDS_LOCKED"),
        ],
    )
    def test_error_drops_put_tmps_only(
        self, r: LuaRedis, lua_version: str, setup: str, expected: str, lock: str, wv: str, code: str
    ) -> None:
        if setup != "none":
            make_store(r, lock="1" if setup == "locked" else "0", entries={"m": b"mmm"}, wv="3", cursor=5)
        t1, t2 = set_tmp(r, "1", b"one"), set_tmp(r, "2", b"two")
        keys = [*CK, t1, D("a"), t2, D("b"), D("m"), D("m2")]
        ops = [
            put("a", 4, 5),
            {"op": "move", "f": "m", "t": "m2", "m": M("m2"), "src": "8", "dst": "9"},
            put("b", 6, 7),
        ]
        argv = commit_argv(expected, lock=lock, ops=ops, wv=wv)
        expect_error(r, code, "commit", keys, argv, lua_version, deleted=(t1, t2))

    def test_badarg_before_conflict(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, wv="3")
        tmp = set_tmp(r, "1", b"new")
        ops = [put("a", 4, 5), _BAD_OPS["unknown_kind"]]
        argv = commit_argv(ops=ops, wv="2")
        expect_error(r, "TDS_BADARG", "commit", [*CK, tmp, D("a")], argv, lua_version, deleted=(tmp,))

    def test_reserved_meta_field_before_conflict_and_lock(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, wv="3", lock="1")
        tmp = set_tmp(r, "1", b"new")
        argv = commit_argv(meta={"lv": "5"}, ops=[put("a", 4, 5)], wv="2", lock="1")
        expect_error(r, "TDS_BADARG", "commit", [*CK, tmp, D("a")], argv, lua_version, deleted=(tmp,))

    def test_conflict_before_partial(self, r: LuaRedis, lua_version: str) -> None:
        """A missing tmp key is not reported when the write version already conflicts."""
        make_store(r, wv="3")
        t1 = set_tmp(r, "1", b"one")
        keys = [*CK, t1, D("a"), TMP("2"), D("b")]
        argv = commit_argv(ops=[put("a", 4, 5), put("b", 6, 7)], wv="2")
        expect_error(r, "TDS_CONFLICT", "commit", keys, argv, lua_version, deleted=(t1,))


class TestCommitWriteVersion:
    """ARGV[7] compares with GET KEYS[3] (missing = "0"); a commit with ops INCRs it once."""

    @pytest.mark.parametrize("stored,sent", [("5", "4"), ("5", "6"), ("5", "0"), ("0", "1"), ("12", "1")])
    def test_conflict(self, r: LuaRedis, lua_version: str, stored: str, sent: str) -> None:
        make_store(r, entries={"a": b"old", "b": b"bbb"}, wv=stored)
        tmp = set_tmp(r, "1", b"new")
        keys = [*CK, tmp, D("a"), D("b")]
        ops = [put("a", 4, 5), {"op": "del", "f": "b", "dst": "6"}]
        exc = expect_error(r, "TDS_CONFLICT", "commit", keys, commit_argv(ops=ops, wv=sent), lua_version, deleted=(tmp,))
        assert exc.message == "TDS_CONFLICT the store was written since the client read it"
        assert r.data[WV] == stored.encode()
        assert r.commands("GET") == [(WV,)]
        assert r.commands("RENAME") == [] and r.commands("INCR") == [] and r.commands("HINCRBY") == []
        assert r.commands("HSET") == []

    @pytest.mark.parametrize("stored", [b"garbage", b"2.5", b"", b"9" * 19, b"\xffabc"])
    @pytest.mark.parametrize("sent", ["", "5"])
    def test_damaged_wv_is_corrupt_and_writes_nothing(self, r: LuaRedis, lua_version: str, stored: bytes, sent: str) -> None:
        """A write version edited to what no write makes: refused before any write (INCR would
        fail after the renames, leaving the commit half applied)."""
        make_store(r, entries={"a": b"old", "b": b"bbb"})
        r.data[WV] = stored
        tmp = set_tmp(r, "1", b"new")
        keys = [*CK, tmp, D("a"), D("b")]
        ops = [put("a", 4, 5), {"op": "del", "f": "b", "dst": "6"}]
        exc = expect_error(r, "TDS_CORRUPT", "commit", keys, commit_argv(ops=ops, wv=sent), lua_version, deleted=(tmp,))
        assert exc.message.startswith("TDS_CORRUPT the write version td:{s}:wv holds")
        assert r.data[WV] == stored and r.commands("GET") == [(WV,)]

    def test_damaged_append_counter_is_corrupt(self, r: LuaRedis, lua_version: str) -> None:
        """An append counter that is not a count, met by a compare-and-set (ARGV[10])."""
        make_store(r, entries={"a": b"old"}, wv="3")
        r.data[b"td:{s}:ac"] = {b"a:": b"2.5x"}
        tmp = set_tmp(r, "1", b"new")
        argv = commit_argv(ops=[put("a", 4, 5)], wv="")
        argv += [""] * (10 - len(argv))
        argv[9] = json.dumps({"w": "3", "f": {}})
        exc = expect_error(r, "TDS_CORRUPT", "commit", [*CK, tmp, D("a")], argv, lua_version, deleted=(tmp,))
        assert "append counter" in exc.message and "td:{s}:ac" in exc.message

    def test_conflict_without_ops(self, r: LuaRedis, lua_version: str) -> None:
        """The check does not depend on the commit writing anything."""
        make_store(r, wv="2")
        expect_error(r, "TDS_CONFLICT", "commit", CK, commit_argv(bump="0", meta={"x": "1"}, wv="1"), lua_version)

    def test_missing_wv_reads_as_zero(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"old"})
        assert WV not in r.data
        tmp = set_tmp(r, "1", b"new")
        keys = [*CK, tmp, D("a")]
        for sent in ("1", "00", " 0"):  # the comparison is of strings: only "0" matches
            expect_error(r, "TDS_CONFLICT", "commit", keys, commit_argv(ops=[put("a", 4, 5)], wv=sent), lua_version, deleted=(tmp,))
            tmp = set_tmp(r, "1", b"new")
        assert r.run("commit", keys, commit_argv(ops=[put("a", 4, 5)], wv="0"), lua_version) == 3
        assert r.data[META] == meta_at(3), "the write version is not a field of the meta hash"
        assert r.data[WV] == b"1"
        assert r.data[D("a")] == b"new" and tmp not in r.data

    @pytest.mark.parametrize("stored", [None, "0", "7"])
    def test_matching_wv_commits_and_bumps_it(self, r: LuaRedis, lua_version: str, stored: str | None) -> None:
        make_store(r, entries={"a": b"old"}, wv=stored)
        tmp = set_tmp(r, "1", b"new")
        sent = stored or "0"
        assert r.run("commit", [*CK, tmp, D("a")], commit_argv(ops=[put("a", 4, 5)], wv=sent), lua_version) == 3
        assert r.data[WV] == str(int(sent) + 1).encode()
        assert r.data[D("a")] == b"new"

    @pytest.mark.parametrize("stored", [None, "0", "7", "garbage"])
    def test_empty_wv_skips_the_check(self, r: LuaRedis, lua_version: str, stored: str | None) -> None:
        make_store(r, wv=stored)
        assert r.run("commit", CK, commit_argv(bump="0", meta={"x": "1"}, wv=""), lua_version) == 2
        assert wv_of(r) == (None if stored is None else stored.encode())
        assert r.data[META][b"x"] == b"1"
        assert r.commands("GET") == [], "the wv key is not even read"

    def test_wv_ttl_survives_the_bump(self, r: LuaRedis, lua_version: str) -> None:
        """INCR keeps the key's TTL (the scripts never set one; they must not clear one either)."""
        make_store(r, wv="3")
        r.ttls[WV] = 9000
        r.run("commit", CK, commit_argv(bump="0", ops=[{"op": "node", "f": "n", "m": "{}"}], wv="3"), lua_version)
        assert r.data[WV] == b"4" and r.ttls == {WV: 9000}

    @pytest.mark.parametrize("nops", [1, 2, 5])
    @pytest.mark.parametrize("bump", ["0", "1"])
    def test_commit_with_ops_bumps_wv_exactly_once(self, r: LuaRedis, lua_version: str, nops: int, bump: str) -> None:
        make_store(r, wv="41")
        ops = [{"op": "node", "f": f"n{i}", "m": '{"k":"td"}'} for i in range(nops)]
        before = r.snapshot()
        lv = r.run("commit", CK, commit_argv(bump=bump, ops=ops, meta={"y": "2"}, wv="41"), lua_version)
        assert lv == (3 if bump == "1" else 2)
        assert r.commands("INCR") == [(WV,)]
        assert r.commands("HINCRBY") == ([(META, b"lv", b"1")] if bump == "1" else [])
        expected, _ = wv_bumped(before)
        assert expected[WV] == b"42"
        expected[META][b"y"] = b"2"
        expected[META][b"lv"] = str(lv).encode()
        expected[REG] = {f"n{i}".encode(): b'{"k":"td"}' for i in range(nops)}
        assert r.data == expected

    @pytest.mark.parametrize("meta", [None, {"bs": "[5]"}], ids=["empty", "meta_only"])
    @pytest.mark.parametrize("bump", ["0", "1"])
    def test_commit_without_ops_keeps_wv(self, r: LuaRedis, lua_version: str, meta: Any, bump: str) -> None:
        make_store(r, entries={"a": b"aaa"}, wv="9")
        r.run("commit", CK, commit_argv(bump=bump, meta=meta, ops=[], wv="9"), lua_version)
        assert wv_of(r) == b"9"
        assert r.commands("INCR") == []

    def test_new_store(self, r: LuaRedis, lua_version: str) -> None:
        r.run("commit", CK, commit_argv("new", ops=[{"op": "node", "f": "n", "m": "{}"}]), lua_version)
        assert wv_of(r) == b"1"
        assert b"wv" not in r.data[META]
        other = LuaRedis()
        other.run("commit", CK, commit_argv("new", meta={"bs": "[]"}), lua_version)
        assert WV not in other.data and b"wv" not in other.data[META]

    def test_read_modify_write_sequence(self, r: LuaRedis, lua_version: str) -> None:
        """Two clients read wv 0; the first to commit wins, the second conflicts and retries."""
        make_store(r, entries={"a": b"aaaa"})
        seen = (r.data.get(WV) or b"0").decode()
        first = set_tmp(r, "1", b"AAAA")
        assert r.run("commit", [*CK, first, D("a")], commit_argv(bump="0", ops=[put("a", 4, 5)], wv=seen), lua_version) == 2
        second = set_tmp(r, "2", b"BBBB")
        keys = [*CK, second, D("a")]
        expect_error(r, "TDS_CONFLICT", "commit", keys, commit_argv(bump="0", ops=[put("a", 4, 5)], wv=seen), lua_version, deleted=(second,))
        assert r.data[D("a")] == b"AAAA"
        seen = r.data[WV].decode()
        assert seen == "1"
        second = set_tmp(r, "2", b"BBBB")
        assert r.run("commit", keys, commit_argv(bump="0", ops=[put("a", 4, 5)], wv=seen), lua_version) == 2
        assert r.data[D("a")] == b"BBBB" and wv_of(r) == b"2"

    def test_write_runs_invalidate_a_snapshot(self, r: LuaRedis, lua_version: str) -> None:
        # (an append bumps the write version in its MULTI, not in a script: tdstore/_backend/append.py)
        make_store(r, entries={"a": b"\0" * 8}, wv="4")
        node = [{"op": "node", "f": "n", "m": "{}"}]
        r.run("write_runs", [META, WV, D("a")], runs_argv("2", ([(0, 1)], b"x")), lua_version)
        assert wv_of(r) == b"5"
        expect_error(r, "TDS_CONFLICT", "commit", CK, commit_argv(ops=node, wv="4"), lua_version)
        assert r.run("commit", CK, commit_argv(bump="0", ops=node, wv="5"), lua_version) == 2
        assert wv_of(r) == b"6"
        assert r.data[META] == META2, "none of these writes changed the layout"


# =========================================================================== #
# write_runs
# =========================================================================== #


def runs_argv(expected: str, *groups: tuple[list[tuple[int, int]], bytes]) -> list[Any]:
    argv: list[Any] = [expected]
    for runs, payload in groups:
        argv.append(str(len(runs)))
        for offset, length in runs:
            argv += [str(offset), str(length)]
        argv.append(payload)
    return argv


@pytest.fixture
def wstore(r: LuaRedis) -> LuaRedis:
    make_store(r, entries={"a": b"0123456789", "b": b"abcdefghij", "e": b""})
    return r


class TestWriteRuns:
    def test_single_run(self, wstore: LuaRedis, lua_version: str) -> None:
        r = wstore
        assert r.run("write_runs", [META, WV, D("a")], runs_argv("2", ([(3, 2)], b"XY")), lua_version) == 1
        assert r.data[D("a")] == b"012XY56789"
        assert r.commands("SETRANGE") == [(D("a"), b"3", b"XY")]
        assert state(r)[D("b")] == b"abcdefghij"

    def test_many_runs_in_several_entries(self, wstore: LuaRedis, lua_version: str) -> None:
        r = wstore
        before = copy.deepcopy(state(r))
        argv = runs_argv("2", ([(0, 1), (4, 2), (9, 1)], b"ABCD"), ([(1, 3), (8, 2)], b"XYZuv"))
        assert r.run("write_runs", [META, WV, D("a"), D("b")], argv, lua_version) == 5
        before[D("a")], before[D("b")] = b"A123BC678D", b"aXYZefghuv"
        before[WV] = b"1"
        assert state(r) == before
        assert r.ttls == {}

    def test_overlapping_runs_last_wins(self, wstore: LuaRedis, lua_version: str) -> None:
        r = wstore
        assert r.run("write_runs", [META, WV, D("a")], runs_argv("2", ([(2, 4), (4, 3), (3, 1)], b"AAAABBBC")), lua_version) == 3
        assert r.data[D("a")] == b"01ACBBB789"

    def test_run_covering_the_whole_entry(self, wstore: LuaRedis, lua_version: str) -> None:
        r = wstore
        assert r.run("write_runs", [META, WV, D("a")], runs_argv("2", ([(0, 10)], bytes(range(246, 256)))), lua_version) == 1
        assert r.data[D("a")] == bytes(range(246, 256))

    def test_zero_groups(self, wstore: LuaRedis, lua_version: str) -> None:
        r = wstore
        before = r.snapshot()
        assert r.run("write_runs", [META, WV], ["2"], lua_version) == 0
        assert r.snapshot() == wv_bumped(before), "a write of nothing changes nothing but wv"

    def test_group_with_zero_runs(self, wstore: LuaRedis, lua_version: str) -> None:
        r = wstore
        before = r.snapshot()
        assert r.run("write_runs", [META, WV, D("a"), D("e")], runs_argv("2", ([], b""), ([], b"")), lua_version) == 0
        assert r.snapshot() == wv_bumped(before)
        assert r.commands("SETRANGE") == []

    @pytest.mark.parametrize("runs", [[(3, 0)], [(10, 0)], [(0, 0), (10, 0)]], ids=["inside", "at_end", "two"])
    def test_runs_of_length_zero_write_nothing(self, wstore: LuaRedis, lua_version: str, runs: list[tuple[int, int]]) -> None:
        r = wstore
        before = r.snapshot()
        assert r.run("write_runs", [META, WV, D("a")], runs_argv("2", (runs, b"")), lua_version) == len(runs)
        assert r.snapshot() == wv_bumped(before)

    def test_zero_length_run_among_others(self, wstore: LuaRedis, lua_version: str) -> None:
        r = wstore
        assert r.run("write_runs", [META, WV, D("a")], runs_argv("2", ([(0, 2), (5, 0), (8, 2)], b"ABCD")), lua_version) == 3
        assert r.data[D("a")] == b"AB234567CD"

    def test_run_ending_exactly_at_the_end(self, wstore: LuaRedis, lua_version: str) -> None:
        r = wstore
        assert r.run("write_runs", [META, WV, D("a")], runs_argv("2", ([(8, 2)], b"YZ")), lua_version) == 1
        assert r.data[D("a")] == b"01234567YZ"

    @pytest.mark.parametrize("run", [(9, 2), (10, 1), (11, 0), (0, 11), (3_000_000_000, 1)])
    def test_run_past_the_end(self, wstore: LuaRedis, lua_version: str, run: tuple[int, int]) -> None:
        r = wstore
        payload = b"x" * run[1]
        exc = expect_error(r, "TDS_RANGE", "write_runs", [META, WV, D("a")], runs_argv("2", ([run], payload)), lua_version)
        assert exc.message == f"TDS_RANGE run {run[0]}+{run[1]} past the end (10) of td:{{s}}:d:a"

    def test_empty_entry_accepts_no_bytes(self, wstore: LuaRedis, lua_version: str) -> None:
        r = wstore
        assert r.run("write_runs", [META, WV, D("e")], runs_argv("2", ([(0, 0)], b"")), lua_version) == 1
        assert r.data[D("e")] == b""
        expect_error(r, "TDS_RANGE", "write_runs", [META, WV, D("e")], runs_argv("2", ([(0, 1)], b"x")), lua_version)

    def test_missing_data_key(self, wstore: LuaRedis, lua_version: str) -> None:
        r = wstore
        exc = expect_error(r, "TDS_NOENTRY", "write_runs", [META, WV, D("nope")], runs_argv("2", ([(0, 1)], b"x")), lua_version)
        assert exc.message == "TDS_NOENTRY no data at td:{s}:d:nope"

    def test_missing_data_key_even_without_runs(self, wstore: LuaRedis, lua_version: str) -> None:
        expect_error(wstore, "TDS_NOENTRY", "write_runs", [META, WV, D("nope")], runs_argv("2", ([], b"")), lua_version)

    @pytest.mark.parametrize("payload", [b"", b"X", b"XYZ"], ids=["empty", "short", "long"])
    def test_payload_size_mismatch(self, wstore: LuaRedis, lua_version: str, payload: bytes) -> None:
        r = wstore
        exc = expect_error(r, "TDS_BADARG", "write_runs", [META, WV, D("a")], runs_argv("2", ([(3, 2)], payload)), lua_version)
        assert exc.message == f"TDS_BADARG payload of td:{{s}}:d:a has {len(payload)} bytes, runs need 2"

    def test_payload_missing(self, wstore: LuaRedis, lua_version: str) -> None:
        exc = expect_error(wstore, "TDS_BADARG", "write_runs", [META, WV, D("a")], ["2", "1", "3", "2"], lua_version)
        assert exc.message == "TDS_BADARG payload of td:{s}:d:a has nil bytes, runs need 2"

    @pytest.mark.parametrize("extra", [[b"junk"], [b"", b""]], ids=["one", "two"])
    def test_extra_argv(self, wstore: LuaRedis, lua_version: str, extra: list[bytes]) -> None:
        argv = runs_argv("2", ([(3, 2)], b"XY")) + extra
        exc = expect_error(wstore, "TDS_BADARG", "write_runs", [META, WV, D("a")], argv, lua_version)
        assert exc.message == "TDS_BADARG expected 1 groups, ARGV has extra values"

    def test_fewer_groups_than_keys(self, wstore: LuaRedis, lua_version: str) -> None:
        argv = runs_argv("2", ([(3, 2)], b"XY"))
        expect_error(wstore, "TDS_BADARG", "write_runs", [META, WV, D("a"), D("b")], argv, lua_version)

    @pytest.mark.parametrize("count", ["x", "-1", ""])
    def test_bad_run_count(self, wstore: LuaRedis, lua_version: str, count: str) -> None:
        exc = expect_error(wstore, "TDS_BADARG", "write_runs", [META, WV, D("a")], ["2", count, b""], lua_version)
        assert exc.message == "TDS_BADARG bad run count for td:{s}:d:a"

    @pytest.mark.parametrize("run", [("x", "1"), ("1", "y"), ("-1", "1"), ("1", "-1"), ("", "1")])
    def test_bad_run(self, wstore: LuaRedis, lua_version: str, run: tuple[str, str]) -> None:
        argv = ["2", "2", "0", "1", run[0], run[1], b"AB"]
        exc = expect_error(wstore, "TDS_BADARG", "write_runs", [META, WV, D("a")], argv, lua_version)
        assert exc.message == "TDS_BADARG bad run 2 for td:{s}:d:a"

    def test_fractional_offset(self, wstore: LuaRedis, lua_version: str) -> None:
        argv = runs_argv("2", ([(0, 1)], b"A")) + ["1", "0.5", "1", b"B"]
        expect_error(wstore, "TDS_BADARG", "write_runs", [META, WV, D("a"), D("b")], argv, lua_version)

    def test_stale_version(self, wstore: LuaRedis, lua_version: str) -> None:
        exc = expect_error(wstore, "TDS_STALE", "write_runs", [META, WV, D("a")], runs_argv("1", ([(0, 1)], b"x")), lua_version)
        assert exc.message == "TDS_STALE layout version is 2, client assumed 1"

    @pytest.mark.parametrize("stored", [b"garbage", b"-", b"1e3", b"9" * 19])
    def test_damaged_wv_is_corrupt_and_writes_nothing(self, wstore: LuaRedis, lua_version: str, stored: bytes) -> None:
        """The INCR ends the script: a damaged write version would fail it after the SETRANGEs."""
        wstore.data[WV] = stored
        exc = expect_error(wstore, "TDS_CORRUPT", "write_runs", [META, WV, D("a")], runs_argv("2", ([(0, 1)], b"x")), lua_version)
        assert exc.message.startswith("TDS_CORRUPT the write version td:{s}:wv holds")

    def test_empty_expected_version_skips_the_check(self, wstore: LuaRedis, lua_version: str) -> None:
        assert wstore.run("write_runs", [META, WV, D("a")], runs_argv("", ([(0, 1)], b"x")), lua_version) == 1
        assert wstore.data[D("a")] == b"x123456789"

    @pytest.mark.parametrize("expected", ["2", ""])
    def test_missing_store(self, r: LuaRedis, lua_version: str, expected: str) -> None:
        r.data[D("a")] = b"0123456789"
        exc = expect_error(r, "TDS_NOSTORE", "write_runs", [META, WV, D("a")], runs_argv(expected, ([(0, 1)], b"x")), lua_version)
        assert exc.message == "TDS_NOSTORE no store at td:{s}:meta"

    @pytest.mark.parametrize(
        "second,code",
        [
            (([(9, 2)], b"zz"), "TDS_RANGE"),
            (([(0, 2)], b"z"), "TDS_BADARG"),
            (None, "TDS_NOENTRY"),
        ],
        ids=["range", "badarg", "noentry"],
    )
    def test_second_group_bad_writes_nothing(self, wstore: LuaRedis, lua_version: str, second: Any, code: str) -> None:
        keys = [META, WV, D("a"), D("b") if second is not None else D("nope"), D("b")]
        argv = runs_argv("2", ([(0, 3)], b"AAA"), second or ([(0, 1)], b"z"), ([(1, 1)], b"B"))
        expect_error(wstore, code, "write_runs", keys, argv, lua_version)
        assert wstore.commands("SETRANGE") == []

    def test_binary_payload(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": bytes(512)})
        payload = bytes(range(256)) * 2
        runs = [(0, 256), (256, 256)]
        assert r.run("write_runs", [META, WV, D("a")], runs_argv("2", (runs, payload)), lua_version) == 2
        assert r.data[D("a")] == payload

    def test_ttl_of_the_entry_is_untouched(self, wstore: LuaRedis, lua_version: str) -> None:
        wstore.ttls[D("a")] = 1234
        wstore.run("write_runs", [META, WV, D("a")], runs_argv("2", ([(0, 1)], b"x")), lua_version)
        assert wstore.ttls == {D("a"): 1234}


class TestWriteRunsWriteVersion:
    @pytest.mark.parametrize("stored,after", [(None, b"1"), ("0", b"1"), ("7", b"8"), ("99999999999", b"100000000000")])
    def test_bumps_wv_exactly_once(self, r: LuaRedis, lua_version: str, stored: str | None, after: bytes) -> None:
        make_store(r, entries={"a": b"0123456789", "b": b"abcdefghij"}, wv=stored)
        before = r.snapshot()
        argv = runs_argv("2", ([(0, 1), (5, 2)], b"ABC"), ([(9, 1)], b"Z"))
        assert r.run("write_runs", [META, WV, D("a"), D("b")], argv, lua_version) == 3
        expected, ttls = wv_bumped(before)
        expected[D("a")], expected[D("b")] = b"A1234BC789", b"abcdefghiZ"
        assert r.snapshot() == (expected, ttls)
        assert wv_of(r) == after
        assert r.commands("INCR") == [(WV,)]
        assert r.commands("HINCRBY") == [] and r.commands("HSET") == [], "the meta hash is not written"

    def test_each_call_bumps_wv(self, wstore: LuaRedis, lua_version: str) -> None:
        for i in range(1, 4):
            wstore.run("write_runs", [META, WV, D("a")], runs_argv("2", ([(i, 1)], b"x")), lua_version)
            assert wv_of(wstore) == str(i).encode()

    @pytest.mark.parametrize("expected,code", [("1", "TDS_STALE"), ("2", "TDS_RANGE")])
    def test_an_error_leaves_wv_alone(self, wstore: LuaRedis, lua_version: str, expected: str, code: str) -> None:
        wstore.data[WV] = b"5"
        expect_error(wstore, code, "write_runs", [META, WV, D("a")], runs_argv(expected, ([(9, 2)], b"xx")), lua_version)
        assert wstore.commands("INCR") == []

    def test_old_key_layout_is_refused(self, wstore: LuaRedis, lua_version: str) -> None:
        """KEYS without the wv key: the first data key would be taken for it; the groups do not fit."""
        exc = expect_error(wstore, "TDS_BADARG", "write_runs", [META, D("a")], runs_argv("2", ([(0, 1)], b"x")), lua_version)
        assert exc.message == "TDS_BADARG expected 0 groups, ARGV has extra values"


class TestWriteRunsLargeOffsets:
    """Offsets past 2**31 must reach SETRANGE as plain decimal integers (no exponent, no ".0")."""

    @pytest.fixture
    def big(self) -> LuaRedis:
        r = LuaRedis(proto_max_bulk_len=1 << 40, virtual_strlen={D("big"): 5_000_000_000})
        make_store(r)
        return r

    def test_single_run(self, big: LuaRedis, lua_version: str) -> None:
        argv = runs_argv("2", ([(3_000_000_000, 3)], b"xyz"))
        assert big.run("write_runs", [META, WV, D("big")], argv, lua_version) == 1
        assert big.commands("SETRANGE") == [(D("big"), b"3000000000", b"xyz")]
        assert big.data[D("big")] == VirtualString(5_000_000_000, [(3_000_000_000, b"xyz")])

    def test_many_runs(self, big: LuaRedis, lua_version: str) -> None:
        offsets = [2**31 - 1, 2**31, 2**32 + 7, 4_999_999_998]
        argv = runs_argv("2", ([(o, 2) for o in offsets], b"aabbccdd"))
        assert big.run("write_runs", [META, WV, D("big")], argv, lua_version) == 4
        assert big.commands("SETRANGE") == [
            (D("big"), str(o).encode(), chunk) for o, chunk in zip(offsets, [b"aa", b"bb", b"cc", b"dd"], strict=True)
        ]
        assert big.data[D("big")].length == 5_000_000_000

    def test_range_message(self, big: LuaRedis, lua_version: str) -> None:
        argv = runs_argv("2", ([(4_999_999_999, 2)], b"zz"))
        exc = expect_error(big, "TDS_RANGE", "write_runs", [META, WV, D("big")], argv, lua_version)
        assert exc.message == "TDS_RANGE run 4999999999+2 past the end (5000000000) of td:{s}:d:big"


# =========================================================================== #
# clear
# =========================================================================== #


class TestClear:
    def test_deletes_exactly_the_listed_keys(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa", "b": b"bbb"}, nodes=("n",), wv="7", cursor=12)
        stray = b"td:{s}:tmp:abandoned"
        r.data[stray] = b"tmp"
        assert r.run("clear", [META, REG, WV, RING, D("a"), D("b")], ["2", "3"], lua_version) == 6
        assert state(r) == {stray: b"tmp"}

    def test_chunks_go_to_the_trash(self, r: LuaRedis, lua_version: str) -> None:
        """Trailing (chunk, trash key) pairs are renamed, with a 10-minute TTL, for the client to free one by one."""
        make_store(r, entries={"b": b"bbb"}, wv="1")
        r.data[C(0, "a")], r.data[C(1, "a")] = b"c0", b"c1"
        keys = [META, REG, WV, RING, D("b"), C(0, "a"), TMP("t0"), C(1, "a"), TMP("t1"), C(2, "a"), TMP("t2")]
        assert r.run("clear", keys, ["2", "1", "3"], lua_version) == 6  # meta, reg, wv, b, and 2 chunks moved
        assert state(r) == {TMP("t0"): b"c0", TMP("t1"): b"c1"}
        assert r.ttls == {TMP("t0"): 600000, TMP("t1"): 600000}

    @pytest.mark.parametrize("count", ["x", "-1", "1.5", "4"])
    def test_bad_trash_pair_count(self, r: LuaRedis, lua_version: str, count: str) -> None:
        make_store(r, entries={"a": b"aaa"})
        expect_error(r, "TDS_BADARG", "clear", [META, REG, D("a"), C(0, "x"), TMP("t")], ["2", "1", count], lua_version)

    def test_counts_only_keys_that_existed(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa"})  # no write version, no cursor yet
        assert r.run("clear", [META, REG, WV, RING, D("a"), D("gone")], ["", "1"], lua_version) == 3
        assert state(r) == {}

    def test_store_without_registry(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, wv="1")
        assert r.run("clear", [META, REG, WV, RING], ["2", "0"], lua_version) == 2
        assert state(r) == {}

    def test_keys_are_whatever_the_client_lists(self, r: LuaRedis, lua_version: str) -> None:
        """KEYS[3..] is a list of keys to delete: the wv and ring keys may come in any position."""
        make_store(r, entries={"a": b"aaa"}, wv="2", cursor=5)
        assert r.run("clear", [META, REG, D("a"), RING, WV], ["2", "1"], lua_version) == 5
        assert state(r) == {}

    def test_keys_left_off_stay(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa"}, wv="2", cursor=5)
        assert r.run("clear", [META, REG, D("a")], ["2", "1"], lua_version) == 3
        assert state(r) == {WV: b"2", RING: b"5"}

    def test_registry_size_mismatch(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa", "b": b"bbb"}, nodes=("n",), wv="3", cursor=1)
        exc = expect_error(r, "TDS_STALE", "clear", [META, REG, WV, RING, D("a")], ["2", "2"], lua_version)
        assert exc.message == "TDS_STALE registry has 3 entries, client knows of 2"
        assert r.commands("DEL") == []

    def test_stale_version(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, lv=4, entries={"a": b"aaa"}, wv="3")
        exc = expect_error(r, "TDS_STALE", "clear", [META, REG, WV, RING, D("a")], ["3", "1"], lua_version)
        assert exc.message == "TDS_STALE layout version is 4, client assumed 3"

    @pytest.mark.parametrize("expected", ["2", ""])
    def test_missing_store(self, r: LuaRedis, lua_version: str, expected: str) -> None:
        r.data[REG] = {b"a": b"{}"}
        r.data[WV] = b"4"
        r.data[RING] = b"2"
        r.data[D("a")] = b"orphan"
        exc = expect_error(r, "TDS_NOSTORE", "clear", [META, REG, WV, RING, D("a")], [expected, "1"], lua_version)
        assert exc.message == "TDS_NOSTORE no store at td:{s}:meta"

    def test_absent_deletes_the_leftovers_of_a_store_without_meta(self, r: LuaRedis, lua_version: str) -> None:
        """ARGV[1] "absent": a store whose meta hash is gone (evicted, deleted by hand) is cleaned up."""
        r.data[REG] = {b"a": b"{}", b"b": b"{}"}
        r.data[WV] = b"4"
        r.data[D("a")] = b"orphan"
        assert r.run("clear", [META, REG, WV, RING, D("a")], ["absent", ""], lua_version) == 3
        assert state(r) == {}

    def test_absent_refuses_when_a_store_exists(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa"})
        exc = expect_error(r, "TDS_STALE", "clear", [META, REG, D("a")], ["absent", ""], lua_version)
        assert exc.message == "TDS_STALE a store was created at td:{s}:meta meanwhile"
        assert r.commands("DEL") == []

    def test_empty_count_skips_the_registry_check(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"aaa", "b": b"bbb"})
        assert r.run("clear", [META, REG, D("a"), D("b")], ["2", ""], lua_version) == 4
        assert state(r) == {}

    @pytest.mark.parametrize("entries,batches", [(996, [1000]), (997, [1000, 1]), (2500, [1000, 1000, 504])])
    def test_deletes_in_batches(self, r: LuaRedis, lua_version: str, entries: int, batches: list[int]) -> None:
        paths = [f"e{i}" for i in range(entries)]
        make_store(r, entries={p: b"x" for p in paths}, wv="9", cursor=3)
        keys = [META, REG, WV, RING] + [D(p) for p in paths]
        assert r.run("clear", keys, ["2", str(entries)], lua_version) == entries + 4
        assert [len(args) for args in r.commands("DEL")] == batches
        assert state(r) == {}

    def test_new_store_after_clear_starts_without_counters(self, r: LuaRedis, lua_version: str) -> None:
        """clear removes the counters with the store, so a re-created store starts from scratch."""
        make_store(r, entries={"a": b"aaa"}, wv="8", cursor=6)
        r.run("clear", [META, REG, WV, RING, D("a")], ["2", "1"], lua_version)
        tmp = set_tmp(r, "1", b"abcd")
        argv = commit_argv("new", ops=[put("a", 4, 5)], first="1024")
        assert r.run("commit", [*CK, tmp, D("a")], argv, lua_version) == 1025
        assert r.data[WV] == b"1" and RING not in r.data
        keys = [META, RING, b"td:{s}:rf", b"td:{s}:fence", WV, b"td:{s}:rate"]
        assert r.run("reserve", keys, ["1025", "1", "2", "new", "0", "0"], lua_version) == [0, b"", b"1025"]


# =========================================================================== #
# Every declared error code has a test above
# =========================================================================== #

class TestGather:
    """gather: rows of one string, concatenated in the order given."""

    def test_rows_in_order_with_repeats(self, r: LuaRedis, lua_version: str) -> None:
        r.data[D("g")] = b"0123456789"
        out = r.run("gather", [D("g")], ["2", "4 0 4 1"], lua_version)
        assert out == b"89018923"

    def test_no_rows_and_missing_key(self, r: LuaRedis, lua_version: str) -> None:
        assert r.run("gather", [D("none")], ["4", ""], lua_version) == b""
        assert r.run("gather", [D("none")], ["4", "0 1"], lua_version) == b""

    def test_large_row_numbers_are_sent_as_integers(self, r: LuaRedis, lua_version: str) -> None:
        r.data[D("g")] = b"x" * 16
        assert r.run("gather", [D("g")], ["4", "1 3"], lua_version) == b"x" * 8

    @pytest.mark.parametrize("args", [("0", "1"), ("-1", "1"), ("1.5", "1"), ("x", "1"), ("2", "1,2"), ("2", "-1"), ("2", "1.0")])
    def test_bad_run(self, r: LuaRedis, lua_version: str, args: tuple[str, str]) -> None:
        r.data[D("g")] = b"0123"
        expect_error(r, "TDS_BADARG", "gather", [D("g")], list(args), lua_version)


class TestReadOne:
    """read_one: one byte range of an entry with the store's layout version."""

    def test_range_and_version(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"0123456789"})
        lv, data, size = r.run("read_one", [META, D("a")], ["2", "5"], lua_version)
        assert data == b"2345" and lv == r.data[META][b"lv"] and size == 10

    def test_whole_string_and_missing_store(self, r: LuaRedis, lua_version: str) -> None:
        r.data[D("a")] = b"abc"
        lv, data, size = r.run("read_one", [META, D("a")], ["0", "-1"], lua_version)
        assert lv is None and data == b"abc" and size == 3

    @pytest.mark.parametrize("bounds", [("x", "1"), ("0", "1.5"), ("", "2")])
    def test_bad_range(self, r: LuaRedis, lua_version: str, bounds: tuple[str, str]) -> None:
        make_store(r, entries={"a": b"0123"})
        expect_error(r, "TDS_BADARG", "read_one", [META, D("a")], list(bounds), lua_version)


class TestReadAll:
    """read_all: the meta hash, registry, write version and every entry's bytes in one step."""

    def test_whole_store(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"0123", "b": b"xy"}, nodes=("n",), wv="7")
        before = state(r)
        meta, reg, wv, data = r.run("read_all", [META, REG, WV], ["td:{s}:d:"], lua_version)
        assert dict(zip(meta[::2], meta[1::2], strict=True)) == r.data[META]
        fields = reg[::2]
        assert sorted(fields) == [b"a", b"b", b"n"] and wv == b"7"
        assert dict(zip(fields, data, strict=True)) == {b"a": b"0123", b"b": b"xy", b"n": None}
        assert state(r) == before  # reads only

    def test_missing_store(self, r: LuaRedis, lua_version: str) -> None:
        meta, reg, wv, data = r.run("read_all", [META, REG, WV], ["td:{s}:d:"], lua_version)
        assert (meta, reg, wv, data) == ([], [], None, [])

    def test_more_than_the_limit_returns_no_bytes(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"0123", "b": b"xy"}, wv="7")
        meta, reg, wv, data = r.run("read_all", [META, REG, WV], ["td:{s}:d:", "5"], lua_version)
        assert sorted(reg[::2]) == [b"a", b"b"] and wv == b"7" and data is None  # 6 bytes > 5
        _, _, _, data = r.run("read_all", [META, REG, WV], ["td:{s}:d:", "6"], lua_version)
        assert sorted(data) == [b"0123", b"xy"]

    def test_bad_prefix(self, r: LuaRedis, lua_version: str) -> None:
        make_store(r, entries={"a": b"0123"})
        expect_error(r, "TDS_BADARG", "read_all", [META, REG, WV], [""], lua_version)


ERROR_TESTS = {
    "read_one": {"TDS_BADARG": TestReadOne.test_bad_range},
    "read_all": {"TDS_BADARG": TestReadAll.test_bad_prefix},
    "gather": {"TDS_BADARG": TestGather.test_bad_run},
    "commit": {
        "TDS_NOSTORE": TestCommitMetaAndVersion.test_missing_store,
        "TDS_EXISTS": TestCommitCreate.test_new_on_existing_store,
        "TDS_STALE": TestCommitMetaAndVersion.test_stale_version,
        "TDS_CONFLICT": TestCommitWriteVersion.test_conflict,
        "TDS_LOCKED": TestCommitLock.test_locked_store_refuses_when_asked,
        "TDS_PARTIAL": TestCommitPut.test_missing_tmp_is_partial_and_drops_every_tmp,
        "TDS_BADARG": TestCommitBadArg.test_malformed_op_applies_nothing,
        "TDS_CORRUPT": TestCommitWriteVersion.test_damaged_wv_is_corrupt_and_writes_nothing,
    },
    "write_runs": {
        "TDS_NOSTORE": TestWriteRuns.test_missing_store,
        "TDS_STALE": TestWriteRuns.test_stale_version,
        "TDS_NOENTRY": TestWriteRuns.test_missing_data_key,
        "TDS_RANGE": TestWriteRuns.test_run_past_the_end,
        "TDS_BADARG": TestWriteRuns.test_payload_size_mismatch,
        "TDS_CORRUPT": TestWriteRuns.test_damaged_wv_is_corrupt_and_writes_nothing,
    },
    "clear": {
        "TDS_NOSTORE": TestClear.test_missing_store,
        "TDS_STALE": TestClear.test_registry_size_mismatch,
        "TDS_BADARG": TestClear.test_bad_trash_pair_count,
    },
}


def test_every_script_and_declared_error_code_has_a_test() -> None:
    from .test_expire import EXPIRE_ERROR_TESTS  # here: test_expire imports this module
    from .test_reserve import RESERVE_ERROR_TESTS  # (and so does test_reserve)
    from .test_ring_total import RING_TOTAL_ERROR_TESTS  # (and test_ring_total)

    error_tests = {
        **ERROR_TESTS, "expire": EXPIRE_ERROR_TESTS, "reserve": RESERVE_ERROR_TESTS, "ring_total": RING_TOTAL_ERROR_TESTS,
    }
    from .test_lease import COMMIT_BUSY_TESTS, LEASE_ERROR_TESTS
    from .test_priorities import PRIO_ERROR_TESTS  # (test_priorities imports this module)
    from .test_rate import RATE_LIMIT_ERROR_TESTS, RATE_SAMPLE_ERROR_TESTS

    error_tests.update(lease=LEASE_ERROR_TESTS, commit={**ERROR_TESTS["commit"], **COMMIT_BUSY_TESTS})
    error_tests.update(rate_limit=RATE_LIMIT_ERROR_TESTS, rate_sample=RATE_SAMPLE_ERROR_TESTS)
    error_tests.update(PRIO_ERROR_TESTS)
    from .test_slices import SLICE_ERROR_TESTS  # (test_slices imports this module)

    error_tests.update(SLICE_ERROR_TESTS)
    assert set(error_tests) == set(script_names()), "a script without behaviour tests"
    for name, tests in error_tests.items():
        assert set(tests) == set(get_script(name).header.errors), f"{name}: the error tests and its header disagree"


def test_iarg_gives_the_server_exact_digits(lua_version: str) -> None:
    """lib/common.lua's iarg under both Lua versions, as the servers format a number argument:
    exact digits for integers and for Lua 5.4 floats, which a Lua 5.4 server would write "3.0"
    (this fails without iarg's guard on Lua 5.4)."""
    from tdstore._backend import scripts as _scripts

    common = _scripts._ANY_HEADER_RE.sub("", (_scripts._lua_dir() / "lib" / "common.lua").read_text(), count=1)
    body = """
    local out = {}
    for i = 1, #ARGV do
      local x = tonumber(ARGV[i])
      rcall('SET', 'k', iarg(x))
      out[#out + 1] = rcall('GET', 'k')
      rcall('SET', 'k', iarg(x + 0.0))
      out[#out + 1] = rcall('GET', 'k')
    end
    return out
    """
    values = [0, 3, 2**31 + 5, 10**15 - 1, 10**15, 2**53 - 1, -1, -(10**15) - 1]
    got = LuaRedis().eval(common + body, [], [str(v) for v in values], lua_version=lua_version)
    assert got == [str(v).encode() for v in values for _ in range(2)]
