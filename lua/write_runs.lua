--[[ write_runs
Writes byte runs into the entries of one store as one step: every run of every entry
lands, or none does. Used for indexed writes (store[idx] = value) with many small runs.

KEYS[1]   meta hash of the store
KEYS[2]   write-version counter of the store (bumped once)
KEYS[3..] the data key of each entry written, in the order of the ARGV groups

ARGV[1]   expected layout version (decimal string; "" skips the check)
ARGV[2..] one group per entry: the number of runs r, then r pairs of decimal
          (offset, length), then the payload: the runs' bytes concatenated in order.
          Later runs overwrite earlier ones where they overlap (the last write wins).

The data keys must exist, so the script creates no key but, at most, the counter: when it
does and the store has an expiry (meta field "exp", see expire.lua), the counter gets it.

Returns: the number of runs written (integer)

Errors:
  TDS_NOSTORE  the store does not exist
  TDS_STALE    the layout version differs from ARGV[1]
  TDS_NOENTRY  a data key is missing
  TDS_RANGE    a run ends past the end of its entry
  TDS_BADARG   a group is malformed or its payload size differs from the sum of its runs
  TDS_CORRUPT  the write version holds what no tdstore write makes; checked before any write
]]
--@include lib/common.lua

local err = check_layout(KEYS[1], ARGV[1]) or check_counter(KEYS[2], 'the write version')
if err then return err end

-- parse and validate every group before the first write
local groups = {}
local pos = 2
for k = 3, #KEYS do
  local nruns = tonumber(ARGV[pos])
  if nruns == nil or nruns < 0 or nruns ~= math.floor(nruns) then
    return fail('TDS_BADARG', 'bad run count for ' .. KEYS[k])
  end
  local runs = {}
  local total = 0
  local size = rcall('STRLEN', KEYS[k])
  if size == 0 and rcall('EXISTS', KEYS[k]) == 0 then
    return fail('TDS_NOENTRY', 'no data at ' .. KEYS[k])
  end
  for r = 1, nruns do
    local off = tonumber(ARGV[pos + 2 * r - 1])
    local len = tonumber(ARGV[pos + 2 * r])
    if off == nil or len == nil or off < 0 or len < 0 or off ~= math.floor(off) or len ~= math.floor(len) then
      return fail('TDS_BADARG', 'bad run ' .. r .. ' for ' .. KEYS[k])
    end
    if off + len > size then
      return fail('TDS_RANGE', 'run ' .. int_str(off) .. '+' .. int_str(len) .. ' past the end (' .. int_str(size) .. ') of ' .. KEYS[k])
    end
    runs[r] = {off, len, total}
    total = total + len
  end
  local payload = ARGV[pos + 2 * nruns + 1]
  if payload == nil or #payload ~= total then
    return fail('TDS_BADARG', 'payload of ' .. KEYS[k] .. ' has ' .. tostring(payload and #payload) .. ' bytes, runs need ' .. int_str(total))
  end
  groups[#groups + 1] = {KEYS[k], runs, payload}
  pos = pos + 2 * nruns + 2
end
if pos ~= #ARGV + 1 then
  return fail('TDS_BADARG', 'expected ' .. (#KEYS - 2) .. ' groups, ARGV has extra values')
end

local count = 0
for _, group in ipairs(groups) do
  local key, runs, payload = group[1], group[2], group[3]
  if #runs == 1 and runs[1][2] == #payload then
    rcall('SETRANGE', key, iarg(runs[1][1]), payload)
  else
    for _, run in ipairs(runs) do
      if run[2] > 0 then
        rcall('SETRANGE', key, iarg(run[1]), string.sub(payload, run[3] + 1, run[3] + run[2]))
      end
    end
  end
  count = count + #runs
end
if rcall('INCR', KEYS[2]) == 1 then
  local exp = rcall('HGET', KEYS[1], 'exp')
  if exp and exp ~= '' then rcall('PEXPIREAT', KEYS[2], exp) end
end
return count
