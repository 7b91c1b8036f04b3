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
ARGV[3]   optional: the sample's token, 16 lowercase hex digits, the same on every try of one
          sample. A token among the last 64 counted ("tok" of the limiter's hash) is not
          counted again: a try whose reply was lost, sent again, counts the sample once

Returns: {1, ""} when the sample was counted (or its token was, by an earlier try); {0, the limiter's timeout in ms or ""} when
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

local TOKEN_BYTES, TOKENS_KEPT = 16, 64

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
local token = ARGV[3] or ''
if token ~= '' and not string.match(token, '^' .. string.rep('[0-9a-f]', TOKEN_BYTES) .. '$') then
  return fail('TDS_BADARG', 'a sample token is ' .. TOKEN_BYTES .. ' lowercase hex digits, got ' .. string.format('%q', string.sub(token, 1, 40)))
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
-- the tokens counted last, TOKEN_BYTES each, newest last (anything else there: none)
local tokens = ''
if token ~= '' then
  tokens = redis.pcall('HGET', KEYS[3], 'tok')
  if type(tokens) ~= 'string' or #tokens > TOKENS_KEPT * TOKEN_BYTES or #tokens % TOKEN_BYTES ~= 0 then
    tokens = ''
  end
  local at = 1
  while true do
    local found = string.find(tokens, token, at, true)
    if not found then break end
    if (found - 1) % TOKEN_BYTES == 0 then return {1, ''} end
    at = found + 1
  end
end
if not rate_can_sample(r, size, n) then
  return {0, r.to}
end
rcall('HINCRBY', KEYS[3], 'smp', int_str(n))
if token ~= '' then
  tokens = tokens .. token
  if #tokens > TOKENS_KEPT * TOKEN_BYTES then tokens = string.sub(tokens, TOKEN_BYTES + 1) end
  rcall('HSET', KEYS[3], 'tok', tokens)
end
return {1, ''}
