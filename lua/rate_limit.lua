--[[ rate_limit
Sets or removes the rate limiter of a ring (tdstore/replay/rate_limit.py, lua/lib/rate.lua),
as one step. Setting it starts its counts at 0 and marks the meta hash ("lim"), which every
append reads: an append then counts its rows against the limiter in its reserve step
(lua/reserve.lua), and an armed connection (one packet appends, tdstore/_backend/append.py)
WATCHing the meta hash is disarmed. The limiter's hash gets the store's expiry.

KEYS[1]   meta hash of the store (layout version "lv", expiry "exp")
KEYS[2]   the rate limiter's hash

ARGV[1]   "set" or "clear"
ARGV[2]   "set": the minimum size to sample (a count)
ARGV[3]   "set": samples per insert (a positive number)
ARGV[4]   "set": the lowest inserts * spi - samples a sample may leave
ARGV[5]   "set": the highest inserts * spi - samples an insert may leave
ARGV[6]   "set": the timeout of a wait in ms, or "" for none

Returns: 1

Errors:
  TDS_NOSTORE  the store does not exist
  TDS_BADARG   a setting is malformed
]]
--@include lib/common.lua

local meta = rcall('HMGET', KEYS[1], 'lv', 'exp')
if not meta[1] then
  return fail('TDS_NOSTORE', 'no store at ' .. KEYS[1])
end
if ARGV[1] == 'clear' then
  rcall('DEL', KEYS[2])
  rcall('HDEL', KEYS[1], 'lim')
  return 1
end
if ARGV[1] ~= 'set' or #ARGV ~= 6 then
  return fail('TDS_BADARG', 'expected "set" and five settings, or "clear"')
end
local min, spi, lo, hi = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if min == nil or spi == nil or lo == nil or hi == nil or min ~= min or spi ~= spi or lo ~= lo or hi ~= hi
    or min < 0 or min ~= math.floor(min) or min > 9007199254740992 or spi <= 0 or lo > hi
    or (ARGV[6] ~= '' and not string.match(ARGV[6], '^%d+$')) then
  return fail('TDS_BADARG', 'malformed rate limiter settings')
end
rcall('DEL', KEYS[2])
rcall('HSET', KEYS[2], 'min', ARGV[2], 'spi', ARGV[3], 'lo', ARGV[4], 'hi', ARGV[5], 'to', ARGV[6], 'ins', '0', 'smp', '0')
if meta[2] then rcall('PEXPIREAT', KEYS[2], meta[2]) end
rcall('HSET', KEYS[1], 'lim', '1')
return 1
