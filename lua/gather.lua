--[[ gather
Reads rows of one string and returns them concatenated, in the order given. Cheaper than
one GETRANGE command per row when the rows are small (see _backend.choose_read).

KEYS[1]   the data key of the entry

ARGV[1]   the bytes of one row (decimal)
ARGV[2]   the row numbers, decimal, separated by single spaces (repeats allowed)

Returns: the rows' bytes concatenated (bulk string); a missing key reads as ""

Flags: no-writes

Errors:
  TDS_BADARG   the row size is not a positive integer, or the row list is malformed
]]
--@include lib/common.lua

local row_bytes = tonumber(ARGV[1])
if row_bytes == nil or row_bytes < 1 or row_bytes ~= math.floor(row_bytes) then
  return fail('TDS_BADARG', 'bad row size ' .. tostring(ARGV[1]))
end
local rows = ARGV[2] or ''
if string.find(rows, '[^0-9 ]') then
  return fail('TDS_BADARG', 'row numbers must be decimal, separated by spaces')
end
local parts = {}
local n = 0
local last = row_bytes - 1
for row in string.gmatch(rows, '%d+') do
  local off = tonumber(row) * row_bytes
  n = n + 1
  parts[n] = rcall('GETRANGE', KEYS[1], iarg(off), iarg(off + last))
end
return table.concat(parts)
