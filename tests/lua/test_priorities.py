"""The prioritized-replay scripts (lua/prio_*.lua, lua/lib/prio.lua) on the in-memory shim,
under Lua 5.1 and 5.4 and in both encodings of the tree (doubles where the shim has struct,
as Redis and Valkey, text where it has none, as fakeredis): the tree they build and keep (checked node by node with
tdstore.replay.priorities.tree_problems), the draws of chosen uniforms, the rejection of
rows not written, stale generations, and bad arguments and damage refused with the key
space unchanged.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest

from tdstore.replay.priorities import PrioritySettings, tree_problems

from .conftest import with_neighbour
from .test_expire import NOW, ClockRedis
from .test_scripts import META, OTHER, RING, expect_error, make_store

pytestmark = pytest.mark.lua

FLAGS = b"td:{s}:rf"
PL, PT, PG, PM = b"td:{s}:pl", b"td:{s}:pt", b"td:{s}:pg", b"td:{s}:pm"
BUILD_KEYS = [META, RING, FLAGS, PL, PT, PG, PM]
UPDATE_KEYS = [META, RING, PL, PT, PG, PM]
NEW_KEYS = [META, PL, PT, PG, PM]
CHECK_KEYS = [FLAGS, PG, RING]


@pytest.fixture(params=["f64", "text"])
def r(request: pytest.FixtureRequest) -> ClockRedis:
    """The shim, with struct ("f64": enable stores doubles) or without ("text")."""
    shim = ClockRedis(struct_lib=request.param == "f64")
    shim.enc = request.param  # type: ignore[attr-defined]
    return with_neighbour(shim)


def value_bytes(r: ClockRedis, v: float) -> bytes:
    """``v`` as a leaf of the shim's encoding."""
    return struct.pack("<d", v) if r.enc == "f64" else f"{v:<23.17g}".encode()  # type: ignore[attr-defined]


def width(r: ClockRedis) -> int:
    return 8 if r.enc == "f64" else 23  # type: ignore[attr-defined]


def settings(cap: int = 10, k: int = 4, alpha: float = 1.0, beta: float = 1.0, eps: float = 0.0) -> str:
    return json.dumps({"alpha": alpha, "beta": beta, "eps": eps, "k": k, "cap": cap})


def ring(r: ClockRedis, flags: bytes | None, cursor: int) -> None:
    make_store(r, cursor=cursor)
    if flags is not None:
        r.data[FLAGS] = flags


def leaves(r: ClockRedis) -> list[float]:
    raw = r.data[PL]
    w = width(r)
    if r.enc == "f64":  # type: ignore[attr-defined]
        return [struct.unpack("<d", raw[i : i + w])[0] for i in range(0, len(raw), w)]
    return [float(raw[i : i + w]) for i in range(0, len(raw), w)]


def gens(r: ClockRedis) -> list[int]:
    raw = r.data[PG]
    return [int(raw[i : i + 16]) for i in range(0, len(raw), 16)]


def drawn_values(r: ClockRedis, blob: bytes) -> list[float]:
    """The p of a draw's reply: doubles on a tree of doubles, else text joined by spaces."""
    if r.enc == "f64":  # type: ignore[attr-defined]
        assert len(blob) % 8 == 0, blob
        return list(struct.unpack(f"<{len(blob) // 8}d", blob))
    return [float(v) for v in blob.split()]


def f64_uniforms(n: int, us: list[float]) -> list:
    """prio_draw's arguments with the uniforms as doubles (the clients' form on Redis and Valkey)."""
    return [str(n), "f64", struct.pack(f"<{len(us)}d", *us)]


def consistent(r: ClockRedis, cap: int = 10, k: int = 4) -> None:
    s = PrioritySettings(1.0, 1.0, 0.0, k, cap, r.enc)  # type: ignore[attr-defined]
    _leaves, problems = tree_problems(s, r.data[PL], r.data[PT])
    assert problems == []


def build(r: ClockRedis, lua_version: str, **kw: Any) -> Any:
    return r.run("prio_build", BUILD_KEYS, ["enable", settings(**kw)], lua_version)


def neighbour_unchanged(r: ClockRedis) -> None:
    assert {k: r.data[k] for k in OTHER} == OTHER


