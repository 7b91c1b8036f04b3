"""Static checks of the Lua scripts' contract headers and of their dialect (no Lua runtime).

For every script of ``script_names()``:

* the header names the file;
* the ``KEYS[n]``/``ARGV[n]`` the body uses are exactly the ones the header declares;
* the ``TDS_*`` codes the body can raise (directly or through a helper it calls,
  transitively) are exactly the ones of its ``Errors:`` list;
* every declared code is a key of ``tdstore.errors.LUA_ERRORS`` and every key of it is
  declared by some script;
* the body stays inside the common subset of Lua 5.1 and 5.4 that Redis, Valkey, KeyDB
  and Dragonfly all run, and assigns no global;
* every ``--@include`` names an existing helper and is expanded.

The analysis works on a token stream in which comments are dropped and string literals
are kept apart, so neither a comment nor a message text can fake a use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tdstore._backend.scripts import get_script, parse_header, script_names
from tdstore.errors import LUA_ERRORS

pytestmark = pytest.mark.lua

LUA_DIR = Path(__file__).resolve().parents[2] / "lua"
SCRIPTS = script_names()
_HEADER_BLOCK_RE = re.compile(r"\A--\[\[ (\w+)\n(.*?)\n\]\]", re.S)


# --------------------------------------------------------------------------- #
# A small Lua lexer
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Token:
    kind: str  # "name", "number", "string", "op"
    text: str  # for strings: the literal's content (escapes left as written)
    line: int


_LONG_OPEN_RE = re.compile(r"\[(=*)\[")
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUMBER_RE = re.compile(r"0[xX][0-9A-Fa-f]+|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_OPS = ("...", "..", "==", "~=", "<=", ">=", "<<", ">>", "//", "::")


def lex(code: str) -> list[Token]:
    """Tokens of Lua source; comments are dropped."""
    tokens: list[Token] = []
    i, line, n = 0, 1, len(code)
    while i < n:
        c = code[i]
        if c == "\n":
            line += 1
            i += 1
        elif c.isspace():
            i += 1
        elif code.startswith("--", i):
            long = _LONG_OPEN_RE.match(code, i + 2)
            if long:
                close = "]" + long.group(1) + "]"
                end = code.find(close, long.end())
                end = n if end < 0 else end + len(close)
            else:
                end = code.find("\n", i)
                end = n if end < 0 else end
            line += code.count("\n", i, end)
            i = end
        elif c == "[" and _LONG_OPEN_RE.match(code, i):
            long = _LONG_OPEN_RE.match(code, i)
            close = "]" + long.group(1) + "]"
            end = code.find(close, long.end())
            if end < 0:
                raise SyntaxError(f"unfinished long string at line {line}")
            tokens.append(Token("string", code[long.end() : end], line))
            line += code.count("\n", i, end)
            i = end + len(close)
        elif c in "'\"":
            j = i + 1
            while j < n and code[j] != c:
                if code[j] == "\\":
                    j += 1
                elif code[j] == "\n":
                    raise SyntaxError(f"unfinished string at line {line}")
                j += 1
            tokens.append(Token("string", code[i + 1 : j], line))
            i = j + 1
        elif _NAME_RE.match(code, i):
            m = _NAME_RE.match(code, i)
            tokens.append(Token("name", m.group(), line))
            i = m.end()
        elif c.isdigit() or (c == "." and i + 1 < n and code[i + 1].isdigit()):
            m = _NUMBER_RE.match(code, i)
            tokens.append(Token("number", m.group(), line))
            i = m.end()
        else:
            op = next((o for o in _OPS if code.startswith(o, i)), c)
            tokens.append(Token("op", op, line))
            i += len(op)
    return tokens


def split_header(text: str) -> tuple[str, str]:
    """(header block, body) of a script's text."""
    match = _HEADER_BLOCK_RE.match(text)
    assert match, "the script must open with a --[[ name ... ]] contract block"
    return text[: match.end()], text[match.end() :]


