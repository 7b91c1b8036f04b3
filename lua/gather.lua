--[[ gather
Reads many byte runs of one string and returns them concatenated, in order. Cheaper than
one GETRANGE command per run when the runs are small (see _backend.choose_read).

KEYS[1]   the data key of the entry

ARGV[1..] pairs of decimal (offset, length), in the order of the result

Returns: the runs' bytes concatenated (bulk string); a missing key reads as ""

Errors:
  TDS_BADARG   an offset or length is not a non-negative integer
]]
--@include lib/common.lua

local parts = {}
for i = 1, #ARGV, 2 do
  local off, len = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  if off == nil or len == nil or off < 0 or len < 0 or off ~= math.floor(off) or len ~= math.floor(len) then
    return fail('TDS_BADARG', 'bad run ' .. tostring(ARGV[i]) .. '+' .. tostring(ARGV[i + 1]))
  end
  if len > 0 then
    parts[#parts + 1] = rcall('GETRANGE', KEYS[1], ARGV[i], int_str(off + len - 1))
  end
end
return table.concat(parts)