@pytest.mark.parametrize("k", [2, 3, 4, 16])
def test_enable_builds_the_tree_over_the_written_rows(r: ClockRedis, lua_version: str, k: int) -> None:
    ring(r, b"\x01\x01\x00\x01\x01\x01\x01", 7)
    assert build(r, lua_version, k=k, alpha=0.5, eps=3.0) == 2
    assert leaves(r) == [2.0, 2.0, 0.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0]  # (1 + 3) ** 0.5
    assert gens(r) == [0] * 10 and r.data[PM] == b" " * 23
    assert r.data[META][b"lv"] == b"3" and json.loads(r.data[META][b"prio"])["k"] == k
    assert json.loads(r.data[META][b"prio"])["enc"] == r.enc  # type: ignore[attr-defined]  # (chosen by the script)
    consistent(r, k=k)
    neighbour_unchanged(r)


def test_enable_without_flags_counts_the_cursor_rows(r: ClockRedis, lua_version: str) -> None:
    ring(r, None, 3)
    build(r, lua_version)
    assert leaves(r) == [1.0] * 3 + [0.0] * 7
    consistent(r)


def test_enable_again_with_the_same_alpha_keeps_the_priorities(r: ClockRedis, lua_version: str) -> None:
    ring(r, b"\x01" * 10, 10)
    build(r, lua_version)
    r.run("prio_update", UPDATE_KEYS, ["4", "9", ""], lua_version)
    assert build(r, lua_version, beta=0.3) == 1
    assert leaves(r)[4] == 9.0 and json.loads(r.data[META][b"prio"])["beta"] == 0.3
    assert r.data[META][b"lv"] == b"3"  # (only the settings: no new layout version)
    assert build(r, lua_version, alpha=2.0) == 2  # another alpha: rebuilt
    assert leaves(r)[4] == 1.0


def test_enable_gives_the_keys_the_store_expiry(r: ClockRedis, lua_version: str) -> None:
    ring(r, b"\x01" * 4, 4)
    r.data[META][b"exp"] = str(NOW + 5000).encode()
    build(r, lua_version)
    assert all(r.ttls[key] == 5000 for key in (PL, PT, PG, PM))


@pytest.mark.parametrize("bad", ["{", '{"alpha": -1, "beta": 1, "eps": 0, "k": 4, "cap": 10}',
                                 '{"alpha": 1, "beta": 1, "eps": 0, "k": 1, "cap": 10}', '[]'])
def test_enable_refuses_bad_settings_unchanged(r: ClockRedis, lua_version: str, bad: str) -> None:
    ring(r, b"\x01" * 4, 4)
    expect_error(r, "TDS_CORRUPT", "prio_build", BUILD_KEYS, ["enable", bad], lua_version)


def test_build_refuses_a_missing_store_and_a_bad_mode(r: ClockRedis, lua_version: str) -> None:
    expect_error(r, "TDS_NOSTORE", "prio_build", BUILD_KEYS, ["enable", settings()], lua_version)
    ring(r, b"\x01" * 4, 4)
    expect_error(r, "TDS_BADARG", "prio_build", BUILD_KEYS, ["sideways"], lua_version)


def test_reset_rebuilds_and_off_deletes(r: ClockRedis, lua_version: str) -> None:
    ring(r, b"\x01" * 10, 10)
    assert r.run("prio_build", BUILD_KEYS, ["reset"], lua_version) == 0  # (off: nothing)
    assert PL not in r.data
    build(r, lua_version)
    r.run("prio_update", UPDATE_KEYS, ["1 2", "5 6", ""], lua_version)
    r.data[FLAGS] = b"\x01\x01"  # (the cursor set to 2, as ring_total.lua does in the same MULTI)
    assert r.run("prio_build", BUILD_KEYS, ["reset"], lua_version) == 1
    assert leaves(r) == [1.0, 1.0] + [0.0] * 8 and r.data[PM] == b" " * 23
    assert r.run("prio_build", BUILD_KEYS, ["off"], lua_version) == 1
    assert not any(key in r.data for key in (PL, PT, PG, PM)) and b"prio" not in r.data[META]
    assert r.data[META][b"lv"] == b"4"