def body_tokens(name: str) -> list[Token]:
    """Tokens of the assembled body (includes inlined, header dropped)."""
    return lex(split_header(get_script(name).source)[1])


def code_of(tokens: list[Token]) -> str:
    """The token stream as text, with every string literal blanked to ``""``."""
    return " ".join('""' if t.kind == "string" else t.text for t in tokens)


# --------------------------------------------------------------------------- #
# KEYS / ARGV usage
# --------------------------------------------------------------------------- #


@dataclass
class Usage:
    fixed: set[int]  # literal KEYS[n]
    ranges: set[int]  # dynamic access covering [start, #KEYS]


def table_usage(tokens: list[Token], table: str) -> Usage:
    """Which indices of ``KEYS`` or ``ARGV`` the code reads.

    ``T[n]`` is a fixed use. ``T[#T]`` and ``for v = N, #T`` loops are range uses. Any
    other dynamic ``T[expr]`` is a range use from a lower bound found for the first name
    of ``expr``: the start of its ``for`` loop, its ``local v = N`` initial value, or a
    ``v < N`` guard; 1 when none is found (so it must be fully declared).
    """
    usage = Usage(set(), set())
    loops: dict[str, int] = {}
    for i, t in enumerate(tokens):
        # for v = N, #T
        if t.text == "for" and i + 6 < len(tokens):
            var, eq, start, comma, hash_, tab = (tokens[i + k] for k in range(1, 7))
            if (eq.text, comma.text, hash_.text) == ("=", ",", "#") and start.kind == "number" and tab.text == table:
                loops[var.text] = int(start.text)
                usage.ranges.add(int(start.text))
    for i, t in enumerate(tokens):
        if not (t.kind == "name" and t.text == table and i + 1 < len(tokens) and tokens[i + 1].text == "["):
            continue
        depth, j = 1, i + 2
        while depth:
            depth += {"[": 1, "]": -1}.get(tokens[j].text, 0)
            j += 1
        inner = tokens[i + 2 : j - 1]
        if len(inner) == 1 and inner[0].kind == "number":
            usage.fixed.add(int(inner[0].text))
            continue
        if [x.text for x in inner] == ["#", table]:
            usage.ranges.add(1)
            continue
        first = next((x.text for x in inner if x.kind == "name"), None)
        usage.ranges.add(_lower_bound(tokens, first, loops))
    return usage


def _lower_bound(tokens: list[Token], var: str | None, loops: dict[str, int]) -> int:
    if var is None:
        return 1
    if var in loops:
        return loops[var]
    text = code_of(tokens)
    for pattern in (rf"\blocal {re.escape(var)} = (\d+)\b", rf"\b{re.escape(var)} < (\d+)\b"):
        match = re.search(pattern, text)
        if match:
            return int(match.group(1))
    return 1


def _declared(decls: tuple[tuple[int, bool], ...]) -> tuple[set[int], int | None]:
    fixed = {idx for idx, variadic in decls if not variadic}
    variadic = [idx for idx, v in decls if v]
    return fixed, (variadic[0] if variadic else None)


@pytest.mark.parametrize("name", SCRIPTS)
def test_header_names_the_file(name: str) -> None:
    raw = (LUA_DIR / f"{name}.lua").read_text()
    assert parse_header(raw).name == name
    assert get_script(name).header.name == name


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("table", ["KEYS", "ARGV"])
def test_declarations_are_well_formed(name: str, table: str) -> None:
    header = get_script(name).header
    decls = header.keys if table == "KEYS" else header.argv
    indices = [idx for idx, _ in decls]
    assert indices == list(range(1, len(indices) + 1)), f"{table} declared out of order or with gaps: {decls}"
    variadic = [idx for idx, v in decls if v]
    assert len(variadic) <= 1 and (not variadic or variadic[0] == indices[-1]), (
        f"only the last {table} declaration may be variadic: {decls}"
    )


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("table", ["KEYS", "ARGV"])
def test_used_indices_are_declared_and_declared_ones_used(name: str, table: str) -> None:
    header = get_script(name).header
    fixed, variadic = _declared(header.keys if table == "KEYS" else header.argv)
    usage = table_usage(body_tokens(name), table)

    for idx in usage.fixed:
        assert idx in fixed or (variadic is not None and idx >= variadic), f"{table}[{idx}] is used but not declared"
    for start in usage.ranges:
        assert variadic is not None, f"{table} is read from index {start} on, but no {table}[n..] is declared"
        missing = [idx for idx in range(start, variadic) if idx not in fixed]
        assert not missing, f"{table} is read from index {start} on, but {table}{missing} are not declared"

    for idx in fixed:
        assert idx in usage.fixed or any(start <= idx for start in usage.ranges), (
            f"{table}[{idx}] is declared but never used"
        )
    if variadic is not None:
        assert usage.ranges, f"{table}[{variadic}..] is declared but the body never reads past fixed indices"


