--[[ rate_sample
Counts a sample of n rows against the ring's rate limiter, if the limiter allows it (see
lua/lib/rate.lua and tdstore/replay/rate_limit.py): the check and the count are one step, so
samplers in any number of processes never take more than the limiter allows between them.
No row is read here: the client draws and reads the rows after this script counted them.

KEYS[1]   meta hash of the store (layout version "lv", "lim" when a limiter is set)
KEYS[2]   ring cursor: rows ever reserved (a string key)
KEYS[3]   the rate limiter's hash

ARGV[1]   n, the rows to sample (1 <= n)
ARGV[2]   capacity: the size of the first batch dim (the ring holds min(cursor, capacity) rows)

Returns: {1, ""} when the sample was counted; {0, the limiter's timeout in ms or ""} when
         the limiter holds it back (nothing changed: wait and call again); {-1, ""} when the
         store has no limiter

Errors:
  TDS_NOSTORE  the store does not exist
  TDS_BADARG   n or the capacity is not a count
  TDS_CORRUPT  the limiter's hash or the cursor is damaged (another type, a value no tdstore
               write makes)
]]
--@include lib/common.lua
--@include lib/rate.lua

local meta = rcall('HMGET', KEYS[1], 'lv', 'lim')
if not meta[1] then
  return fail('TDS_NOSTORE', 'no store at ' .. KEYS[1])
end
local n, capacity = tonumber(ARGV[1]), tonumber(ARGV[2])
if n == nil or capacity == nil or n ~= n or capacity ~= capacity or n < 1 or capacity < 1
    or n ~= math.floor(n) or capacity ~= math.floor(capacity) or n > 9007199254740992
    or capacity > 9007199254740992 then
  return fail('TDS_BADARG', 'need rows >= 1 and capacity >= 1, got ' .. tostring(ARGV[1]) .. ' and ' .. tostring(ARGV[2]))
end
if not meta[2] then return {-1, ''} end
local r, err = rate_read(KEYS[3])
if err then return err end
if not r then return {-1, ''} end
local raw_cursor = redis.pcall('GET', KEYS[2])
if type(raw_cursor) == 'table' or (raw_cursor and not string.match(raw_cursor, '^%d+$')) then
  return fail('TDS_CORRUPT', 'the ring cursor ' .. KEYS[2] .. ' of ' .. KEYS[1] .. ' is not a row count')
end
local size = math.min(tonumber(raw_cursor or '0'), capacity)
if not rate_can_sample(r, size, n) then
  return {0, r.to}
end
rcall('HINCRBY', KEYS[3], 'smp', int_str(n))
return {1, ''}
