--[[ slice_check
The cursor, the written flags of slice windows and the generations of their start rows,
read in one step: the last step of store.sample_slices(). The client read the rows of the
windows drawn (lua/slice_draw.lua) between the draw and this check. A window [a, a + L)
whose rows are still flagged, with a cursor that did not go back and is at most a + cap
(its oldest row was not reserved again: an append reserves in cursor order), was not
appended to in between, so the bytes read are those the draw tested.

KEYS[1]   row flags
KEYS[2]   ring cursor
KEYS[3]   generations (priority replay; may not exist)

ARGV[1]   cap: the ring's capacity (rows)
ARGV[2]   L: the slice length, 1 to cap
ARGV[3..] the windows' starts (absolute positions)

Flags: no-writes

Returns: {the cursor as text, one byte per window: "1" all its rows flagged as written,
          "0" not, the generations of the start rows (16 digits each, back to back; ""
          when KEYS[3] does not exist)}

Errors:
  TDS_BADARG   the capacity, the length or a start is not a number of its range
]]
--@include lib/common.lua
--@include lib/prio.lua

local cap, L = tonumber(ARGV[1]), tonumber(ARGV[2])
if cap == nil or cap ~= cap or cap < 1 or cap ~= math.floor(cap) or cap > 4503599627370496
  or L == nil or L ~= L or L < 1 or L > cap or L ~= math.floor(L) then
  return fail('TDS_BADARG', 'need a capacity and a slice length up to it, got ' .. tostring(ARGV[1]) .. ' ' .. tostring(ARGV[2]))
end
local cursor = rcall('GET', KEYS[2]) or '0'
local flagged = rcall('EXISTS', KEYS[1]) == 1
local with_gens = rcall('EXISTS', KEYS[3]) == 1
local ones = string.rep('\1', L)
local oks, gens = {}, {}
for i = 3, #ARGV do
  local a = tonumber(ARGV[i])
  if a == nil or a ~= a or a < 0 or a ~= math.floor(a) or a > 4503599627370496 then
    return fail('TDS_BADARG', 'not a position: ' .. tostring(ARGV[i]))
  end
  local r = a % cap
  local ok = true
  if flagged then
    local got
    if r + L <= cap then
      got = rcall('GETRANGE', KEYS[1], iarg(r), iarg(r + L - 1))
    else
      got = rcall('GETRANGE', KEYS[1], iarg(r), iarg(cap - 1)) .. rcall('GETRANGE', KEYS[1], '0', iarg(r + L - cap - 1))
    end
    ok = got == ones
  end
  if ok then oks[#oks + 1] = '1' else oks[#oks + 1] = '0' end
  if with_gens then gens[#gens + 1] = rcall('GETRANGE', KEYS[3], iarg(r * GW), iarg(r * GW + GW - 1)) end
end
return {cursor, table.concat(oks), table.concat(gens)}
