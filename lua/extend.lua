--[[ extend
Appends rows to a ring buffer as one step: reserves them through the store's cursor and
writes every entry's rows in the same script, so concurrent appenders never get the same
rows and a reader never sees a reserved but unwritten row.

KEYS[1]   meta hash of the store
KEYS[2]   write-version counter of the store (bumped once)
KEYS[3]   ring cursor of the store: rows ever appended (a string key)
KEYS[4..] the data key of each entry written, in the order of the ARGV groups

ARGV[1]   expected layout version (decimal string)
ARGV[2]   number of rows n appended (1 <= n <= capacity)
ARGV[3]   capacity: the size of the first batch dim
ARGV[4..] one group per data key: the bytes of one row, then the payload of n rows

A store with an expiry (meta field "exp", see expire.lua) gives the cursor and the counter
that same expiry (SET drops a key's TTL).

Returns: the cursor before the append (integer); the rows written are
         (cursor + i) % capacity for i = 0 .. n-1

Errors:
  TDS_NOSTORE  the store does not exist
  TDS_STALE    the layout version differs from ARGV[1]
  TDS_NOENTRY  a data key is missing
  TDS_RANGE    a data key is shorter than capacity rows
  TDS_BADARG   n, capacity or a group is malformed
]]
--@include lib/common.lua

local err = check_layout(KEYS[1], ARGV[1])
if err then return err end

local n = tonumber(ARGV[2])
local capacity = tonumber(ARGV[3])
-- n ~= n and the 2^53 bound reject nan and inf, which Lua 5.1's tonumber accepts
if n == nil or capacity == nil or n ~= n or capacity ~= capacity or capacity > 9007199254740992
    or n < 1 or n ~= math.floor(n) or capacity ~= math.floor(capacity) or n > capacity then
  return fail('TDS_BADARG', 'need 1 <= rows <= capacity, got ' .. tostring(ARGV[2]) .. ' and ' .. tostring(ARGV[3]))
end
if #ARGV ~= 3 + 2 * (#KEYS - 3) then
  return fail('TDS_BADARG', 'expected ' .. (#KEYS - 3) .. ' groups of (row bytes, payload)')
end

-- validate every group before the first write
for k = 4, #KEYS do
  local row_bytes = tonumber(ARGV[2 * k - 4])
  local payload = ARGV[2 * k - 3]
  if row_bytes == nil or row_bytes < 0 or row_bytes ~= math.floor(row_bytes) or #payload ~= n * row_bytes then
    return fail('TDS_BADARG', 'payload of ' .. KEYS[k] .. ' does not hold ' .. int_str(n) .. ' rows')
  end
  local size = rcall('STRLEN', KEYS[k])
  if size == 0 and rcall('EXISTS', KEYS[k]) == 0 then
    return fail('TDS_NOENTRY', 'no data at ' .. KEYS[k])
  end
  if size < capacity * row_bytes then
    return fail('TDS_RANGE', KEYS[k] .. ' holds ' .. int_str(size) .. ' bytes, less than ' .. int_str(capacity) .. ' rows')
  end
end

local cursor = tonumber(rcall('GET', KEYS[3]) or '0')
if cursor == nil or cursor < 0 or cursor ~= math.floor(cursor) then
  return fail('TDS_BADARG', 'the cursor of ' .. KEYS[1] .. ' is not a row count')
end
local start = cursor % capacity
local first = math.min(n, capacity - start)
for k = 4, #KEYS do
  local row_bytes = tonumber(ARGV[2 * k - 4])
  local payload = ARGV[2 * k - 3]
  if row_bytes > 0 then
    if first == n then
      rcall('SETRANGE', KEYS[k], int_str(start * row_bytes), payload)
    else
      rcall('SETRANGE', KEYS[k], int_str(start * row_bytes), string.sub(payload, 1, first * row_bytes))
      rcall('SETRANGE', KEYS[k], '0', string.sub(payload, first * row_bytes + 1))
    end
  end
end
rcall('SET', KEYS[3], int_str(cursor + n))
rcall('INCR', KEYS[2])
local exp = rcall('HGET', KEYS[1], 'exp')
if exp and exp ~= '' then
  rcall('PEXPIREAT', KEYS[3], exp)
  rcall('PEXPIREAT', KEYS[2], exp)
end
return cursor
