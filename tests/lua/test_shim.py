"""The shim itself: the Redis semantics the script tests rely on."""

from __future__ import annotations

import pytest

from tdstore.errors import LUA_ERRORS

from .shim import (
    LUA_VERSIONS,
    LuaRedis,
    LuaRuntimeError,
    LuaScriptError,
    RedisCommandError,
    Status,
    UnsupportedCommand,
    VirtualString,
    lua_number_arg,
    tdstore_error,
)

pytestmark = pytest.mark.lua


@pytest.fixture(params=LUA_VERSIONS, ids=[f"lua{v}" for v in LUA_VERSIONS])
def lua_version(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.parametrize("offset", [b"3.0", b"3e0", b" 3", b"3 ", b"+3", b"03", b"-0", b"", b"x", b"9223372036854775808"])
def test_setrange_rejects_what_redis_rejects(offset: bytes) -> None:
    r = LuaRedis()
    with pytest.raises(RedisCommandError, match="^ERR value is not an integer or out of range$"):
        r.call("SETRANGE", "k", offset, "x")
    assert r.data == {}


def test_setrange_semantics() -> None:
    r = LuaRedis()
    with pytest.raises(RedisCommandError, match="^ERR offset is out of range$"):
        r.call("SETRANGE", "k", "-1", "x")
    assert r.call("SETRANGE", "k", "5", "") == 0 and r.data == {}
    assert r.call("SETRANGE", "k", "3", "ab") == 5 and r.data[b"k"] == b"\0\0\0ab"
    assert r.call("SETRANGE", "k", "0", "") == 5
    assert r.call("SETRANGE", "k", "1", "Z") == 5 and r.data[b"k"] == b"\0Z\0ab"
    with pytest.raises(RedisCommandError, match="proto-max-bulk-len"):
        r.call("SETRANGE", "k", str(512 * 1024 * 1024), "x")
    r.call("HSET", "h", "f", "v")
    with pytest.raises(RedisCommandError, match="^WRONGTYPE"):
        r.call("SETRANGE", "h", "0", "x")


def test_virtual_strings() -> None:
    r = LuaRedis(proto_max_bulk_len=1 << 40, virtual_strlen={"v": 10_000_000_000})
    assert r.call("STRLEN", "v") == 10_000_000_000
    assert r.call("SETRANGE", "v", "9000000000", "ab") == 10_000_000_000
    assert r.call("GETRANGE", "v", "8999999999", "9000000002") == b"\0ab\0"
    assert r.data[b"v"] == VirtualString(10_000_000_000, [(9_000_000_000, b"ab")])
    grown = LuaRedis(proto_max_bulk_len=1 << 40, virtual_above=100)
    grown.call("SET", "k", "xy")
    grown.call("SETRANGE", "k", "1000", "z")
    assert grown.data[b"k"] == VirtualString(1001, [(0, b"xy"), (1000, b"z")])


def test_number_arguments_are_formatted_like_the_server() -> None:
    assert lua_number_arg(3, "5.1") == b"3"
    assert lua_number_arg(3.0, "5.1") == b"3"
    assert lua_number_arg(3e9, "5.1") == b"3000000000"
    assert lua_number_arg(0.1, "5.1") == b"0.10000000000000001"
    assert lua_number_arg(1e20, "5.1") == b"1e+20"
    assert lua_number_arg(3, "5.4") == b"3"
    assert lua_number_arg(3.0, "5.4") == b"3.0"
    assert lua_number_arg(3e9, "5.4") == b"3000000000.0"
    assert lua_number_arg(2.0**53, "5.4") == b"9.007199254741e+15"
    assert lua_number_arg(-0.5, "5.4") == b"-0.5"


def test_number_arguments_inside_scripts(lua_version: str) -> None:
    r = LuaRedis()
    r.eval("redis.call('SET', 'i', 3) redis.call('SET', 'f', 3.0) redis.call('SET', 'h', 1.5)", [], [], lua_version)
    assert r.data == {b"i": b"3", b"f": b"3" if lua_version == "5.1" else b"3.0", b"h": b"1.5"}
    if lua_version == "5.4":  # a float offset is refused exactly as Redis refuses "3.0"
        with pytest.raises(RedisCommandError, match="not an integer"):
            r.eval("return redis.call('SETRANGE', 'k', 3.0, 'x')", [], [], lua_version)
    with pytest.raises(RedisCommandError, match="must be strings or integers"):
        r.eval("return redis.call('SET', 'k', true)", [], [], lua_version)
    with pytest.raises(RedisCommandError, match="must be strings or integers"):
        r.eval("return redis.call('SET', 'k', nil)", [], [], lua_version)


def test_replies_reach_lua_redis_style(lua_version: str) -> None:
    r = LuaRedis()
    r.call("HSET", "h", "a", "1")
    src = (
        "return {redis.call('GET', 'nope') == false, redis.call('HGET', 'h', 'zz') == false,"
        " redis.call('HMGET', 'h', 'a', 'zz')[2] == false, redis.call('SET', 'k', 'v').ok,"
        " redis.call('TYPE', 'h').ok, type(redis.call('HLEN', 'h')), redis.call('EXISTS', 'h', 'h', 'x')}"
    )
    assert r.eval(src, [], [], lua_version) == [1, 1, 1, b"OK", b"hash", b"number", 2]


def test_results_reach_the_client_redis_style(lua_version: str) -> None:
    r = LuaRedis()
    assert r.eval("return 3.9", [], [], lua_version) == 3
    assert r.eval("return -3.9", [], [], lua_version) == -3
    assert r.eval("return {1, 'x', {2.5, false}, nil, 5}", [], [], lua_version) == [1, b"x", [2, None]]
    assert r.eval("return true", [], [], lua_version) == 1
    assert r.eval("return false", [], [], lua_version) is None
    assert r.eval("return nil", [], [], lua_version) is None
    assert r.eval("return redis.status_reply('FINE')", [], [], lua_version) == b"FINE"
    assert r.eval("return KEYS[2] .. ARGV[1]", [b"k1", b"\x00\xff"], [b"\x01"], lua_version) == b"\x00\xff\x01"


def test_errors(lua_version: str) -> None:
    r = LuaRedis()
    with pytest.raises(LuaScriptError) as info:
        r.eval("return redis.error_reply('TDS_STALE layout version is 3, client assumed 2')", [], [], lua_version)
    assert info.value.message == "TDS_STALE layout version is 3, client assumed 2"
    assert info.value.code == "TDS_STALE"
    with pytest.raises(LuaRuntimeError, match="TDS_LOCKED raised"):
        r.eval("error('TDS_LOCKED raised')", [], [], lua_version)
    with pytest.raises(RedisCommandError, match="^ERR no such key$"):
        r.eval("return redis.call('RENAME', 'a', 'b')", [], [], lua_version)
    assert r.eval("return redis.pcall('RENAME', 'a', 'b').err", [], [], lua_version) == b"ERR no such key"
    with pytest.raises(UnsupportedCommand, match="KEYS"):
        r.eval("return redis.pcall('KEYS', '*')", [], [], lua_version)
    with pytest.raises(RedisCommandError, match="wrong number of arguments for 'hset'"):
        r.eval("return redis.call('HSET', 'h', 'f')", [], [], lua_version)


def test_sandbox(lua_version: str) -> None:
    r = LuaRedis()
    with pytest.raises(LuaRuntimeError, match="create global variable 'x'"):
        r.eval("x = 1", [], [], lua_version)
    for lib in ("os", "io", "require", "struct", "bit", "cmsgpack"):
        src = f"return {lib} == nil"
        if lua_version == "5.1":  # Redis 5.1 refuses to read a global that does not exist
            with pytest.raises(LuaRuntimeError, match="nonexistent global"):
                r.eval(src, [], [], lua_version)
        else:
            assert r.eval(src, [], [], lua_version) == 1


def test_cjson(lua_version: str) -> None:
    r = LuaRedis()
    text = '{"a":[1,2.5,"x\\u00e9",null,true],"b":{}}'
    out = r.eval(
        "local v = cjson.decode(ARGV[1])"
        " return {v.a[3], tostring(v.a[1]), cjson.encode(v.a), v.a[4] == cjson.null, cjson.encode({})}",
        [], [text], lua_version,
    )
    number = b"1" if lua_version == "5.1" else b"1.0"  # integral JSON numbers decode to floats on 5.4
    assert out == [b"x\xc3\xa9", number, b'[1,2.5,"x\xc3\xa9",null,true]', 1, b"{}"]
    assert LuaRedis(json_integers=True).eval("return tostring(cjson.decode('[1]')[1])", [], [], lua_version) == b"1"
    with pytest.raises(LuaRuntimeError):
        r.eval("return cjson.decode('{bad')", [], [], lua_version)


def test_keyspace_commands() -> None:
    r = LuaRedis()
    assert r.call("SET", "t", "v", "PX", "500") == Status(b"OK") and r.ttls == {b"t": 500}
    assert r.call("RENAME", "t", "u") == Status(b"OK") and r.ttls == {b"u": 500} and r.data == {b"u": b"v"}
    assert r.call("PERSIST", "u") == 1 and r.call("PERSIST", "u") == 0 and r.ttls == {}
    assert r.call("EXPIRE", "u", "2") == 1 and r.ttls == {b"u": 2000}
    assert r.call("SET", "u", "w") == Status(b"OK") and r.ttls == {}
    assert r.call("SET", "u", "x", "NX") is None and r.call("GET", "u") == b"w"
    assert r.call("HSET", "h", "a", "1", "b", "2") == 2 and r.call("HSET", "h", "a", "3") == 0
    assert r.call("HGETALL", "h") == [b"a", b"3", b"b", b"2"]
    assert r.call("HINCRBY", "h", "a", "4") == 7 and r.call("HINCRBY", "h", "n", "-1") == -1
    with pytest.raises(RedisCommandError, match="hash value is not an integer"):
        r.call("HSET", "h", "s", "x")
        r.call("HINCRBY", "h", "s", "1")
    assert r.call("HDEL", "h", "a", "b", "n", "s", "zz") == 4 and b"h" not in r.data
    assert r.call("DEL", "u", "u", "nope") == 1
    assert r.call("GETRANGE", "nope", "0", "-1") == b""
    r.call("SET", "s", "0123456789")
    assert r.call("GETRANGE", "s", "-3", "-1") == b"789" and r.call("GETRANGE", "s", "5", "100") == b"56789"


def test_incr_and_plain_string_keys(lua_version: str) -> None:
    r = LuaRedis()
    assert r.call("INCR", "c") == 1 and r.data[b"c"] == b"1"
    assert r.call("INCR", "c") == 2 and r.call("GET", "c") == b"2"
    r.call("SET", "t", "41", "PX", "500")
    assert r.call("INCR", "t") == 42 and r.ttls == {b"t": 500}, "INCR keeps the TTL"
    for bad in (b"x", b"1.5", b" 1", b"+1", b"01", b"", b"9223372036854775808"):
        r.data[b"b"] = bad
        with pytest.raises(RedisCommandError, match="^ERR value is not an integer or out of range$"):
            r.call("INCR", "b")
        assert r.data[b"b"] == bad
    r.data[b"b"] = b"9223372036854775807"
    with pytest.raises(RedisCommandError, match="^ERR increment or decrement would overflow$"):
        r.call("INCR", "b")
    r.data[b"b"] = b"-5"
    assert r.call("INCR", "b") == -4
    r.call("HSET", "h", "f", "1")
    with pytest.raises(RedisCommandError, match="^WRONGTYPE"):
        r.call("INCR", "h")
    with pytest.raises(RedisCommandError, match="wrong number of arguments for 'incr'"):
        r.call("INCR", "c", "2")
    src = "local n = redis.call('INCR', KEYS[1]) return {n, type(n), redis.call('GET', KEYS[1]), redis.call('GET', KEYS[2])}"
    assert r.eval(src, ["c", "missing"], [], lua_version) == [3, b"number", b"3", None]


@pytest.mark.parametrize("code", sorted(LUA_ERRORS))
def test_tdstore_error_maps_every_code(code: str) -> None:
    exc = tdstore_error(LuaScriptError(f"{code} something happened"))
    assert type(exc) is LUA_ERRORS[code]
    assert str(exc) == "something happened"