def test_new_rows_get_the_max_priority_and_their_generation(r: ClockRedis, lua_version: str) -> None:
    ring(r, b"\x01" * 10, 10)
    build(r, lua_version, alpha=1.0, eps=0.5)
    assert r.run("prio_new", NEW_KEYS, ["10", "3"], lua_version) == 3  # rows 0-2 (positions 10-12)
    assert leaves(r)[:4] == [1.5, 1.5, 1.5, 1.5]  # (1 + 0.5): none given yet
    r.run("prio_update", UPDATE_KEYS, ["5", "7", ""], lua_version)
    assert r.run("prio_new", NEW_KEYS, ["18", "4"], lua_version) == 4  # rows 8, 9, 0, 1: the ring comes round
    assert leaves(r) == [7.5, 7.5, 1.5, 1.5, 1.5, 7.5, 1.5, 1.5, 7.5, 7.5]
    assert gens(r) == [21, 22, 13, 0, 0, 0, 0, 0, 19, 20]
    consistent(r)


def test_new_rows_off_and_bad(r: ClockRedis, lua_version: str) -> None:
    ring(r, b"\x01" * 10, 10)
    assert r.run("prio_new", NEW_KEYS, ["0", "1"], lua_version) == 0
    build(r, lua_version)
    expect_error(r, "TDS_BADARG", "prio_new", NEW_KEYS, ["0", "11"], lua_version)
    expect_error(r, "TDS_BADARG", "prio_new", NEW_KEYS, ["-1", "1"], lua_version)
    r.data[PT] = r.data[PT][:-1]
    expect_error(r, "TDS_CORRUPT", "prio_new", NEW_KEYS, ["0", "1"], lua_version)
    r.data[PT] = r.data[PT] + b" "
    r.data[PL] = value_bytes(r, float("nan")) + r.data[PL][width(r):]  # (sizes kept: the value tells)
    expect_error(r, "TDS_CORRUPT", "prio_new", NEW_KEYS, ["1", "1"], lua_version)


def test_draw_follows_the_uniforms_and_rejects_rows_not_written(r: ClockRedis, lua_version: str) -> None:
    ring(r, b"\x01" * 10, 10)
    build(r, lua_version)
    r.run("prio_update", UPDATE_KEYS, [" ".join(map(str, range(10))), "1 2 3 4 5 6 7 8 9 10", ""], lua_version)
    # the masses 0..55: u * 55 falls in row i when sum(1..i) <= mass < sum(1..i+1)
    us = [0.0, 1.5 / 55, 10.5 / 55, 54.9 / 55]
    got = r.run("prio_draw", BUILD_KEYS, ["4", *map(repr, us)], lua_version)
    assert got[0] == 1 and got[1] == [0, 1, 4, 9]
    assert drawn_values(r, got[2]) == [1, 2, 5, 10] and got[3] == b"0" * 64 and got[4] == b"1" and json.loads(got[5])["k"] == 4
    assert got[6] == 0  # (no rate limiter on the ring)
    r.data[META][b"lim"] = b"1"
    assert r.run("prio_draw", BUILD_KEYS, ["1", "0.0"], lua_version)[6] == 1  # (one: the client counts the sample)
    del r.data[META][b"lim"]
    r.data[FLAGS] = b"\x01\x00" + b"\x01" * 8  # row 1 in flight: the next uniform replaces it
    got = r.run("prio_draw", BUILD_KEYS, ["2", repr(1.5 / 55), "0.0", "0.5"], lua_version)
    assert got[1] == [0, 6]  # (0.5 * 55 = 27.5: row 6 holds 21..28)
    got = r.run("prio_draw", BUILD_KEYS, ["2", repr(1.5 / 55), "0.0"], lua_version)
    assert got[1] == [0]  # (the uniforms ran out: fewer rows)


def test_draw_reads_no_flag_per_row_when_every_row_is_flagged(r: ClockRedis, lua_version: str) -> None:
    """A ring whose rows are all flagged (BITCOUNT of its flag bytes = its rows) has no draw
    to reject: the flags are not read per row. One row unflagged, they are, and it is never
    drawn."""
    ring(r, b"\x01" * 10, 10)
    build(r, lua_version)
    us = [0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95]
    got = r.run("prio_draw", BUILD_KEYS, ["10", *map(repr, us)], lua_version)
    assert got[1] == list(range(10))
    assert [c for c in r.commands("GETRANGE") if c[0] == FLAGS] == []
    r.data[FLAGS] = b"\x01" * 4 + b"\x00" + b"\x01" * 5  # row 4 in flight
    got = r.run("prio_draw", BUILD_KEYS, ["9", *map(repr, us)], lua_version)
    assert got[1] == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert len([c for c in r.commands("GETRANGE") if c[0] == FLAGS]) == 10