def test_usage_analysis_sees_every_kind_of_access() -> None:
    """The analysis itself: literal, #T, loops, guarded and initialised dynamic indices."""
    tokens = lex(
        "local a = KEYS[1] -- KEYS[9] in a comment\n"
        "local s = 'KEYS[8]'\n"
        "for k = 4, #KEYS do local x = KEYS[k] end\n"
        "local last = ARGV[#ARGV]\n"
        "local pos = 3\n"
        "local y = ARGV[pos + 1]\n"
        "local function at(i) if i < 5 then return nil end return KEYS[i] end\n"
    )
    assert table_usage(tokens, "KEYS") == Usage({1}, {4, 5})
    assert table_usage(tokens, "ARGV") == Usage(set(), {1, 3})


# --------------------------------------------------------------------------- #
# Error codes
# --------------------------------------------------------------------------- #


_OPENERS = {"function", "do", "if", "repeat"}
_CLOSERS = {"end", "until"}
_CODE_IN_STRING_RE = re.compile(r"\bTDS_[A-Z]+\b")


def function_bodies(tokens: list[Token]) -> dict[str, tuple[int, int]]:
    """``{name: (first, last) token index}`` of every named function definition."""
    bodies: dict[str, tuple[int, int]] = {}
    stack: list[tuple[str | None, int]] = []
    for i, t in enumerate(tokens):
        if t.kind != "name":
            continue
        if t.text in _OPENERS:
            fname = None
            if t.text == "function":
                if i + 1 < len(tokens) and tokens[i + 1].kind == "name":
                    fname = tokens[i + 1].text  # function f(  /  local function f(
                elif i >= 2 and tokens[i - 1].text == "=" and tokens[i - 2].kind == "name":
                    fname = tokens[i - 2].text  # local f = function(
            stack.append((fname, i))
        elif t.text in _CLOSERS:
            fname, start = stack.pop()
            if fname is not None:
                bodies[fname] = (start, i)
    assert not stack, "unbalanced blocks"
    return bodies


def raised_codes(tokens: list[Token]) -> set[str]:
    """TDS codes the top-level code can raise, following calls of named local functions."""
    bodies = function_bodies(tokens)
    inside = {i for lo, hi in bodies.values() for i in range(lo, hi + 1)}

    def direct(indices: list[int]) -> tuple[set[str], set[str]]:
        codes, calls = set(), set()
        for i in indices:
            t = tokens[i]
            if t.kind == "string":
                codes.update(_CODE_IN_STRING_RE.findall(t.text))
            elif t.kind == "name" and t.text in bodies and i + 1 < len(tokens) and tokens[i + 1].text in ("(", "'", '"', "{"):
                calls.add(t.text)
            elif t.kind == "name" and t.text in bodies and i + 1 < len(tokens) and tokens[i + 1].kind == "string":
                calls.add(t.text)
        return codes, calls

    # a named function's own body excludes the bodies of functions nested in it
    def own(name: str) -> list[int]:
        lo, hi = bodies[name]
        nested = {i for other, (a, b) in bodies.items() if other != name and lo < a and b < hi for i in range(a, b + 1)}
        return [i for i in range(lo, hi + 1) if i not in nested]

    codes, pending = direct([i for i in range(len(tokens)) if i not in inside])
    done: set[str] = set()
    while pending:
        fname = pending.pop()
        if fname in done:
            continue
        done.add(fname)
        more_codes, more_calls = direct(own(fname))
        codes |= more_codes
        pending |= more_calls - done
    return codes


