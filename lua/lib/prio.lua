--[[ lib/prio
Helpers of the prioritized-replay scripts (lua/prio_*.lua): where the priority tree lies in
its server strings, and its two encodings. Needs lib/common.lua. See docs/replay.md.

Over a ring of cap rows, with arity k:
  leaves  (<base>:pl)  one value per row, p = (priority + eps)^alpha (0: the row has no
                       priority and is never drawn)
  inner   (<base>:pt)  the levels above the leaves, the root first: level 1 holds
                       ceil(cap/k) nodes, level 2 ceil(level 1/k) ..., the root one; a node
                       is two values: the sum of its children, then the least positive leaf
                       below it (0 when none)
A value is, by the settings' "enc":
  "f64"   8 bytes, a little-endian IEEE double (the struct library: Redis, Valkey);
          a node 16 bytes. Chosen by "enable" wherever the server's Lua has struct: a
          group of children costs about a third of its text parse (benchmarks/bench_replay.py)
  "text"  23 bytes of '%-23.17g' text, space-padded (exact too); a node 46 bytes. Where the
          Lua has no struct (fakeredis); settings without "enc" are "text"
  gens    (<base>:pg)  the generation of each row, 16 decimal digits: 1 + the ring
                       position (rows ever reserved before it) of the append that wrote the
                       row; 0 for a row written before the tree was built
  max     (<base>:pm)  the largest priority ever given (the one new rows get), 23 bytes;
                       blank: none was given yet (new rows get 1)
The settings (alpha, beta, eps, k, cap, enc) are the JSON meta field "prio".
]]
local PW, GW = 23, 16
local P_MAX = 1.7976931348623157e308

-- the server's struct library, or nil (fakeredis's Lua has none; reading a global that
-- does not exist is an error under Redis's Lua 5.1 sandbox, hence the pcall)
local STRUCT = nil
do
  local ok, lib = pcall(function() return struct end)
  if ok and type(lib) == 'table' and lib.pack and lib.unpack then STRUCT = lib end
end

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
  local alpha, beta, eps, k, cap, enc
  if not bad then
    alpha, beta, eps, k, cap = tonumber(s.alpha), tonumber(s.beta), tonumber(s.eps), tonumber(s.k), tonumber(s.cap)
    enc = s.enc
    bad = not (alpha and beta and eps and k and cap) or alpha ~= alpha or beta ~= beta or eps ~= eps
      or alpha < 0 or beta < 0 or eps < 0 or alpha > 1e6 or beta > 1e6 or eps > 1e300 or k < 2 or k > 64
      or k ~= math.floor(k) or cap < 1 or cap > 4503599627370496 or cap ~= math.floor(cap)
      or not (enc == nil or enc == 'text' or enc == 'f64')
  end
  if bad then
    tds_error('TDS_CORRUPT', where .. ' hold ' .. string.format('%q', string.sub(raw, 1, 80))
      .. ', not priority settings; disable_priorities() and enable_priorities() rebuild it')
  end
  return {alpha = alpha, beta = beta, eps = eps, k = k, cap = cap, enc = enc or 'text', enc_given = enc ~= nil, raw = raw}
end

-- the settings of meta field "prio", checked; nil when priorities are off
local function prio_settings(meta_key)
  local raw = rcall('HGET', meta_key, 'prio')
  if not raw then return nil end
  return prio_parse(raw, 'the priority settings (field "prio" of ' .. meta_key .. ')')
end

