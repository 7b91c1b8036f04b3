--[[ prio_new
Gives the rows of one append the max priority and their new generation. It is sent inside
the append's MULTI (tdstore/_backend/append.py, AppendPlan.write_commands), beside the
SETRANGEs that write the rows and set their flags, so a row becomes drawable with its data,
its priority and its generation in the same atomic step. Only appends to a store whose
priorities are on carry it (the client learns that from the layout: lua/prio_build.lua
bumps the layout version). It goes as EVAL, not EVALSHA: a MULTI does not roll back, and an
EVALSHA that found the script flushed would leave the rows written without priorities.

The rows are (start + i) % cap for i < n. Each gets p = (m + eps)^alpha, m the max
priority (lua/prio_update.lua; 1 while none was given), and the generation start + i + 1.

KEYS[1]   meta hash of the store ("prio": the settings)
KEYS[2]   priority leaves
KEYS[3]   priority tree (inner levels)
KEYS[4]   generations
KEYS[5]   max priority

ARGV[1]   start: the ring position (rows ever reserved before them) of the first row
ARGV[2]   n: the number of rows (1 <= n <= cap)

Returns: n, or 0 when priorities are off (nothing written)

Errors:
  TDS_BADARG   start or n is not a count
  TDS_CORRUPT  the settings or the tree are damaged (missing, another size, not numbers)
]]
--@include lib/common.lua
--@include lib/prio.lua

return protect(function()
  local s = prio_settings(KEYS[1])
  if not s then return 0 end
  local start, n = tonumber(ARGV[1]), tonumber(ARGV[2])
  if start == nil or n == nil or start ~= start or n ~= n or start < 0 or start > 4503599627370496
      or start ~= math.floor(start) or n < 1 or n > s.cap or n ~= math.floor(n) then
    return fail('TDS_BADARG', 'need a ring position and 1 <= n <= ' .. int_str(s.cap) .. ' rows, got '
      .. tostring(ARGV[1]) .. ' and ' .. tostring(ARGV[2]))
  end
  local t = prio_tree(s, KEYS[2], KEYS[3], KEYS[4], KEYS[5])
  prio_check_sizes(t)
  local m = prio_max(t) or 1
  local value = (m + s.eps) ^ s.alpha
  local leaf = penc(t, value)
  local row0 = start % s.cap
  local first = math.min(n, s.cap - row0)
  local runs = {}
  if first < n then runs[1] = {0, n - first - 1} end
  runs[#runs + 1] = {row0, row0 + first - 1}
  -- (the leaves and the tree in one go, all read before the first write: damage changes nothing)
  local leaves = {}
  for _, run in ipairs(runs) do
    for row = run[1], run[2] do leaves[row] = value end
  end
  prio_fix(t, runs, leaves, function(lo, hi) return string.rep(leaf, hi - lo + 1) end)
  local function put(row, count, g)
    local gens = {}
    for i = 1, count do gens[i] = gfmt(g + i) end
    rcall('SETRANGE', t.pg, iarg(row * GW), table.concat(gens))
  end
  put(row0, first, start)
  if first < n then put(0, n - first, start + first) end
  return n
end)
