--[[ read_all
Reads a whole store in one step: its meta hash, its registry, its write version and the
bytes of every entry kept as one string. The fallback of a whole-store read whose
optimistic tries kept finding the layout changed (writers adding and deleting keys
between its layout read and its data read): one step cannot be outrun, so a reader under
churn waits at most a few tries and this one call.

KEYS[1]   meta hash of the store
KEYS[2]   registry hash of the store
KEYS[3]   write-version string of the store

ARGV[1]   the name of an entry's data key less its registry field ("<prefix>:{<td_id>}:d:")
ARGV[2]   optional: the most bytes to return; when the data strings hold more, the bytes are
          not read (the reply would hold them all, and the server copies every byte through
          Lua): the fourth element of the reply is then false

Returns: {meta hash as a flat field/value array, registry as a flat field/value array,
          write version or false, {the bytes of each registry field's data key, or false
          where there is none (nested tensordicts, chunked entries, lost bytes)}, or false
          when they hold more than ARGV[2] bytes}

Flags: no-writes

Errors:
  TDS_BADARG   the data key prefix is empty
]]
--@include lib/common.lua

if ARGV[1] == nil or ARGV[1] == '' then
  return fail('TDS_BADARG', 'empty data key prefix')
end
-- the data keys are named from the registry read in this same step, so they share the
-- store's hash tag (and slot) but cannot be declared in KEYS beforehand
local reg = rcall('HGETALL', KEYS[2])
local limit = tonumber(ARGV[2] or '')
if limit then
  local total = 0
  for i = 1, #reg, 2 do
    total = total + rcall('STRLEN', ARGV[1] .. reg[i])
  end
  if total > limit then
    return {rcall('HGETALL', KEYS[1]), reg, rcall('GET', KEYS[3]), false}
  end
end
local data = {}
for i = 1, #reg, 2 do
  data[#data + 1] = rcall('GET', ARGV[1] .. reg[i])
end
return {rcall('HGETALL', KEYS[1]), reg, rcall('GET', KEYS[3]), data}