def test_code_analysis_follows_helpers() -> None:
    tokens = lex(
        "local function fail(code, msg) return redis.error_reply(code .. ' ' .. msg) end\n"
        "local function unused() return fail('TDS_CORRUPT', 'x') end\n"
        "local function check() return fail('TDS_NOSTORE', 'y') end\n"
        "local function outer() return check() end\n"
        "-- fail('TDS_LOCKED', 'comment')\n"
        "if outer() then return fail('TDS_STALE', 'z') end\n"
    )
    assert raised_codes(tokens) == {"TDS_NOSTORE", "TDS_STALE"}


@pytest.mark.parametrize("name", SCRIPTS)
def test_raised_codes_match_the_errors_list(name: str) -> None:
    header = get_script(name).header
    raised = raised_codes(body_tokens(name))
    assert len(set(header.errors)) == len(header.errors), f"duplicate codes in the Errors list: {header.errors}"
    assert raised - set(header.errors) == set(), "raised but not declared in the header's Errors list"
    assert set(header.errors) - raised == set(), "declared in the Errors list but never raised"


@pytest.mark.parametrize("name", SCRIPTS)
def test_declared_codes_are_known_to_the_client(name: str) -> None:
    unknown = set(get_script(name).header.errors) - set(LUA_ERRORS)
    assert not unknown, f"not in tdstore.errors.LUA_ERRORS: {sorted(unknown)}"


@pytest.mark.parametrize("code", sorted(LUA_ERRORS))
def test_every_client_code_is_declared_by_a_script(code: str) -> None:
    assert any(code in get_script(name).header.errors for name in SCRIPTS), f"{code} is raised by no script"


def test_lua_errors_codes_are_well_formed() -> None:
    for code in LUA_ERRORS:
        assert re.fullmatch(r"TDS_[A-Z]+", code), code


# --------------------------------------------------------------------------- #
# Dialect: the common subset of Lua 5.1 and 5.4, inside the Redis sandbox
# --------------------------------------------------------------------------- #


_FORBIDDEN_OPS = {
    "//": "floor division is Lua 5.3+",
    "&": "bitwise operators are Lua 5.3+",
    "|": "bitwise operators are Lua 5.3+",
    "~": "bitwise operators are Lua 5.3+ (only ~= is allowed)",
    "<<": "bitwise operators are Lua 5.3+",
    ">>": "bitwise operators are Lua 5.3+",
    "::": "labels are Lua 5.2+",
}
_FORBIDDEN_NAMES = {
    "goto": "goto is Lua 5.2+",
    "struct": "the struct library exists on Redis only",
    "bit": "the bit library exists on Redis only",
    "bit32": "bit32 is Lua 5.2 only",
    "cmsgpack": "cmsgpack exists on Redis only",
    "utf8": "utf8 is Lua 5.3+",
    "loadstring": "loadstring is Lua 5.1 only",
    "setfenv": "setfenv is Lua 5.1 only",
    "getfenv": "getfenv is Lua 5.1 only",
    "os": "os is not in the server sandbox",
    "io": "io is not in the server sandbox",
    "require": "require is not in the server sandbox",
    "dofile": "dofile is not in the server sandbox",
    "loadfile": "loadfile is not in the server sandbox",
}
_FORBIDDEN_FIELDS = {
    ("table", "getn"): "table.getn is Lua 5.1 only",
    ("math", "pow"): "math.pow is Lua 5.1 only",
    ("math", "tointeger"): "math.tointeger is Lua 5.3+",
    ("math", "type"): "math.type is Lua 5.3+",
    ("string", "pack"): "string.pack is Lua 5.3+",
    ("string", "unpack"): "string.unpack is Lua 5.3+",
    ("table", "move"): "table.move is Lua 5.3+",
}


