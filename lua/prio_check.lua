--[[ prio_check
The generations and the written flags of rows, read in one step: the last step of a
prioritized sample. The client read the rows drawn (lua/prio_draw.lua) between the draw and
this check; a row whose generation is still the one drawn and whose flag is still set was
not appended to in between (an append clears the flag at its reserve and moves the
generation in the MULTI that sets it again), so the bytes read are that generation's.

KEYS[1]   row flags
KEYS[2]   generations
KEYS[3]   ring cursor

ARGV[1..] the rows (0-based)

Flags: no-writes

Returns: {the generations (16 digits each, back to back; "" for a row past the tree),
          one byte per row: "1" flagged as written, "0" not}

Errors:
  TDS_BADARG   a row is not a row number
]]
--@include lib/common.lua
--@include lib/prio.lua

local flagged = rcall('EXISTS', KEYS[1]) == 1
local counted = 0
if not flagged then counted = tonumber(rcall('GET', KEYS[3]) or '0') or 0 end
local gens, oks = {}, {}
for i = 1, #ARGV do
  local row = tonumber(ARGV[i])
  if row == nil or row ~= row or row < 0 or row ~= math.floor(row) or row > 4503599627370496 then
    return fail('TDS_BADARG', 'not a row: ' .. tostring(ARGV[i]))
  end
  gens[i] = rcall('GETRANGE', KEYS[2], iarg(row * GW), iarg(row * GW + GW - 1))
  local ok
  if flagged then
    ok = rcall('GETRANGE', KEYS[1], iarg(row), iarg(row)) == '\1'
  else
    ok = row < counted
  end
  if ok then oks[i] = '1' else oks[i] = '0' end
end
return {table.concat(gens), table.concat(oks)}