-- the tree's shape: sizes[l] nodes on level l (0: the leaves), offs[l] the byte offset of
-- inner level l in the inner string, bytes its length, depth the root's level; pw and nw
-- the widths of a value and of a node, bin whether values are doubles (the "f64" encoding)
local function prio_tree(s, pl, pt, pg, pm)
  local bin = s.enc == 'f64'
  if bin and not STRUCT then
    tds_error('TDS_CORRUPT', 'the priority tree of ' .. pl .. ' holds doubles ("f64") and this server\'s Lua has no struct'
      .. ' library to read them (restored from another server?); disable_priorities() and enable_priorities() rebuild it')
  end
  local pw = PW
  if bin then pw = 8 end
  local nw = 2 * pw
  local sizes, offs = {[0] = s.cap}, {}
  local n = s.cap
  repeat
    n = math.ceil(n / s.k)
    sizes[#sizes + 1] = n
  until n == 1
  local off = 0
  for l = #sizes, 1, -1 do
    offs[l] = off
    off = off + sizes[l] * nw
  end
  return {sizes = sizes, offs = offs, bytes = off, depth = #sizes, k = s.k, cap = s.cap, pl = pl, pt = pt, pg = pg, pm = pm,
    bin = bin, pw = pw, nw = nw}
end

-- a value of the tree, checked: a finite number >= 0, else damage
local function pcheck(v, key)
  if v ~= v or v < 0 or v > P_MAX then
    tds_error('TDS_CORRUPT', 'the priority tree ' .. key .. ' holds ' .. string.format('%.17g', v)
      .. ', not a priority (damaged?); disable_priorities() and enable_priorities() rebuild it')
  end
  return v
end

-- the value at byte a (1-based) of the string s read from key, in t's encoding
local function pget(t, s, a, key)
  if t.bin then
    if #s < a + 7 then
      tds_error('TDS_CORRUPT', 'the priority tree ' .. key .. ' ends inside a value (damaged?); disable_priorities()'
        .. ' and enable_priorities() rebuild it')
    end
    return pcheck(STRUCT.unpack('<d', s, a), key)
  end
  return pnum(string.sub(s, a, a + PW - 1), key)
end

-- the struct format of n little-endian doubles (memoized)
local DFMT = {}
local function dfmt(n)
  local fmt = DFMT[n]
  if not fmt then
    fmt = '<' .. string.rep('d', n)
    DFMT[n] = fmt
  end
  return fmt
end

-- count doubles (little-endian) from byte a (1-based) of the string s, unchecked, unpacked up
-- to 64 in one call (a call per value costs 5x more); s holds them all
local function unpack_doubles(s, a, count)
  local out, done = {}, 0
  while done < count do
    local n = math.min(count - done, 64)
    local got = {STRUCT.unpack(dfmt(n), s, a + done * 8)}
    for i = 1, n do out[done + i] = got[i] end
    done = done + n
  end
  return out
end

-- the numbers of the table vals as little-endian doubles, 8 bytes each, back to back (packed
-- up to 64 in one call, as unpack_doubles reads them)
local function pack_doubles(vals)
  local out, done, count = {}, 0, #vals
  while done < count do
    local n = math.min(count - done, 64)
    out[#out + 1] = STRUCT.pack(dfmt(n), unpack(vals, done + 1, done + n))
    done = done + n
  end
  return table.concat(out)
end

-- count values from byte a (1-based) of the string s read from key, checked, in t's encoding
local function pvalues(t, s, a, count, key)
  if not t.bin then
    local out = {}
    for i = 1, count do out[i] = pget(t, s, a + (i - 1) * PW, key) end
    return out
  end
  if #s < a + count * 8 - 1 then pget(t, s, #s + 1, key) end  -- (a short read: damage)
  local out = unpack_doubles(s, a, count)
  for i = 1, count do
    local v = out[i]
    if v ~= v or v < 0 or v > P_MAX then pcheck(v, key) end
  end
  return out
end

-- the doubles of s (little-endian, 8 bytes each; #s a multiple of 8, else nil); nil where
-- the server has no struct library
local function doubles(s)
  if not STRUCT or #s % 8 ~= 0 then return nil end
  return unpack_doubles(s, 1, #s / 8)
end

-- a leaf's bytes, and a node's (sum, least positive leaf), in t's encoding
local function penc(t, v)
  if t.bin then return STRUCT.pack('<d', v) end
  return pfmt(v)
end

local function penc_node(t, s, m)
  if t.bin then return STRUCT.pack('<dd', s, m) end
  return pfmt(s) .. pfmt(m)
end

-- a value as the draw replies give it: the text as stored, or the double as '%.17g' (exact)
local function ptext(t, v, stored)
  if t.bin then return string.format('%.17g', v) end
  return stored
end

-- the strings have the sizes of the ring's tree (else: damaged, evicted, another capacity)
local function prio_check_sizes(t)
  if slen(t.pl) ~= t.cap * t.pw or slen(t.pt) ~= t.bytes or slen(t.pg) ~= t.cap * GW or slen(t.pm) ~= PW then
    tds_error('TDS_CORRUPT', 'the priority tree of ' .. t.pl .. ' is not the one of a ring of ' .. int_str(t.cap)
      .. ' rows (damaged, evicted, or the batch size changed); disable_priorities() and enable_priorities() rebuild it')
  end
end

-- the sums (and, with mins, the least positive leaves) of nodes first..last (0-based) of level l
local function prio_read(t, l, first, last, mins)
  local sums, low = {}, {}
  local count = last - first + 1
  if l == 0 then
    local s = rcall('GETRANGE', t.pl, iarg(first * t.pw), iarg((last + 1) * t.pw - 1))
    sums = pvalues(t, s, 1, count, t.pl)
    for i = 1, count do low[i] = sums[i] end
  else
    local base = t.offs[l]
    local s = rcall('GETRANGE', t.pt, iarg(base + first * t.nw), iarg(base + (last + 1) * t.nw - 1))
    local vals = pvalues(t, s, 1, 2 * count, t.pt)
    for i = 1, count do
      sums[i] = vals[2 * i - 1]
      if mins then low[i] = vals[2 * i] end
    end
  end
  return sums, low
end

-- recomputes the inner nodes above the leaf runs: sorted, disjoint {lo, hi} (0-based,
-- inclusive), whose new values the table leaves gives (row -> value; every row of a run
-- gets one) and whose new bytes leaf_bytes(lo, hi); it writes the leaves and the nodes.
-- Every read comes before the first write, so damage found on the way (a TDS_CORRUPT
-- error) leaves the tree as it was. (Reading the groups of a level in merged windows
-- measured no faster: a Lua string costs the server about what a call does for each 100
-- bytes.)
local prio_fix_f64

local function prio_fix(t, runs, leaves, leaf_bytes)
  if t.bin then return prio_fix_f64(t, runs, leaves, leaf_bytes) end
  local k = t.k
  local over = {}  -- (the nodes of the level below recomputed here: node -> {sum, least})
  local writes = {}
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
    if l == 1 then
      for _, run in ipairs(runs) do writes[#writes + 1] = {t.pl, iarg(run[1] * t.pw), leaf_bytes(run[1], run[2])} end
    end
    local done = {}
    for _, run in ipairs(parents) do
      local clo, chi = run[1] * k, math.min((run[2] + 1) * k, below) - 1
      local sums, low = prio_read(t, l - 1, clo, chi, true)
      for c = clo, chi do
        if l == 1 then
          local v = leaves[c]
          if v then sums[c - clo + 1], low[c - clo + 1] = v, v end
        else
          local o = over[c]
          if o then sums[c - clo + 1], low[c - clo + 1] = o[1], o[2] end
        end
      end
      local out = {}
      for p = run[1], run[2] do
        local s, m = 0, 0
        for c = p * k - clo + 1, math.min(p * k + k, below) - clo do
          s = s + sums[c]
          local mc = low[c]
          if mc > 0 and (m == 0 or mc < m) then m = mc end
        end
        done[p] = {s, m}
        out[#out + 1] = penc_node(t, s, m)
      end
      writes[#writes + 1] = {t.pt, iarg(t.offs[l] + run[1] * t.nw), table.concat(out)}
    end
    over = done
    runs = parents
  end
  for _, w in ipairs(writes) do rcall('SETRANGE', w[1], w[2], w[3]) end
end

-- prio_fix of a tree of doubles: the same reads, sums and writes, with a group's values
-- unpacked in one call and no table per run or node (the update's share of a prioritized
-- round: about half of the server time of prio_fix's general path)
prio_fix_f64 = function(t, runs, leaves, leaf_bytes)
  local k, sizes, offs, floor, min = t.k, t.sizes, t.offs, math.floor, math.min
  local unpack_d, pack = STRUCT.unpack, STRUCT.pack
  local wkey, woff, wval, nw = {}, {}, {}, 0  -- (the writes, made after every read)
  -- the runs of a level: lo[i] .. hi[i]
  local lo, hi = {}, {}
  for i, run in ipairs(runs) do
    lo[i], hi[i] = run[1], run[2]
    nw = nw + 1
    wkey[nw], woff[nw], wval[nw] = t.pl, iarg(run[1] * 8), leaf_bytes(run[1], run[2])
  end
  local osum, omin = leaves, leaves  -- (the values of level l - 1 recomputed: node -> value)
  for l = 1, t.depth do
    local below = sizes[l - 1]
    local plo, phi, np = {}, {}, 0
    for i = 1, #lo do
      local a, b = floor(lo[i] / k), floor(hi[i] / k)
      if np > 0 and a <= phi[np] + 1 then
        if b > phi[np] then phi[np] = b end
      else
        np = np + 1
        plo[np], phi[np] = a, b
      end
    end
    local nsum, nmin = {}, {}
    local key, width, base, per = t.pt, 16, offs[l - 1], 2  -- (per: values per child, a node's sum and least)
    if l == 1 then key, width, base, per = t.pl, 8, 0, 1 end
    for i = 1, np do
      local clo, chi = plo[i] * k, min((phi[i] + 1) * k, below) - 1
      local count = chi - clo + 1
      local raw = rcall('GETRANGE', key, iarg(base + clo * width), iarg(base + (chi + 1) * width - 1))
      if #raw ~= count * width then pget(t, raw, #raw + 1, key) end  -- (a short read: damage)
      local nv = count * per
      local vals
      if nv <= 64 then  -- (the usual group: one unpack)
        vals = {unpack_d(dfmt(nv), raw)}
      else
        vals = unpack_doubles(raw, 1, nv)
      end
      -- (a value read is checked where it is used: a child replaced here is not read)
      local out, c, j = {}, clo, 1
      for p = plo[i], phi[i] do
        local s, m = 0, 0
        local last = min(p * k + k, below) - 1
        if per == 1 then
          while c <= last do
            local v = osum[c]
            if not v then
              v = vals[j]
              if not (v >= 0 and v <= P_MAX) then pcheck(v, key) end
            end
            s = s + v
            if v > 0 and (m == 0 or v < m) then m = v end
            c, j = c + 1, j + 1
          end
        else
          while c <= last do
            local v, mc = osum[c], nil
            if v then
              mc = omin[c]
            else
              v, mc = vals[j], vals[j + 1]
              if not (v >= 0 and v <= P_MAX and mc >= 0 and mc <= P_MAX) then
                pcheck(v, key)
                pcheck(mc, key)
              end
            end
            s = s + v
            if mc > 0 and (m == 0 or mc < m) then m = mc end
            c, j = c + 1, j + 2
          end
        end
        nsum[p], nmin[p] = s, m
        out[#out + 1] = pack('<dd', s, m)
      end
      nw = nw + 1
      wkey[nw], woff[nw], wval[nw] = t.pt, iarg(offs[l] + plo[i] * 16), table.concat(out)
    end
    osum, omin, lo, hi = nsum, nmin, plo, phi
  end
  for i = 1, nw do rcall('SETRANGE', wkey[i], woff[i], wval[i]) end
end

-- A descent of tree t (prio_tree) for masses u * total: returns a function of u giving the
-- row drawn and its leaf's value: the number on a tree of doubles (t.bin), else the text as
-- stored (exact). Each group of children read is decoded lazily (a descent reads about half
-- of one) and kept for the later descents of the same script call.
local function prio_descender(t, total)
  local k = t.k
  local cache = {}
  for l = 0, t.depth do cache[l] = {} end
  if t.bin then
    -- doubles: a group's sums are unpacked in one call (the inner nodes' least leaves
    -- skipped), then checked; a third of the text path's server time per group
    local fmts, unpack_d = {}, STRUCT.unpack
    local function fmt(count, skip)
      local key = count * 2 + skip
      if not fmts[key] then
        local one = 'd'
        if skip == 1 then one = 'dxxxxxxxx' end
        fmts[key] = '<' .. string.rep(one, count)
      end
      return fmts[key]
    end
    return function(u)
      local mass, node, value = u * total, 0, 0
      for l = t.depth, 1, -1 do
        local below = l - 1
        local group = cache[below][node]
        if not group then
          local f = node * k
          local count = math.min(f + k, t.sizes[below]) - f
          local raw, key, skip
          if below == 0 then
            key, skip = t.pl, 0
            raw = rcall('GETRANGE', key, iarg(f * 8), iarg((f + count) * 8 - 1))
          else
            key, skip = t.pt, 1
            local base = t.offs[below]
            raw = rcall('GETRANGE', key, iarg(base + f * 16), iarg(base + (f + count) * 16 - 1))
          end
          if #raw ~= count * (8 + 8 * skip) then pget(t, raw, #raw + 1, key) end  -- (a short read: damage)
          group = {unpack_d(fmt(count, skip), raw)}
          group[count + 1] = nil  -- (unpack's next position)
          for i = 1, count do
            local v = group[i]
            if v ~= v or v < 0 or v > P_MAX then pcheck(v, key) end
          end
          cache[below][node] = group
        end
        -- (the child whose running sum first passes the mass: a zero child never does, as
        -- adding 0 leaves the sum; past the end, by rounding, the last positive child)
        local pick, acc, n = nil, 0, #group
        for i = 1, n do
          local after = acc + group[i]
          if mass < after then
            pick = i
            break
          end
          acc = after
        end
        if not pick then
          for i = n, 1, -1 do
            if group[i] > 0 then
              pick = i
              break
            end
          end
          if not pick then
            tds_error('TDS_CORRUPT', 'the priority tree ' .. t.pt .. ' has a node with a positive sum and no positive child'
              .. ' (damaged?); disable_priorities() and enable_priorities() rebuild it')
          end
          acc = 0
          for i = 1, pick - 1 do acc = acc + group[i] end
        end
        mass = mass - acc
        value = group[pick]
        node = node * k + pick - 1
      end
      return node, value
    end
  end
  return function(u)
    local mass, node, value = u * total, 0, ''
    for l = t.depth, 1, -1 do
      local below = l - 1
      local group = cache[below][node]
      if not group then
        local f = node * k
        local count = math.min(f + k, t.sizes[below]) - f
        local width, key, base = t.nw, t.pt, 0
        if below == 0 then width, key = t.pw, t.pl else base = t.offs[below] end
        local raw = rcall('GETRANGE', key, iarg(base + f * width), iarg(base + (f + count) * width - 1))
        group = {raw = raw, count = count, width = width, key = key}
        cache[below][node] = group
      end
      local pick, before, acc = nil, 0, 0
      local raw, width = group.raw, group.width
      for i = 1, group.count do
        local v = group[i]
        if v == nil then
          v = pget(t, raw, (i - 1) * width + 1, group.key)
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
      if below == 0 then
        value = ptext(t, group[pick], not t.bin and string.sub(raw, (pick - 1) * width + 1, (pick - 1) * width + PW))
      end
      node = node * k + pick - 1
    end
    return node, value
  end
end

-- the largest priority given so far, or nil (none yet)
local function prio_max(t)
  local raw = rcall('GETRANGE', t.pm, '0', iarg(PW - 1))
  if string.match(raw, '^ *$') then return nil end
  return pnum(raw, t.pm)
end
