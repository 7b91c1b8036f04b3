--[[ reserve
Reserves rows of a ring buffer for one append, the first of its two steps (the second, a
MULTI of the rows' SETRANGEs, is sent by the client: see tdstore/_backend/append.py). No
row byte passes through this script.

It checks the layout version (and, when given, that every data key exists with its full
size), advances the cursor by n and clears the rows' "written" flags, so that sample()
stops drawing them until the client's MULTI writes the rows and sets their flags again.

The flags are also the record of the appends in flight: a row reserved before (the ring
came round) whose flag is still clear was reserved by an append that has not written it
yet (it is slow, or died between its two steps). Its reservation is taken over: the fence
counter is bumped. Every appender WATCHes the fence between its two steps, so the slow
one's MULTI is aborted and never writes rows that are now another appender's; its "keep"
then finds the cursor more than a ring past its rows, and it reserves new ones.

KEYS[1]   meta hash of the store (layout version "lv", expiry "exp")
KEYS[2]   ring cursor: rows ever reserved (a string key)
KEYS[3]   row flags: one byte per row, 1 when the row holds a whole appended row
KEYS[4]   fence counter, bumped when a reservation in flight is taken over
KEYS[5]   write-version counter of the store: only checked here (the client's MULTI bumps it
          after the rows' SETRANGEs, which a server does not roll back, so a damaged one is
          refused before any row is written)
KEYS[6]   the rate limiter's hash (lua/lib/rate.lua), read when the meta hash says "lim":
          a "new" reservation the limiter holds back changes nothing and returns -2; one it
          allows is counted there
KEYS[7..] optional: the data keys of each entry written, in the order of the ARGV groups:
          its one key, or its chunks in order (a chunked entry, see tdstore/_core/chunks.py)

ARGV[1]   expected layout version (decimal string)
ARGV[2]   number of rows n (1 <= n <= capacity)
ARGV[3]   capacity: the size of the first batch dim
ARGV[4]   "new": reserve n rows; "keep": the rows reserved before at cursor ARGV[5] (the
          append's MULTI was aborted by a layout change or the fence): check them again
          under the current layout, without moving the cursor
ARGV[5]   "keep": the cursor value the reservation started at ("new": ignored)
ARGV[6]   "keep": the layout version the reservation was made under ("new": ignored). The
          store must be the same one: a layout change adds 1 to the version, and a store
          created anew starts at a random multiple of 1024 (see lua/commit.lua)
ARGV[7..] optional: one pair per entry: the bytes of one row, the bytes of one chunk ("0"
          for an entry kept in one key). The client sends the data keys and these pairs
          when it re-plans ("keep"). A first reserve goes without them: the checks cost
          the server more than the rest of the script, and the write finds a key that
          went missing anyway (each SETRANGE replies with its key's new length, short
          for a key it created)

A store with an expiry (meta field "exp") gives the keys this script writes that expiry.

Returns: {the cursor value the rows start at (the rows are (start + i) % capacity),
          the store's expiry "exp" or "", the layout version}; the start is -1 when
          "keep" finds the rows taken over (or the store made anew): the client reserves
          new rows; {-2, "exp", the layout version, the limiter's timeout in ms or ""} when
          the rate limiter holds a "new" reservation back (nothing changed: wait, try again)

Errors:
  TDS_NOSTORE  the store does not exist
  TDS_STALE    the layout version differs from ARGV[1]
  TDS_NOENTRY  a data key is missing
  TDS_RANGE    a data key is shorter than capacity rows (or than its chunk)
  TDS_BADARG   n, capacity or a group is malformed
  TDS_CORRUPT  the cursor is not a decimal count below 2^52 (garbage, negative, another type,
               or so large that Lua's doubles would lose its low bits and give two appends
               the same rows), the write version is not a counter, or the rate limiter's
               hash is damaged; checked before any write
]]
--@include lib/common.lua
--@include lib/rate.lua

-- (check_layout of lib/common.lua, with the expiry read in the same call)
local meta = rcall('HMGET', KEYS[1], 'lv', 'exp', 'lim')
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
local mode = ARGV[4]
if (mode ~= 'new' and mode ~= 'keep') or #ARGV < 6 then
  return fail('TDS_BADARG', 'expected "new" or "keep", a cursor and a layout version')
end
if (#ARGV - 6) % 2 ~= 0 then
  return fail('TDS_BADARG', 'expected pairs of (row bytes, chunk bytes), got ' .. (#ARGV - 6) .. ' values')
end

local function count(value)
  local x = tonumber(value)
  if x == nil or x ~= x or x < 0 or x ~= math.floor(x) or x > 9007199254740992 then return nil end
  return x
end

-- every data key exists with its full size (a SETRANGE into a missing or short key would
-- create it zero-padded)
local next_key = 7
for g = 1, (#ARGV - 6) / 2 do
  local row_bytes, chunk = count(ARGV[5 + 2 * g]), count(ARGV[6 + 2 * g])
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

-- the cursor, checked before the first write: Lua numbers are doubles, exact up to 2^53 only
local CURSOR_MAX = 4503599627370496  -- 2^52 (docs/limits.md)
local raw_cursor = redis.pcall('GET', KEYS[2])
if type(raw_cursor) == 'table' or (raw_cursor and (not string.match(raw_cursor, '^%d+$') or #raw_cursor > 16
    or tonumber(raw_cursor) + n > CURSOR_MAX)) then
  return fail('TDS_CORRUPT', 'the ring cursor ' .. KEYS[2] .. ' of ' .. KEYS[1] .. ' is not a row count below 2^52')
end
local err = check_counter(KEYS[5], 'the write version')
if err then return err end

if mode == 'keep' then
  -- still this append's rows: the same store (its layout version moved by layout changes
  -- only), no later reservation reached them (the cursor is at most a ring past them)
  local start, lv0, lv = count(ARGV[5]), count(ARGV[6]), tonumber(meta[1])
  local cursor = count(rcall('GET', KEYS[2]) or '0')
  if start == nil or lv0 == nil or lv == nil or cursor == nil or lv < lv0 or lv - lv0 >= 1048576
      or start + n > cursor or cursor > start + capacity then
    return {-1, exp, meta[1]}
  end
  return {start, exp, meta[1]}
end

-- the rate limiter, read (and checked) before the first write; the reservation is counted
-- once the cursor moved
local limiter = nil
if meta[3] then
  local rerr
  limiter, rerr = rate_read(KEYS[6])
  if rerr then return rerr end
  if limiter then
    local size_after = math.min(tonumber(raw_cursor or '0') + n, capacity)
    if not rate_can_insert(limiter, size_after, n) then
      return {-2, exp, meta[1], limiter.to}
    end
  end
end

-- the last check: the INCRBY of the cursor is this script's first write (an INCRBY of a
-- key that is not an integer changes nothing)
local moved = redis.pcall('INCRBY', KEYS[2], iarg(n))
if type(moved) ~= 'number' or moved < n then
  if type(moved) == 'number' then rcall('INCRBY', KEYS[2], iarg(-n)) end
  return fail('TDS_BADARG', 'the cursor of ' .. KEYS[1] .. ' is not a row count')
end
local cursor = moved - n
if limiter then rcall('HINCRBY', KEYS[6], 'ins', iarg(n)) end
local start = cursor % capacity
local first = math.min(n, capacity - start)

-- a ring appended to before the flags existed: its first min(cursor, capacity) rows count
-- as written (a cursor set by the client, lua/ring_total.lua, writes the flags itself)
local function adopt()
  if rcall('EXISTS', KEYS[3]) == 1 then return false end
  rcall('SETRANGE', KEYS[3], '0', string.rep('\1', math.min(cursor, capacity)))
  return true
end

-- whether rows from .. from + count - 1 are all flagged as written
local function written(from, count)
  return rcall('GETRANGE', KEYS[3], iarg(from), iarg(from + count - 1)) == string.rep('\1', count)
end

-- the rows these take that were reserved before (the cursor came round): a clear flag is
-- an append still in flight there (or one that died between its steps): take it over
if cursor > 0 and cursor + n <= capacity then
  adopt()  -- (rows never reserved: nothing to take over)
elseif cursor > 0 then
  local whole = true
  if cursor >= capacity then whole = written(start, first) end
  if whole and first < n then whole = written(0, n - first) end
  if not whole and not adopt() then
    rcall('INCR', KEYS[4])
  end
end

-- clear the flags of the rows (SETRANGE pads a new key with zeros: unflagged)
rcall('SETRANGE', KEYS[3], iarg(start), string.rep('\0', first))
if first < n then
  rcall('SETRANGE', KEYS[3], '0', string.rep('\0', n - first))
end
if exp ~= '' then
  for k = 2, 4 do
    if rcall('EXISTS', KEYS[k]) == 1 then rcall('PEXPIREAT', KEYS[k], exp) end
  end
end
return {cursor, exp, meta[1]}
