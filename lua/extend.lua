--[[ extend
Appends rows to a ring buffer as one step: reserves them through the store's cursor and
writes every entry's rows in the same script, so concurrent appenders never get the same
rows and a reader never sees a reserved but unwritten row.

KEYS[1]   meta hash of the store
KEYS[2]   write-version counter of the store (bumped once; the meta hash also counts the
          appends in field "ac", and those into each sub-store in field "a:" .. its path
          (see ARGV[last]), so that a compare-and-set can tell the appends that wrote its
          entries from those that did not: see ARGV[10] of commit.lua)
KEYS[3]   ring cursor of the store: rows ever appended (a string key)
KEYS[4..] the data keys of each entry written, in the order of the ARGV groups: its one
          key, or its chunks in order (a chunked entry, see tdstore/_chunks.py)

ARGV[1]   expected layout version (decimal string)
ARGV[2]   number of rows n appended (1 <= n <= capacity)
ARGV[3]   capacity: the size of the first batch dim
ARGV[4..] one group per entry: the bytes of one row, the bytes of one chunk ("0" for an
          entry kept in one key), then the payload of n rows. A chunked entry of
          capacity * row bytes has ceil(that / chunk bytes) keys, each a full chunk but
          the last.
ARGV[last] optional, after the groups: "a:" .. the path of the sub-store appended to, as
          a registry field ("a:" for the root). With it, the append is counted in the
          meta fields "ac" and ARGV[last]; without it, the write version alone tells, and
          every compare-and-set conflicts with the append

A store with an expiry (meta field "exp", see expire.lua) gives the cursor and the counter
that same expiry (SET drops a key's TTL).

Returns: the cursor before the append (integer); the rows written are
         (cursor + i) % capacity for i = 0 .. n-1

Errors:
  TDS_NOSTORE  the store does not exist
  TDS_STALE    the layout version differs from ARGV[1]
  TDS_NOENTRY  a data key is missing
  TDS_RANGE    a data key is shorter than capacity rows (or than its chunk)
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
local nargs = #ARGV
local counter = false
if (nargs - 3) % 3 == 1 and string.sub(ARGV[nargs], 1, 2) == 'a:' then
  counter = ARGV[nargs]
  nargs = nargs - 1
end
if (nargs - 3) % 3 ~= 0 then
  return fail('TDS_BADARG', 'expected groups of (row bytes, chunk bytes, payload), got ' .. (nargs - 3) .. ' values')
end

local function count(value)
  local x = tonumber(value)
  if x == nil or x ~= x or x < 0 or x ~= math.floor(x) or x > 9007199254740992 then return nil end
  return x
end

-- validate every group before the first write; groups[g] = {row bytes, chunk bytes, payload,
-- first key, number of keys}. First the arguments alone, then the keys.
local groups = {}
local next_key = 4
for g = 1, (nargs - 3) / 3 do
  local row_bytes, chunk, payload = count(ARGV[3 * g + 1]), count(ARGV[3 * g + 2]), ARGV[3 * g + 3]
  if next_key > #KEYS then
    return fail('TDS_BADARG', 'group ' .. g .. ' has no key left in KEYS')
  end
  if row_bytes == nil or chunk == nil or #payload ~= n * row_bytes then
    return fail('TDS_BADARG', 'payload of ' .. KEYS[next_key] .. ' does not hold ' .. int_str(n) .. ' rows')
  end
  local nkeys = 1
  if chunk > 0 then nkeys = math.max(1, math.ceil(capacity * row_bytes / chunk)) end
  if next_key + nkeys - 1 > #KEYS then
    return fail('TDS_BADARG', 'group ' .. g .. ' needs ' .. nkeys .. ' keys, fewer are left in KEYS')
  end
  groups[g] = {row_bytes, chunk, payload, next_key, nkeys}
  next_key = next_key + nkeys
end
if next_key ~= #KEYS + 1 then
  return fail('TDS_BADARG', 'KEYS holds ' .. (#KEYS + 1 - next_key) .. ' keys that no group uses')
end
for _, group in ipairs(groups) do
  local row_bytes, chunk, key0, nkeys = group[1], group[2], group[4], group[5]
  local total = capacity * row_bytes
  for k = 0, nkeys - 1 do
    local key = KEYS[key0 + k]
    local size = rcall('STRLEN', key)
    if size == 0 and rcall('EXISTS', key) == 0 then
      return fail('TDS_NOENTRY', 'no data at ' .. key)
    end
    if chunk == 0 and size < total then
      return fail('TDS_RANGE', key .. ' holds ' .. int_str(size) .. ' bytes, less than ' .. int_str(capacity) .. ' rows')
    end
    if chunk > 0 and size < math.min(chunk, total - k * chunk) then
      return fail('TDS_RANGE', key .. ' holds ' .. int_str(size) .. ' bytes, less than its chunk of ' .. int_str(math.min(chunk, total - k * chunk)))
    end
  end
end

local cursor = tonumber(rcall('GET', KEYS[3]) or '0')
if cursor == nil or cursor < 0 or cursor ~= math.floor(cursor) then
  return fail('TDS_BADARG', 'the cursor of ' .. KEYS[1] .. ' is not a row count')
end
local start = cursor % capacity
local first = math.min(n, capacity - start)

-- writes bytes [from, from + #data) of an entry: one SETRANGE, or one per chunk crossed
local function put(group, from, data)
  local chunk, key0 = group[2], group[4]
  if chunk == 0 then
    rcall('SETRANGE', KEYS[key0], int_str(from), data)
    return
  end
  local done = 0
  while done < #data do
    local at = from + done
    local k = math.floor(at / chunk)
    local local_at = at - k * chunk
    local len = math.min(#data - done, chunk - local_at)
    if done == 0 and len == #data then
      rcall('SETRANGE', KEYS[key0 + k], int_str(local_at), data)
    else
      rcall('SETRANGE', KEYS[key0 + k], int_str(local_at), string.sub(data, done + 1, done + len))
    end
    done = done + len
  end
end

for _, group in ipairs(groups) do
  local row_bytes, payload = group[1], group[3]
  if row_bytes > 0 then
    if first == n then
      put(group, start * row_bytes, payload)
    else
      put(group, start * row_bytes, string.sub(payload, 1, first * row_bytes))
      put(group, 0, string.sub(payload, first * row_bytes + 1))
    end
  end
end
rcall('SET', KEYS[3], int_str(cursor + n))
rcall('INCR', KEYS[2])
if counter then
  rcall('HINCRBY', KEYS[1], 'ac', 1)
  rcall('HINCRBY', KEYS[1], counter, 1)
end
local exp = rcall('HGET', KEYS[1], 'exp')
if exp and exp ~= '' then
  rcall('PEXPIREAT', KEYS[3], exp)
  rcall('PEXPIREAT', KEYS[2], exp)
end
return cursor