def test_draw_in_doubles_does_what_the_text_does(lua_version: str) -> None:
    """The uniforms as doubles (ARGV[2] "f64") draw the rows the same uniforms as text draw,
    with the same values (exact), generations and rejections; the tree and key space unchanged."""
    shim = ClockRedis(struct_lib=True)
    shim.enc = "f64"  # type: ignore[attr-defined]
    ring(shim, b"\x01\x00" + b"\x01" * 8, 10)  # row 1 in flight
    build(shim, lua_version, alpha=0.5)
    shim.run("prio_update", UPDATE_KEYS, [" ".join(map(str, range(10))), "1 2 3 4 5 6 7 8 9 1e-300", ""], lua_version)
    before = shim.snapshot()
    us = [0.0, 0.03, 0.25, 0.5, 0.999999, 0.7, 0.125, 0.3]
    for n in (1, 4, 7, 8):
        text = shim.run("prio_draw", BUILD_KEYS, [str(n), *map(repr, us)], lua_version)
        binary = shim.run("prio_draw", BUILD_KEYS, f64_uniforms(n, us), lua_version)
        assert binary == text and len(text[1]) <= n and 1 not in text[1], (text, binary)
        assert len(drawn_values(shim, text[2])) == len(text[1])
    assert shim.snapshot() == before


@pytest.mark.parametrize(("argv", "why"), [
    (["1", "f64", struct.pack("<d", 0.5)[:7]], "not doubles"),
    (["1", "f64", b""], "at least as many uniforms"),
    (["2", "f64", struct.pack("<d", 0.5)], "at least as many uniforms"),
    (["1", "f64"], "at least as many uniforms"),
    (f64_uniforms(1, [1.0]), "must be in [0, 1)"),
    (f64_uniforms(1, [-0.25]), "must be in [0, 1)"),
    (f64_uniforms(1, [float("nan")]), "must be in [0, 1)"),
    (f64_uniforms(1, [float("inf")]), "must be in [0, 1)"),
])
def test_draw_in_doubles_refuses_bad_uniforms_unchanged(r: ClockRedis, lua_version: str, argv: list, why: str) -> None:
    ring(r, b"\x01" * 10, 10)
    build(r, lua_version)
    if r.enc == "text":  # type: ignore[attr-defined]
        why = "no struct library"  # (a server without struct refuses the form whole)
    err = expect_error(r, "TDS_BADARG", "prio_draw", BUILD_KEYS, argv, lua_version)  # (the key space unchanged)
    assert why in err.message, err.message


