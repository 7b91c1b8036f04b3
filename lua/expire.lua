--[[ expire
Sets or clears the lifetime of every key of one store as one step: the meta hash, the
registry, the write-version counter, the ring cursor and every data key expire at the same
millisecond, or none expires. The expiry is recorded in the meta hash (fields "exp", the
absolute time in ms on the server's clock, and "ttl", the lifetime asked for in ms), where
the write scripts read it to give the keys they create later the same expiry.

KEYS[1]   meta hash of the store
KEYS[2]   registry hash
KEYS[3..] the store's other keys: its write-version counter, its ring cursor and the
          data key of every entry (missing ones are skipped)

ARGV[1]   expected layout version (decimal string; "" skips the check)
ARGV[2]   the number of registry entries the client knows of (leaves and nested nodes)
ARGV[3]   the lifetime in ms from now (a positive decimal of at most 15 digits), or ""
          to remove the expiry

Returns: the absolute expiry in ms since the epoch on the server's clock, or 0 when the
         expiry was removed (integer)

Errors:
  TDS_NOSTORE  the store does not exist
  TDS_STALE    the layout version differs from ARGV[1], or the registry from ARGV[2]
  TDS_BADARG   the lifetime is not a positive integer
]]
--@include lib/common.lua

local ttl = ARGV[3]
-- at most 15 digits (about 31,000 years): the sum below stays an exact integer in Lua 5.1
if ttl ~= '' and not (string.match(ttl, '^[1-9]%d*$') and #ttl <= 15) then
  return fail('TDS_BADARG', 'the lifetime must be a positive number of ms, got ' .. ttl)
end
local err = check_layout(KEYS[1], ARGV[1])
if err then return err end
-- the client listed the data keys at this layout version, so the list is complete
local n = rcall('HLEN', KEYS[2])
if n ~= tonumber(ARGV[2]) then
  return fail('TDS_STALE', 'registry has ' .. n .. ' entries, client knows of ' .. ARGV[2])
end

if ttl == '' then
  rcall('HDEL', KEYS[1], 'exp', 'ttl')
  for i = 1, #KEYS do
    rcall('PERSIST', KEYS[i])
  end
  return 0
end
-- the server's clock, not the client's: every client computes nothing from its own time
local now = rcall('TIME')
local exp = int_str(tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) + tonumber(ttl))
rcall('HSET', KEYS[1], 'exp', exp, 'ttl', ttl)
for i = 1, #KEYS do
  -- one absolute time for all: the keys expire together, not one by one
  rcall('PEXPIREAT', KEYS[i], exp)
end
return tonumber(exp)
