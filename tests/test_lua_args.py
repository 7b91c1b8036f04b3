"""lua/lib/common.lua's ``iarg`` on every backend: a whole number passed to ``redis.call`` as
a Lua number (Lua 5.1) or formatted with %d (Lua 5.4 floats, 1e15 and past) reaches the
server as its exact digits, so an offset or a count is never rounded or written "3.0"."""

from __future__ import annotations

import pytest

from tdstore._backend import scripts as _scripts

pytestmark = pytest.mark.lua

#: (the common helpers, then a body that INCRBYs KEYS[1] by each ARGV as iarg gives it, and
#: by the same value as a float where the Lua has an integer subtype)
_BODY = """
local out = {}
for i = 1, #ARGV do
  local x = tonumber(ARGV[i])
  rcall('SET', KEYS[1], '0')
  rcall('INCRBY', KEYS[1], iarg(x))
  out[#out + 1] = rcall('GET', KEYS[1])
  rcall('SET', KEYS[1], '0')
  rcall('INCRBY', KEYS[1], iarg(x + 0.0))
  out[#out + 1] = rcall('GET', KEYS[1])
end
rcall('DEL', KEYS[1])
return out
"""

VALUES = [0, 1, 7, 1023, 2**31 + 5, 2**32 + 1, 10**15 - 1, 10**15, 10**15 + 3, 2**53 - 1, -1, -(2**33) - 7, -(10**15) - 1]


def _source() -> str:
    common = (_scripts._lua_dir() / "lib" / "common.lua").read_text()
    return _scripts._ANY_HEADER_RE.sub("", common, count=1) + _BODY


def test_iarg_passes_whole_numbers_exactly(server):
    client = server.sync_client()
    try:
        key = "{tds-test-iarg}:n"
        got = client.eval(_source(), 1, key, *map(str, VALUES))
        assert [int(v) for v in got] == [v for v in VALUES for _ in range(2)]
        assert client.exists(key) == 0
    finally:
        client.close()
