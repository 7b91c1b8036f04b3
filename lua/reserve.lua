--[[ reserve
Reserves rows of a ring buffer for one append, the first of its two steps (the second, a
MULTI of the rows' SETRANGEs, is sent by the client: see tdstore/_backend/append.py). No
row byte passes through this script.

It checks the layout version (and, when given, that every data key exists with its full
size), advances the cursor by n, records the reservation as in flight, and clears the rows' "written"
flags, so that sample() stops drawing them until the client's MULTI writes the rows and
sets their flags again. A reservation whose rows the new one would overlap (its appender
is slow, or died between the two steps, and the ring came round) is taken over: it is
dropped from the in-flight hash and the fence counter is bumped. Every appender WATCHes
the fence between its two steps, so the dropped one's MULTI is aborted and never writes
rows that are now another appender's; it then finds its reservation gone and reserves
new rows.

KEYS[1]   meta hash of the store (layout version "lv", expiry "exp")
KEYS[2]   ring cursor: rows ever reserved (a string key)
KEYS[3]   row flags: one byte per row, 1 when the row holds a whole appended row
KEYS[4]   in-flight hash: reservation id -> "cursor:n:capacity"
KEYS[5]   fence counter, bumped when a reservation is taken over
KEYS[6..] optional: the data keys of each entry written, in the order of the ARGV groups:
          its one key, or its chunks in order (a chunked entry, see tdstore/_core/chunks.py)

ARGV[1]   expected layout version (decimal string)
ARGV[2]   number of rows n (1 <= n <= capacity)
ARGV[3]   capacity: the size of the first batch dim
ARGV[4]   reservation id (the client's, unique)
ARGV[5]   "new": reserve n rows; "keep": the reservation ARGV[4] was made before (its
          MULTI was aborted by a layout change or the fence): check it again under the
          current layout, without moving the cursor
ARGV[6..] optional: one pair per entry: the bytes of one row, the bytes of one chunk ("0"
          for an entry kept in one key). The client sends the data keys and these pairs
          when it re-plans ("keep"). A first reserve goes without them: the checks cost
          the server more than the rest of the script, and the write finds a key that
          went missing anyway (each SETRANGE replies with its key's new length, short
          for a key it created)

A store with an expiry (meta field "exp") gives the keys this script writes that expiry.

Returns: {the cursor value the rows start at (the rows are (start + i) % capacity),
          the store's expiry "exp" or ""}; the start is -1 when "keep" finds the
          reservation taken over (or made for other rows): the client reserves anew

Errors:
  TDS_NOSTORE  the store does not exist
  TDS_STALE    the layout version differs from ARGV[1]
  TDS_NOENTRY  a data key is missing
  TDS_RANGE    a data key is shorter than capacity rows (or than its chunk)
  TDS_BADARG   n, capacity or a group is malformed
]]
--@include lib/common.lua

-- (check_layout of lib/common.lua, with the expiry read in the same call)
local meta = rcall('HMGET', KEYS[1], 'lv', 'exp')
if not meta[1] then
  return fail('TDS_NOSTORE', 'no store at ' .. KEYS[1])
end
if meta[1] ~= ARGV[1] then
  return fail('TDS_STALE', 'layout version is ' .. meta[1] .. ', client assumed ' .. ARGV[1])
end
local exp = meta[2] or ''

local n = tonumber(ARGV[2])
local capacity = tonumber(ARGV[3])
-- n ~= n and the 2^53 bound reject nan and inf, which Lua 5.1's tonumber accepts
if n == nil or capacity == nil or n ~= n or capacity ~= capacity or capacity > 9007199254740992
    or n < 1 or n ~= math.floor(n) or capacity ~= math.floor(capacity) or n > capacity then
  return fail('TDS_BADARG', 'need 1 <= rows <= capacity, got ' .. tostring(ARGV[2]) .. ' and ' .. tostring(ARGV[3]))
end
local id, mode = ARGV[4], ARGV[5]
if id == nil or id == '' or string.find(id, ':', 1, true) or (mode ~= 'new' and mode ~= 'keep') then
  return fail('TDS_BADARG', 'expected a reservation id and "new" or "keep"')
end
if (#ARGV - 5) % 2 ~= 0 then
  return fail('TDS_BADARG', 'expected pairs of (row bytes, chunk bytes), got ' .. (#ARGV - 5) .. ' values')
end

local function count(value)
  local x = tonumber(value)
  if x == nil or x ~= x or x < 0 or x ~= math.floor(x) or x > 9007199254740992 then return nil end
  return x
end

-- every data key exists with its full size (a SETRANGE into a missing or short key would
-- create it zero-padded)
local next_key = 6
for g = 1, (#ARGV - 5) / 2 do
  local row_bytes, chunk = count(ARGV[4 + 2 * g]), count(ARGV[5 + 2 * g])
  if row_bytes == nil or chunk == nil then
    return fail('TDS_BADARG', 'group ' .. g .. ' is not a pair of byte counts')
  end
  local total = capacity * row_bytes
  local nkeys = 1
  if chunk > 0 then nkeys = math.max(1, math.ceil(total / chunk)) end
  if next_key + nkeys - 1 > #KEYS then
    return fail('TDS_BADARG', 'group ' .. g .. ' needs ' .. nkeys .. ' keys, fewer are left in KEYS')
  end
  for k = 0, nkeys - 1 do
    local key = KEYS[next_key + k]
    local size = rcall('STRLEN', key)
    if size == 0 and rcall('EXISTS', key) == 0 then
      return fail('TDS_NOENTRY', 'no data at ' .. key)
    end
    local want = total
    if chunk > 0 then want = math.min(chunk, total - k * chunk) end
    if size < want then
      return fail('TDS_RANGE', key .. ' holds ' .. int_str(size) .. ' bytes, less than ' .. int_str(want))
    end
  end
  next_key = next_key + nkeys
end
if next_key ~= #KEYS + 1 then
  return fail('TDS_BADARG', 'KEYS holds ' .. (#KEYS + 1 - next_key) .. ' keys that no group uses')
end

if mode == 'keep' then
  local held = rcall('HGET', KEYS[4], id)
  if not held then return {-1, exp} end
  local start, rows, cap = string.match(held, '^(%d+):(%d+):(%d+)$')
  if tonumber(rows) ~= n or tonumber(cap) ~= capacity then
    rcall('HDEL', KEYS[4], id)
    return {-1, exp}
  end
  return {tonumber(start), exp}
end

-- the last check: the INCRBY of the cursor is this script's first write (an INCRBY of a
-- key that is not an integer changes nothing)
local moved = redis.pcall('INCRBY', KEYS[2], int_str(n))
if type(moved) ~= 'number' or moved < n then
  if type(moved) == 'number' then rcall('INCRBY', KEYS[2], int_str(-n)) end
  return fail('TDS_BADARG', 'the cursor of ' .. KEYS[1] .. ' is not a row count')
end
local cursor = moved - n

-- a ring appended to before the flags existed (or whose cursor was set by the client):
-- its first min(cursor, capacity) rows count as written
if cursor > 0 and rcall('EXISTS', KEYS[3]) == 0 then
  rcall('SETRANGE', KEYS[3], '0', string.rep('\1', math.min(cursor, capacity)))
end

-- take over the reservations in flight whose rows these would overlap
local start = cursor % capacity
local fenced = false
local held = rcall('HGETALL', KEYS[4])
for i = 1, #held, 2 do
  local s, rows, cap = string.match(held[i + 1], '^(%d+):(%d+):(%d+)$')
  s, rows = tonumber(s), tonumber(rows)
  -- (a malformed or other-capacity entry is dropped too: it can never be written)
  if s == nil or tonumber(cap) ~= capacity or (s - start) % capacity < n or (start - s) % capacity < rows then
    rcall('HDEL', KEYS[4], held[i])
    fenced = true
  end
end
if fenced then rcall('INCR', KEYS[5]) end
rcall('HSET', KEYS[4], id, int_str(cursor) .. ':' .. int_str(n) .. ':' .. int_str(capacity))

-- clear the flags of the rows (SETRANGE pads a new key with zeros: unflagged)
local first = math.min(n, capacity - start)
rcall('SETRANGE', KEYS[3], int_str(start), string.rep('\0', first))
if first < n then
  rcall('SETRANGE', KEYS[3], '0', string.rep('\0', n - first))
end
if exp ~= '' then
  for k = 2, 5 do
    if rcall('EXISTS', KEYS[k]) == 1 then rcall('PEXPIREAT', KEYS[k], exp) end
  end
end
return {cursor, exp}