def _guarded_probe(tokens: list[Token], i: int) -> bool:
    """``pcall(function() return struct end)``: the one way a script may reach a library that
    exists on some servers only (lua/lib/prio.lua uses struct where the server has it)."""
    window = [t.text for t in tokens[max(i - 6, 0) : i + 2]]
    return tokens[i].text == "struct" and window == ["pcall", "(", "function", "(", ")", "return", "struct", "end"]


def _version_probe(tokens: list[Token], i: int) -> bool:
    """``local mtype = math.type``: reading the field (nil on Lua 5.1) tells the Lua version;
    lib/common.lua's iarg calls it only where it is not nil. Any other use of math.type, a call
    ``math.type(x)`` among them, is refused."""
    window = [t.text for t in tokens[max(i - 4, 0) : i + 2]]
    return tokens[i].text == "type" and window[:5] == ["mtype", "=", "math", ".", "type"] and (
        len(window) < 6 or window[5] != "("
    )


def dialect_problems(tokens: list[Token]) -> list[str]:
    problems = []
    for i, t in enumerate(tokens):
        prev = tokens[i - 1].text if i else ""
        if t.kind == "op" and t.text in _FORBIDDEN_OPS:
            problems.append(f"line {t.line}: {t.text!r}: {_FORBIDDEN_OPS[t.text]}")
        elif t.kind == "name" and t.text in _FORBIDDEN_NAMES and prev not in (".", ":") and not _guarded_probe(tokens, i):
            problems.append(f"line {t.line}: {t.text}: {_FORBIDDEN_NAMES[t.text]}")
        elif (
            t.kind == "name" and prev == "." and i >= 2 and (tokens[i - 2].text, t.text) in _FORBIDDEN_FIELDS
            and not _version_probe(tokens, i)
        ):
            problems.append(f"line {t.line}: {tokens[i - 2].text}.{t.text}: {_FORBIDDEN_FIELDS[(tokens[i - 2].text, t.text)]}")
    return problems


_STATEMENT_START = {"end", "do", "then", "else", "repeat", ")", ";"}


def global_assignments(tokens: list[Token]) -> list[str]:
    """Assignments and function definitions that would create or overwrite a global.

    A name counts as local when a ``local`` statement, a function parameter list or a
    ``for`` header declared it earlier in the text (scoping is not tracked: pragmatic).
    """
    locals_: set[str] = set()
    problems = []
    braces = 0  # inside a table constructor, "name = value" is a field
    for i, t in enumerate(tokens):
        prev = tokens[i - 1] if i else None
        braces += {"{": 1, "}": -1}.get(t.text, 0) if t.kind == "op" else 0
        if t.text == "local" and t.kind == "name":
            j = i + 1
            if tokens[j].text == "function":
                locals_.add(tokens[j + 1].text)
                continue
            while tokens[j].kind == "name":
                locals_.add(tokens[j].text)
                if tokens[j + 1].text != ",":
                    break
                j += 2
        elif t.text == "for" and t.kind == "name":
            j = i + 1
            while tokens[j].kind == "name" and tokens[j].text != "in":
                locals_.add(tokens[j].text)
                if tokens[j + 1].text != ",":
                    break
                j += 2
        elif t.text == "function" and t.kind == "name":
            j = i + 1
            if tokens[j].kind == "name":  # function name(...) / function a.b(...)
                fname = tokens[j].text
                if (prev is None or prev.text != "local") and tokens[j + 1].text == "(" and fname not in locals_:
                    problems.append(f"line {t.line}: function {fname} defines a global")
                while tokens[j].text != "(":
                    j += 1
            j += 1
            while tokens[j].text != ")":
                if tokens[j].kind == "name":
                    locals_.add(tokens[j].text)
                j += 1
        elif t.kind == "name" and not braces and (prev is None or prev.line < t.line or prev.text in _STATEMENT_START):
            # a statement starting with a plain name list followed by a single '='
            names, j = [t.text], i + 1
            while j + 1 < len(tokens) and tokens[j].text == "," and tokens[j + 1].kind == "name":
                names.append(tokens[j + 1].text)
                j += 2
            if j < len(tokens) and tokens[j].text == "=":
                for name in names:
                    if name not in locals_:
                        problems.append(f"line {t.line}: assignment to {name}, which is not a declared local")
    return problems


