--[[ read_one
Reads one byte run of an entry together with the store's layout version, in one command:
the fast path of a one-row read (a MULTI of two commands costs the client more).

KEYS[1]   meta hash of the store
KEYS[2]   the data key of the entry

ARGV[1]   first byte (decimal)
ARGV[2]   last byte, inclusive (decimal; -1 for the end of the string)

Returns: {layout version or false when there is no store, the bytes, the length of the
         whole string (so that the caller checks it against the entry's metadata)}

Flags: no-writes

Errors:
  TDS_BADARG   a bound is not an integer
]]
--@include lib/common.lua

local first, last = tonumber(ARGV[1]), tonumber(ARGV[2])
if first == nil or last == nil or first ~= math.floor(first) or last ~= math.floor(last) then
  return fail('TDS_BADARG', 'bad byte range ' .. tostring(ARGV[1]) .. '..' .. tostring(ARGV[2]))
end
return {rcall('HGET', KEYS[1], 'lv'), rcall('GETRANGE', KEYS[2], ARGV[1], ARGV[2]), rcall('STRLEN', KEYS[2])}