def test_draw_off_empty_and_bad(r: ClockRedis, lua_version: str) -> None:
    ring(r, b"", 0)
    assert r.run("prio_draw", BUILD_KEYS, ["1", "0.5"], lua_version) == [0]
    build(r, lua_version)
    assert r.run("prio_draw", BUILD_KEYS, ["1", "0.5"], lua_version) == [-1, 0]
    r.data[META][b"lim"] = b"1"
    assert r.run("prio_draw", BUILD_KEYS, ["1", "0.5"], lua_version) == [-1, 1]
    del r.data[META][b"lim"]
    r.data[FLAGS] = b"\x01" * 10
    r.run("prio_build", BUILD_KEYS, ["reset"], lua_version)
    expect_error(r, "TDS_BADARG", "prio_draw", BUILD_KEYS, ["2", "0.5"], lua_version)
    expect_error(r, "TDS_BADARG", "prio_draw", BUILD_KEYS, ["1", "1.0"], lua_version)
    r.data[PT] = b"x" * len(r.data[PT])  # (text: not numbers; doubles: huge but valid, so NaN too)
    if r.enc == "text":  # type: ignore[attr-defined]
        expect_error(r, "TDS_CORRUPT", "prio_draw", BUILD_KEYS, ["1", "0.5"], lua_version)
    r.data[PT] = value_bytes(r, float("nan")) * (len(r.data[PT]) // width(r))
    expect_error(r, "TDS_CORRUPT", "prio_draw", BUILD_KEYS, ["1", "0.5"], lua_version)


def test_update_applies_drops_stale_generations_and_keeps_the_max(r: ClockRedis, lua_version: str) -> None:
    ring(r, b"\x01" * 10, 10)
    build(r, lua_version, alpha=0.5, eps=0.0)
    r.run("prio_new", NEW_KEYS, ["10", "2"], lua_version)  # rows 0, 1 at generations 11, 12
    got = r.run("prio_update", UPDATE_KEYS, ["0 1 2 2", "4 9 16 25", "11 5 0 0"], lua_version)
    assert got == [1, b"1011"]  # row 1's generation moved (12, not 5); row 2 twice: the last wins
    assert leaves(r)[:3] == [2.0, 1.0, 5.0] and float(r.data[PM]) == 25.0
    r.run("prio_update", UPDATE_KEYS, ["3", "1", ""], lua_version)
    assert float(r.data[PM]) == 25.0  # (a smaller priority: the max stays)
    consistent(r)


@pytest.mark.parametrize(("argv", "why"), [
    (["0 1", "1", ""], "2 rows, 1 priorities"),
    (["0", "1", "3 4"], "2 generations"),
    (["10", "1", ""], "not a row appended"),
    (["-1", "1", ""], "not a row appended"),
    (["0.5", "1", ""], "not a row appended"),
    (["0", "-2", ""], "not a finite number"),
    (["0", "nan", ""], "not a finite number"),
    (["0", "1e400", ""], "not a finite number"),
    (["0", "1", "x"], "not a count"),
])
def test_update_refuses_bad_arguments_unchanged(r: ClockRedis, lua_version: str, argv: list[str], why: str) -> None:
    ring(r, b"\x01" * 10, 10)
    build(r, lua_version)
    before = r.snapshot()
    got = r.run("prio_update", UPDATE_KEYS, argv, lua_version)
    assert got[0] == -1 and why in got[1].decode()
    assert r.snapshot() == before


def f64_args(rows: list[float], prios: list[float], gens: list[int] | None) -> list[bytes | str]:
    """prio_update's arguments in its "f64" form."""
    fields = b"".join(b"%016d" % g for g in gens) if gens is not None else b""
    return [struct.pack(f"<{len(rows)}d", *rows), struct.pack(f"<{len(prios)}d", *prios), fields, "f64"]


def test_update_in_doubles_does_what_the_text_does(lua_version: str) -> None:
    """The "f64" form (the clients' on Redis and Valkey) against the text form, on two stores
    with struct: the same replies, leaves, tree and max, generations moved or not."""
    twins = []
    for form in ("text", "f64"):
        shim = ClockRedis(struct_lib=True)
        shim.enc = "f64"  # type: ignore[attr-defined]
        ring(shim, b"\x01" * 10, 10)
        build(shim, lua_version, alpha=0.5, eps=0.0)
        shim.run("prio_new", NEW_KEYS, ["10", "2"], lua_version)  # rows 0, 1 at generations 11, 12
        twins.append((form, shim))
    steps = [([0, 1, 2, 2], [4.0, 9.0, 16.0, 25.0], [11, 5, 0, 0]), ([9, 3, 0], [0.5, 1e-300, 7.25], None), ([-0.0], [3.0], [11])]
    for rows, prios, gens in steps:
        replies = []
        for form, shim in twins:
            if form == "text":
                argv = [" ".join(str(int(x)) for x in rows), " ".join(map(repr, prios)), " ".join(map(str, gens or []))]
            else:
                argv = f64_args(rows, prios, gens)
            replies.append(shim.run("prio_update", UPDATE_KEYS, argv, lua_version))
        assert replies[0] == replies[1] and replies[0][0] == 1, replies
        assert twins[0][1].snapshot() == twins[1][1].snapshot()
    assert leaves(twins[1][1])[:4] == [3.0 ** 0.5, 1.0, 5.0, 1e-150]
    consistent(twins[1][1])


@pytest.mark.parametrize(("argv", "why"), [
    (f64_args([0, 1], [1.0], None), "2 rows, 1 priorities"),
    (f64_args([0], [1.0], [3, 4]), "2 generations"),
    ([struct.pack("<d", 0)[:7], struct.pack("<d", 1.0), b"", "f64"], "not doubles"),
    ([struct.pack("<d", 0), struct.pack("<d", 1.0), b"12345", "f64"], "16-digit fields"),
    (f64_args([10], [1.0], None), "not a row appended"),
    (f64_args([0.5], [1.0], None), "not a row appended"),
    (f64_args([float("nan")], [1.0], None), "not a row appended"),
    (f64_args([0], [float("nan")], None), "not a finite number"),
    (f64_args([0], [float("inf")], None), "not a finite number"),
    (f64_args([0], [-0.5], None), "not a finite number"),
    ([struct.pack("<d", 0), struct.pack("<d", 1.0), b"x" * 16, "f64"], "not a count"),
    (["0", "1", "", "f32"], "not \"f64\""),
])
def test_update_in_doubles_refuses_bad_arguments_unchanged(r: ClockRedis, lua_version: str, argv: list, why: str) -> None:
    ring(r, b"\x01" * 10, 10)
    build(r, lua_version)
    before = r.snapshot()
    got = r.run("prio_update", UPDATE_KEYS, argv, lua_version)
    if r.enc == "text" and argv[-1] == "f64":  # type: ignore[attr-defined]
        why = "no struct library"  # (a server without struct refuses the form whole)
    assert got[0] == -1 and why in got[1].decode(), got
    assert r.snapshot() == before


def test_update_past_the_rows_written_is_refused(r: ClockRedis, lua_version: str) -> None:
    ring(r, b"\x01" * 4, 4)
    build(r, lua_version)
    assert r.run("prio_update", UPDATE_KEYS, ["4", "1", ""], lua_version)[0] == -1


def test_check_reads_generations_and_flags(r: ClockRedis, lua_version: str) -> None:
    ring(r, b"\x01\x00\x01" + b"\x01" * 7, 10)
    build(r, lua_version)
    r.run("prio_new", NEW_KEYS, ["12", "1"], lua_version)  # row 2 at generation 13
    got = r.run("prio_check", CHECK_KEYS, ["0", "1", "2"], lua_version)
    assert got == [b"0" * 32 + b"0" * 14 + b"13", b"101"]
    expect_error(r, "TDS_BADARG", "prio_check", CHECK_KEYS, ["x"], lua_version)


def test_draw_and_update_refuse_a_missing_store_and_damage(r: ClockRedis, lua_version: str) -> None:
    expect_error(r, "TDS_NOSTORE", "prio_draw", BUILD_KEYS, ["1", "0.5"], lua_version)
    expect_error(r, "TDS_NOSTORE", "prio_update", UPDATE_KEYS, ["0", "1", ""], lua_version)
    ring(r, b"\x01" * 10, 10)
    build(r, lua_version)
    bad = b"nonsense".ljust(23) if r.enc == "text" else value_bytes(r, -1.0)  # type: ignore[attr-defined]
    r.data[PL] = bad + r.data[PL][width(r):]
    # (row 1's group reads row 0; a new value for row 1, so that a write before the check would show)
    expect_error(r, "TDS_CORRUPT", "prio_update", UPDATE_KEYS, ["1", "7", ""], lua_version)
    expect_error(r, "TDS_CORRUPT", "prio_new", NEW_KEYS, ["11", "1"], lua_version)
    r.data[RING] = b"lots"
    expect_error(r, "TDS_CORRUPT", "prio_update", UPDATE_KEYS, ["1", "1", ""], lua_version)


#: the behaviour tests of each script's error codes (tests/lua/test_scripts.py checks them all)
PRIO_ERROR_TESTS = {
    "prio_build": {
        "TDS_NOSTORE": test_build_refuses_a_missing_store_and_a_bad_mode,
        "TDS_BADARG": test_build_refuses_a_missing_store_and_a_bad_mode,
        "TDS_CORRUPT": test_enable_refuses_bad_settings_unchanged,
    },
    "prio_new": {"TDS_BADARG": test_new_rows_off_and_bad, "TDS_CORRUPT": test_new_rows_off_and_bad},
    "prio_draw": {
        "TDS_NOSTORE": test_draw_and_update_refuse_a_missing_store_and_damage,
        "TDS_BADARG": test_draw_off_empty_and_bad,
        "TDS_CORRUPT": test_draw_off_empty_and_bad,
    },
    "prio_update": {
        "TDS_NOSTORE": test_draw_and_update_refuse_a_missing_store_and_damage,
        "TDS_CORRUPT": test_draw_and_update_refuse_a_missing_store_and_damage,
    },
    "prio_check": {"TDS_BADARG": test_check_reads_generations_and_flags},
}
