--[[ lib/prio
Helpers of the prioritized-replay scripts (lua/prio_*.lua): where the priority tree lies in
its server strings, and its text encoding (no struct library: fakeredis's Lua has none).
Needs lib/common.lua. See docs/replay.md.

Over a ring of cap rows, with arity k:
  leaves  (<base>:pl)  one value per row, p = (priority + eps)^alpha, 23 bytes of '%.17g'
                       text, space-padded (0: the row has no priority and is never drawn)
  inner   (<base>:pt)  the levels above the leaves, the root first: level 1 holds
                       ceil(cap/k) nodes, level 2 ceil(level 1/k) ..., the root one; a node
                       is 46 bytes: the sum of its children, then the least positive leaf
                       below it (0 when none), each '%-23.17g'
  gens    (<base>:pg)  the generation of each row, 16 decimal digits: 1 + the ring
                       position (rows ever reserved before it) of the append that wrote the
                       row; 0 for a row written before the tree was built
  max     (<base>:pm)  the largest priority ever given (the one new rows get), 23 bytes;
                       blank: none was given yet (new rows get 1)
The settings (alpha, beta, eps, k, cap) are the JSON meta field "prio".
]]
local PW, NW, GW = 23, 46, 16
local P_MAX = 1.7976931348623157e308

-- raised inside protect(): the script replies with the error ``code msg``
local function tds_error(code, msg)
  error({tds = code .. ' ' .. msg})
end

local function protect(f)
  local ok, res = pcall(f)
  if ok then return res end
  if type(res) == 'table' and res.tds then return redis.error_reply(res.tds) end
  error(res)
end

local function pfmt(v)
  return string.format('%-23.17g', v)
end

local function gfmt(g)
  return string.format('%016.0f', g)
end

-- a value read from the tree: a finite number >= 0, else damage
local function pnum(s, key)
  local v = tonumber(s)
  if v == nil or v ~= v or v < 0 or v > P_MAX then
    tds_error('TDS_CORRUPT', 'the priority tree ' .. key .. ' holds ' .. string.format('%q', string.sub(s, 1, 30))
      .. ', not a priority (damaged?); disable_priorities() and enable_priorities() rebuild it')
  end
  return v
end

local function slen(key)
  local n = redis.pcall('STRLEN', key)
  if type(n) ~= 'number' then return -1 end
  return n
end

-- settings as JSON, checked (where: what holds them, for the error)
local function prio_parse(raw, where)
  local ok, s = pcall(cjson.decode, raw)
  local bad = not ok or type(s) ~= 'table'
  local alpha, beta, eps, k, cap
  if not bad then
    alpha, beta, eps, k, cap = tonumber(s.alpha), tonumber(s.beta), tonumber(s.eps), tonumber(s.k), tonumber(s.cap)
    bad = not (alpha and beta and eps and k and cap) or alpha ~= alpha or beta ~= beta or eps ~= eps
      or alpha < 0 or beta < 0 or eps < 0 or alpha > 1e6 or beta > 1e6 or eps > 1e300 or k < 2 or k > 64
      or k ~= math.floor(k) or cap < 1 or cap > 4503599627370496 or cap ~= math.floor(cap)
  end
  if bad then
    tds_error('TDS_CORRUPT', where .. ' hold ' .. string.format('%q', string.sub(raw, 1, 80))
      .. ', not priority settings; disable_priorities() and enable_priorities() rebuild it')
  end
  return {alpha = alpha, beta = beta, eps = eps, k = k, cap = cap, raw = raw}
end

-- the settings of meta field "prio", checked; nil when priorities are off
local function prio_settings(meta_key)
  local raw = rcall('HGET', meta_key, 'prio')
  if not raw then return nil end
  return prio_parse(raw, 'the priority settings (field "prio" of ' .. meta_key .. ')')
end

-- the tree's shape: sizes[l] nodes on level l (0: the leaves), offs[l] the byte offset of
-- inner level l in the inner string, bytes its length, depth the root's level
local function prio_tree(s, pl, pt, pg, pm)
  local sizes, offs = {[0] = s.cap}, {}
  local n = s.cap
  repeat
    n = math.ceil(n / s.k)
    sizes[#sizes + 1] = n
  until n == 1
  local off = 0
  for l = #sizes, 1, -1 do
    offs[l] = off
    off = off + sizes[l] * NW
  end
  return {sizes = sizes, offs = offs, bytes = off, depth = #sizes, k = s.k, cap = s.cap, pl = pl, pt = pt, pg = pg, pm = pm}
end

-- the strings have the sizes of the ring's tree (else: damaged, evicted, another capacity)
local function prio_check_sizes(t)
  if slen(t.pl) ~= t.cap * PW or slen(t.pt) ~= t.bytes or slen(t.pg) ~= t.cap * GW or slen(t.pm) ~= PW then
    tds_error('TDS_CORRUPT', 'the priority tree of ' .. t.pl .. ' is not the one of a ring of ' .. int_str(t.cap)
      .. ' rows (damaged, evicted, or the batch size changed); disable_priorities() and enable_priorities() rebuild it')
  end
end

-- the sums (and, with mins, the least positive leaves) of nodes first..last (0-based) of level l
local function prio_read(t, l, first, last, mins)
  local sums, low = {}, {}
  if l == 0 then
    local s = rcall('GETRANGE', t.pl, int_str(first * PW), int_str((last + 1) * PW - 1))
    for i = 0, last - first do
      local v = pnum(string.sub(s, i * PW + 1, i * PW + PW), t.pl)
      sums[i + 1] = v
      low[i + 1] = v
    end
  else
    local base = t.offs[l]
    local s = rcall('GETRANGE', t.pt, int_str(base + first * NW), int_str(base + (last + 1) * NW - 1))
    for i = 0, last - first do
      local a = i * NW + 1
      sums[i + 1] = pnum(string.sub(s, a, a + PW - 1), t.pt)
      if mins then low[i + 1] = pnum(string.sub(s, a + PW, a + NW - 1), t.pt) end
    end
  end
  return sums, low
end

-- recomputes the inner nodes above the leaf runs: sorted, disjoint {lo, hi} (0-based, inclusive)
local function prio_fix(t, runs)
  local k = t.k
  for l = 1, t.depth do
    local below = t.sizes[l - 1]
    local parents = {}
    for _, run in ipairs(runs) do
      local lo, hi = math.floor(run[1] / k), math.floor(run[2] / k)
      local top = parents[#parents]
      if top and lo <= top[2] + 1 then
        if hi > top[2] then top[2] = hi end
      else
        parents[#parents + 1] = {lo, hi}
      end
    end
    for _, run in ipairs(parents) do
      local clo, chi = run[1] * k, math.min((run[2] + 1) * k, below) - 1
      local sums, low = prio_read(t, l - 1, clo, chi, true)
      local out = {}
      for p = run[1], run[2] do
        local s, m = 0, 0
        for c = p * k - clo + 1, math.min(p * k + k, below) - clo do
          s = s + sums[c]
          local mc = low[c]
          if mc > 0 and (m == 0 or mc < m) then m = mc end
        end
        out[#out + 1] = string.format('%-23.17g%-23.17g', s, m)
      end
      rcall('SETRANGE', t.pt, int_str(t.offs[l] + run[1] * NW), table.concat(out))
    end
    runs = parents
  end
end

-- the largest priority given so far, or nil (none yet)
-- A descent of tree t (prio_tree) for masses u * total: returns a function of u giving the
-- row drawn and its leaf's text as stored (exact, and no format per draw). Each group of
-- children read is parsed lazily (a descent reads about half of one) and kept for the later
-- descents of the same script call.
local function prio_descender(t, total)
  local k = t.k
  local cache = {}
  for l = 0, t.depth do cache[l] = {} end
  return function(u)
    local mass, node, value = u * total, 0, ''
    for l = t.depth, 1, -1 do
      local below = l - 1
      local group = cache[below][node]
      if not group then
        local f = node * k
        local count = math.min(f + k, t.sizes[below]) - f
        local width, key, base = NW, t.pt, 0
        if below == 0 then width, key = PW, t.pl else base = t.offs[below] end
        local raw = rcall('GETRANGE', key, int_str(base + f * width), int_str(base + (f + count) * width - 1))
        group = {raw = raw, count = count, width = width, key = key}
        cache[below][node] = group
      end
      local pick, before, acc = nil, 0, 0
      local raw, width = group.raw, group.width
      for i = 1, group.count do
        local v = group[i]
        if v == nil then
          v = pnum(string.sub(raw, (i - 1) * width + 1, (i - 1) * width + PW), group.key)
          group[i] = v
        end
        if v > 0 then
          pick, before = i, acc
          acc = acc + v
          if mass < acc then break end
        end
      end
      if not pick then
        tds_error('TDS_CORRUPT', 'the priority tree ' .. t.pt .. ' has a node with a positive sum and no positive child'
          .. ' (damaged?); disable_priorities() and enable_priorities() rebuild it')
      end
      mass = mass - before
      value = string.sub(raw, (pick - 1) * width + 1, (pick - 1) * width + PW)
      node = node * k + pick - 1
    end
    return node, value
  end
end

local function prio_max(t)
  local raw = rcall('GETRANGE', t.pm, '0', int_str(PW - 1))
  if string.match(raw, '^ *$') then return nil end
  return pnum(raw, t.pm)
end
