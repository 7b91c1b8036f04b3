--[[ ring_total
Sets the cursor of a ring buffer (rows ever appended) to a count the client chose, as
TorchRL's empty() and load_state_dict() do (tdstore/_backend/ops.py, set_ring_total).

The rows the cursor then counts, the first min(total, capacity), are flagged as written,
except those whose flag is clear: a reservation in flight (or dead) there keeps its record,
so that a reserve that comes round to it still takes it over (lua/reserve.lua). The flags
of the rows past them are dropped. The fence is bumped: an append between its two steps has
its write aborted and checks its rows against the new cursor ("keep" of lua/reserve.lua)
before it writes them, or reserves new ones. The write version is bumped (a change that
readers of the ring see). The keys written get the store's expiry (meta field "exp").

KEYS[1]   meta hash of the store (layout version "lv", expiry "exp")
KEYS[2]   ring cursor: rows ever reserved (a string key)
KEYS[3]   row flags: one byte per row, 1 when the row holds a whole appended row
KEYS[4]   fence counter
KEYS[5]   write version counter
KEYS[6]   the rate limiter's hash (lua/lib/rate.lua): a ring emptied (ARGV[1] "0") starts
          its counts of inserts and samples at 0 again, as a Reverb table reset does

ARGV[1]   the cursor's new value: rows ever appended (decimal, 0 to 2^52)
ARGV[2]   capacity: the size of the first batch dim (>= 1)

Returns: the number of rows the cursor counts, min(total, capacity) (integer)

Errors:
  TDS_NOSTORE  the store does not exist
  TDS_BADARG   the cursor value or the capacity is not a count, or the fence or the write
               version is not a counter
]]
--@include lib/common.lua

local meta = rcall('HMGET', KEYS[1], 'lv', 'exp')
if not meta[1] then
  return fail('TDS_NOSTORE', 'no store at ' .. KEYS[1])
end
-- n ~= n and the bounds reject nan and inf, which Lua 5.1's tonumber accepts; the cursor's
-- bound is lua/reserve.lua's CURSOR_MAX (2^52), so no cursor set here is one appends refuse
local total, capacity = tonumber(ARGV[1]), tonumber(ARGV[2])
if total == nil or capacity == nil or total ~= total or capacity ~= capacity or total > 4503599627370496
    or capacity > 9007199254740992 or total < 0 or capacity < 1 or total ~= math.floor(total)
    or capacity ~= math.floor(capacity) then
  return fail('TDS_BADARG', 'need a row count >= 0 and a capacity >= 1, got ' .. tostring(ARGV[1]) .. ' and '
    .. tostring(ARGV[2]))
end

-- the counters this bumps must be counters: checked before the first write (a script's
-- writes are not undone by a later error)
for _, key in ipairs({KEYS[4], KEYS[5]}) do
  local value = rcall('GET', key)
  if value and not string.match(value, '^%d+$') then
    return fail('TDS_BADARG', key .. ' is not a counter')
  end
end

local counted = math.min(total, capacity)
if counted == 0 then
  rcall('DEL', KEYS[3])
else
  -- the flags of the rows reserved before (clear: in flight or dead), then rows never reserved
  local kept = rcall('GETRANGE', KEYS[3], '0', iarg(counted - 1))
  rcall('SET', KEYS[3], kept .. string.rep('\1', counted - #kept))
end
rcall('SET', KEYS[2], iarg(total))
if total == 0 and rcall('EXISTS', KEYS[6]) == 1 then
  -- (pcall: a damaged limiter is reported by the next append or sample, not half-way here)
  redis.pcall('HSET', KEYS[6], 'ins', '0', 'smp', '0')
end
rcall('INCR', KEYS[4])
rcall('INCR', KEYS[5])
local exp = meta[2] or ''
if exp ~= '' then
  for _, key in ipairs({KEYS[2], KEYS[3], KEYS[4], KEYS[5]}) do
    if rcall('EXISTS', key) == 1 then rcall('PEXPIREAT', key, exp) end
  end
end
return counted
