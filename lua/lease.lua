--[[ lease
Takes, renews or drops a reader's lease on a store's layout. A read that kept finding the
layout changed between its layout read and its data read (writers adding and deleting keys
faster than it reads) takes a lease: while one is live, commit.lua refuses every layout change
with TDS_BUSY and its client waits, so the reader's next try cannot be outrun. Several readers
may hold leases at once (one hash field each); a lease ends when its reader drops it or at its
deadline, so a reader that died holds writers back for at most the lease's length.

KEYS[1]   the store's read-lease hash (<prefix>:{<td_id>}:rl): reader nonce -> deadline (ms,
          server clock)
KEYS[2]   meta hash of the store

ARGV[1]   "take" (takes or renews the lease of ARGV[2]) or "drop"
ARGV[2]   the reader's nonce (non-empty)
ARGV[3]   take: the lease's length in ms (a positive integer of at most 9 digits)

Returns: take: the layout version (integer); drop: 1 if the lease was held, else 0

Errors:
  TDS_NOSTORE  take: the store does not exist (no lease is left behind)
  TDS_BADARG   an unknown ARGV[1], an empty nonce or a bad length
]]
--@include lib/common.lua
--@include lib/lease.lua

local op, nonce = ARGV[1], ARGV[2] or ''
if nonce == '' then
  return fail('TDS_BADARG', 'empty lease nonce')
end
if op == 'drop' then
  return rcall('HDEL', KEYS[1], nonce)
end
if op ~= 'take' then
  return fail('TDS_BADARG', 'unknown lease op ' .. tostring(op))
end
local ms = tonumber(ARGV[3] or '')
if ms == nil or ms < 1 or ms ~= math.floor(ms) or #(ARGV[3]) > 9 then
  return fail('TDS_BADARG', 'bad lease length ' .. tostring(ARGV[3]))
end
local lv = rcall('HGET', KEYS[2], 'lv')
if not lv then
  return fail('TDS_NOSTORE', 'no store at ' .. KEYS[2])
end
local now = now_ms()
-- drop the leases that ended (readers that died), so the hash holds the live ones only
local leases = rcall('HGETALL', KEYS[1])
local last = now + ms
for i = 1, #leases, 2 do
  local ends = tonumber(leases[i + 1])
  if not ends or ends <= now then
    rcall('HDEL', KEYS[1], leases[i])
  elseif ends > last then
    last = ends
  end
end
rcall('HSET', KEYS[1], nonce, int_str(now + ms))
rcall('PEXPIREAT', KEYS[1], int_str(last))
return tonumber(lv)
