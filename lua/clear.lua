--[[ clear
Deletes every key of one store as one step.

KEYS[1]   meta hash of the store
KEYS[2]   registry hash
KEYS[3..] the store's other keys: its write-version counter, its ring cursor and the
          data key of every entry

ARGV[1]   expected layout version (decimal string; "" skips the check)
ARGV[2]   the number of registry entries the client knows of (leaves and nested nodes)

Returns: the number of keys deleted (integer)

Errors:
  TDS_NOSTORE  the store does not exist
  TDS_STALE    the layout version differs from ARGV[1]
]]
--@include lib/common.lua

local err = check_layout(KEYS[1], ARGV[1])
if err then return err end
-- the client listed the data keys at this layout version, so the list is complete
local n = rcall('HLEN', KEYS[2])
if n ~= tonumber(ARGV[2]) then
  return fail('TDS_STALE', 'registry has ' .. n .. ' entries, client knows of ' .. ARGV[2])
end
-- DEL in batches: unpack() of a very long table overflows the Lua C stack
local deleted = 0
local batch = {}
for i = 1, #KEYS do
  batch[#batch + 1] = KEYS[i]
  if #batch == 1000 or i == #KEYS then
    deleted = deleted + rcall('DEL', unpack(batch))
    batch = {}
  end
end
return deleted
