"""commit.lua's ARGV[10] compare-and-set against the append counters (issue 16 goal 5:
appends do not conflict with a read-modify-write of other entries).

``extend()`` counts its appends per sub-store in the hash ``<base>:ac`` (field "a:<path>",
bumped in the append's MULTI: tdstore/_backend/append.py); the number of appends is the
sum of its fields."""

from __future__ import annotations

import json

import pytest

from .shim import LuaRedis
from .test_scripts import CK, WV, D, commit_argv, expect_error, make_store, put, set_tmp

pytestmark = pytest.mark.lua


AC = b"td:{s}:ac"  # the append counters (see tdstore/_core/keys.py)


def cas(w: int, **fields: str) -> str:
    return json.dumps({"w": str(w), "f": {k.replace("_", ":", 1): v for k, v in fields.items()}})


def commit_cas(expected_cas: str, **kw: object) -> list[str]:
    return [*commit_argv(first="0", **kw), "", expected_cas]  # type: ignore[arg-type]


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
