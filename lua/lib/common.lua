--[[ lib/common
Helpers shared by the scripts; _scripts.py inlines this file where a script says
"--@include lib/common.lua". Valid on Lua 5.1 (Redis, Valkey, KeyDB) and 5.4 (Dragonfly).
]]
local rcall = redis.call
local unpack = unpack or table.unpack

-- Integers are formatted with %d: tostring() would give "3.0" on Lua 5.4 and "%.14g"
-- rounding on Lua 5.1, and both would corrupt a SETRANGE offset.
local function int_str(x)
  return string.format('%d', x)
end

-- A whole number as an argument of redis.call (an offset, a count), cheaply: as it is where
-- the server writes it exactly, else formatted with %d. Lua 5.1 (Redis, Valkey, KeyDB: no
-- math.type, every number a double): the server writes a number argument with %.17g (or the
-- shortest round trip), exact below 1e15; a string.format per bound cost a priority draw a
-- quarter of its server time. Lua 5.4 (Dragonfly): exact for the integer subtype, while a
-- float would go as "3.0".
local mtype = math.type  -- (read, not called: nil on Lua 5.1, where no value needs it)
local function iarg(x)
  if x < 1e15 and x > -1e15 and (mtype == nil or mtype(x) == 'integer') then return x end
  return string.format('%d', x)
end

local function fail(code, msg)
  return redis.error_reply(code .. ' ' .. msg)
end

-- Returns nil when the store's layout matches what the client assumed, an error reply
-- otherwise. expected: a decimal layout version, or '' to skip the check.
local function check_layout(meta_key, expected)
  local meta = rcall('HMGET', meta_key, 'lv', 'fmt')
  if not meta[1] then
    return fail('TDS_NOSTORE', 'no store at ' .. meta_key)
  end
  if expected ~= '' and meta[1] ~= expected then
    return fail('TDS_STALE', 'layout version is ' .. meta[1] .. ', client assumed ' .. expected)
  end
  return nil
end

-- Returns nil when ``key`` holds nothing or a decimal counter that INCR can bump, an error
-- reply (TDS_CORRUPT) otherwise: a script checks its counters before its first write, so a
-- counter damaged by hand refuses the write and changes nothing. ``v``: the key's value as
-- redis.pcall('GET') gave it, when the script has read it already.
local function check_counter(key, what, v)
  if v == nil then v = redis.pcall('GET', key) end
  if type(v) == 'table' and v.err then
    return fail('TDS_CORRUPT', what .. ' ' .. key .. ' is not a string')
  end
  if v and not (string.match(v, '^%-?%d+$') and #v <= 18) then
    return fail('TDS_CORRUPT', what .. ' ' .. key .. ' holds ' .. string.format('%q', string.sub(v, 1, 40))
      .. ', not a counter')
  end
  return nil
end
