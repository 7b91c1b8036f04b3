--[[ prio_update
Sets the priorities of rows, as one step: each row given gets p = (priority + eps)^alpha
and the tree above it is recomputed; the max priority (what new rows get) becomes the
largest priority applied if that is larger. A row given with a generation is left alone
when its generation moved (an append wrote it since it was drawn). A row given twice takes
its last priority.

Every argument is checked before the first write: a bad one (not a row of the ring, not a
finite priority >= 0, counts that differ) changes nothing.

KEYS[1]   meta hash of the store ("lv", "prio")
KEYS[2]   ring cursor
KEYS[3]   priority leaves
KEYS[4]   priority tree (inner levels)
KEYS[5]   generations
KEYS[6]   max priority

ARGV[1]   the rows (0-based), decimal, separated by spaces
ARGV[2]   their priorities, separated by spaces (as many)
ARGV[3]   their generations, separated by spaces (as many), or "" to apply them all
ARGV[4]   optional: "f64" gives ARGV[1] and ARGV[2] as little-endian doubles, 8 bytes each,
          and ARGV[3] as 16-digit decimal fields back to back (or ""): a quarter of the
          text's parse (needs the struct library: Redis, Valkey); "" or absent: text

Returns: {1, one byte per row given: "1" applied, "0" left alone (its generation moved)};
         {0} when priorities are off; {-1, why} for bad arguments (nothing written)

Errors:
  TDS_NOSTORE  the store does not exist
  TDS_CORRUPT  the settings or the tree are damaged, or the cursor is not a row count
]]
--@include lib/common.lua
--@include lib/prio.lua

return protect(function()
  if not rcall('HGET', KEYS[1], 'lv') then
    return fail('TDS_NOSTORE', 'no store at ' .. KEYS[1])
  end
  local s = prio_settings(KEYS[1])
  if not s then return {0} end
  local t = prio_tree(s, KEYS[3], KEYS[4], KEYS[5], KEYS[6])
  prio_check_sizes(t)
  local cursor = tonumber(rcall('GET', KEYS[2]) or '0')
  if cursor == nil or cursor ~= cursor or cursor < 0 then
    tds_error('TDS_CORRUPT', 'the ring cursor ' .. KEYS[2] .. ' is not a row count')
  end
  local filled = math.min(cursor, t.cap)

  local rows, prios, gens = {}, {}, {}
  local given = (ARGV[3] or '') ~= ''
  local binary = ARGV[4] == 'f64'  -- (the generations then compare as the 16 digits stored)
  if binary then
    rows, prios = doubles(ARGV[1] or ''), doubles(ARGV[2] or '')
    if not rows or not prios then
      return {-1, 'the rows and priorities in "f64" are not doubles (8 bytes each), or this server has no struct library'}
    end
    for i = 1, #rows do rows[i] = rows[i] + 0 end  -- (-0 is row 0)
    if given then
      local fields = ARGV[3]
      if #fields % GW ~= 0 then
        return {-1, 'the generations in "f64" are not ' .. GW .. '-digit fields'}
      end
      for i = 1, #fields / GW do gens[i] = string.sub(fields, i * GW - GW + 1, i * GW) end
    end
  elseif (ARGV[4] or '') ~= '' then
    return {-1, 'the argument format ' .. string.format('%q', string.sub(ARGV[4], 1, 20)) .. ' is not "f64" or ""'}
  else
    for w in string.gmatch(ARGV[1] or '', '%S+') do rows[#rows + 1] = tonumber(w) or -1 end
    for w in string.gmatch(ARGV[2] or '', '%S+') do prios[#prios + 1] = tonumber(w) or -1 end
    if given then
      for w in string.gmatch(ARGV[3], '%S+') do gens[#gens + 1] = w end
    end
  end
  if #prios ~= #rows or (given and #gens ~= #rows) then
    return {-1, 'got ' .. #rows .. ' rows, ' .. #prios .. ' priorities and ' .. #gens .. ' generations'}
  end
  local values = {}
  for i = 1, #rows do
    local r, p = rows[i], prios[i]
    if r ~= r or r < 0 or r ~= math.floor(r) or r >= filled then
      return {-1, 'row ' .. string.format('%.17g', r) .. ' is not a row appended to the ring (0 to '
        .. string.format('%.0f', filled - 1) .. ')'}
    end
    if p ~= p or p < 0 or p > P_MAX then
      return {-1, 'priority ' .. string.format('%.17g', p) .. ' of row ' .. int_str(r) .. ' is not a finite number >= 0'}
    end
    local v = (p + s.eps) ^ s.alpha
    if v ~= v or v > P_MAX then
      return {-1, 'priority ' .. string.format('%.17g', p) .. ' gives (p + eps)^alpha past the largest double'}
    end
    values[i] = v
    if given and not string.match(gens[i], '^%d+$') then
      return {-1, 'generation ' .. string.format('%q', gens[i]) .. ' is not a count'}
    end
  end

  local applied, touched, new, top = {}, {}, {}, nil  -- (new: row -> its value, the last given)
  for i = 1, #rows do
    local r = rows[i]
    local ok = true
    if given then
      local g = rcall('GETRANGE', t.pg, iarg(r * GW), iarg(r * GW + GW - 1))
      if binary then
        ok = g == gens[i]
      else
        ok = tonumber(g) == tonumber(gens[i])
      end
    end
    if ok then
      if not new[r] then touched[#touched + 1] = r end
      new[r] = values[i]
      if top == nil or prios[i] > top then top = prios[i] end
      applied[i] = '1'
    else
      applied[i] = '0'
    end
  end
  if #touched > 0 then
    table.sort(touched)
    local runs = {}
    for _, r in ipairs(touched) do
      local last = runs[#runs]
      if last and r <= last[2] + 1 then
        if r > last[2] then last[2] = r end
      else
        runs[#runs + 1] = {r, r}
      end
    end
    -- (the leaves and the tree in one go, all read before the first write: damage changes nothing)
    local m = prio_max(t)
    prio_fix(t, runs, new, function(lo, hi)
      local out = {}
      for row = lo, hi do out[#out + 1] = penc(t, new[row]) end
      return table.concat(out)
    end)
    if m == nil or top > m then rcall('SETRANGE', t.pm, '0', pfmt(top)) end
  end
  return {1, table.concat(applied)}
end)