def test_dialect_checks_catch_each_construct() -> None:
    bad = lex(
        "local a = 7 // 2\nlocal b = 1 & 2 | 3\nlocal c = ~1\nlocal d = 1 << 2 >> 1\n"
        "goto done\n::done::\nlocal e = struct.pack('i', 1)\nlocal f = bit.band(1, 2)\n"
        "local g = cmsgpack.pack(1)\nlocal h = math.pow(2, 3)\nlocal i = 'a // b'\n"
    )
    found = "\n".join(dialect_problems(bad))
    for construct in ("'//'", "'&'", "'|'", "'~'", "'<<'", "'>>'", "goto", "'::'", "struct", "bit:", "cmsgpack", "math.pow"):
        assert construct in found, construct
    assert len(dialect_problems(bad)) == 13  # '::' twice; the string 'a // b' is not code
    assert dialect_problems(lex("if a ~= b then return 1 end -- a // b & c\n")) == []
    # the guarded probe passes; struct used any other way does not
    assert dialect_problems(lex("local ok, lib = pcall(function() return struct end)\n")) == []
    assert len(dialect_problems(lex("local f = function() return struct end\n"))) == 1
    # the version probe of lib/common.lua passes; a call of math.type does not
    assert dialect_problems(lex("local mtype = math.type\n")) == []
    assert len(dialect_problems(lex("local t = math.type(1)\n"))) == 1
    assert len(dialect_problems(lex("local mtype = math.type(1)\n"))) == 1


def test_global_assignment_check() -> None:
    tokens = lex(
        "local x, y = 1, 2\nx = 3\nz = 4\nlocal function f(p) p = 1 end\n"
        "function g() end\nfor k, v in pairs({}) do k = v end\nlocal t = {}\nt.a = 1\nt[1] = 2\n"
        "if x == 1 then w = 2 end\nlocal u = {\n  field = 1,\n  other = {a = 2},\n}\n"
    )
    assert global_assignments(tokens) == [
        "line 3: assignment to z, which is not a declared local",
        "line 5: function g defines a global",
        "line 10: assignment to w, which is not a declared local",
    ]


@pytest.mark.parametrize("name", SCRIPTS)
def test_no_dialect_specific_constructs(name: str) -> None:
    assert dialect_problems(body_tokens(name)) == []


@pytest.mark.parametrize("name", SCRIPTS)
def test_no_global_assignments(name: str) -> None:
    assert global_assignments(body_tokens(name)) == []


# --------------------------------------------------------------------------- #
# Includes
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("name", SCRIPTS)
def test_includes_exist_and_are_expanded(name: str) -> None:
    script = get_script(name)
    lines = [line for line in script.raw.splitlines() if line.startswith("--@include")]
    for line in lines:
        match = re.fullmatch(r"--@include (lib/[A-Za-z0-9_]+\.lua)\s*", line)
        assert match, f"malformed include line (it would stay a comment): {line!r}"
        assert (LUA_DIR / match.group(1)).is_file(), f"{line}: no such helper"
    assert not [line for line in script.source.splitlines() if line.startswith("--@include")], "include left unexpanded"
    assert script.source.startswith(split_header(script.raw)[0])


def test_every_helper_is_included_somewhere() -> None:
    helpers = {f"lib/{path.name}" for path in (LUA_DIR / "lib").glob("*.lua")}
    included = {
        m.group(1) for name in SCRIPTS for m in re.finditer(r"^--@include (\S+)", get_script(name).raw, re.M)
    }
    assert helpers - included == set(), "helpers no script includes"


def test_script_names_cover_the_lua_directory() -> None:
    assert SCRIPTS == sorted(path.stem for path in LUA_DIR.glob("*.lua"))
    assert SCRIPTS, "no scripts found"
