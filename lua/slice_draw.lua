--[[ slice_draw
Draws the starts of trajectory slices: windows of L consecutive ring positions (in append
order) that cross neither an episode end nor the ring's write position and hold only rows
flagged as written. The first step of store.sample_slices(); no row byte but those of the
episode column passes through this script.

Positions are absolute: rows ever reserved before the row (the ring's row is the position
modulo the capacity). With c the cursor and size = min(c, cap), the ring holds positions
c - size .. c - 1; a window [a, a + L) lies in them when c - size <= a <= c - L.

The episode index is the column that every append writes (KEYS[4]). "end": one element
per row of itemsize bytes, non-zero = the row ends its episode (a bool done is one byte per
row); a window is valid when none of its first L - 1 rows is an end (its last may be).
"traj": one integer per row; a window is valid when its L ids are equal. Each window tested
has its L items (and its L flags) read with GETRANGE; when the uniforms given would test
windows covering the ring's rows, the column and the flags are read once whole instead.

Modes of ARGV[6]:
  "u"  uniform: each uniform u gives a = c - size + floor(u * (size - L + 1)); an invalid
       window is rejected and the next uniform used (uniform over the valid windows)
  "p"  prioritized: each u gives a row by a descent of the priority tree (as
       lua/prio_draw.lua), the start of the window; an invalid one is rejected
  "us", "ps"  scan: the ring's rows are cut into segments at each end (or id change) and
       each row not written, found with string.find over the column and the flags read
       whole; the n starts are then drawn exactly among the valid windows, uniformly ("us")
       or by the p of their start row ("ps": one leaf read per valid window), one uniform
       each. For rings where rejection keeps failing (few valid windows)

KEYS[1]   meta hash of the store ("lv", "prio", "lim")
KEYS[2]   ring cursor
KEYS[3]   row flags
KEYS[4]   the episode column (the entry's one data string)
KEYS[5]   priority leaves
KEYS[6]   priority tree (inner levels)
KEYS[7]   generations
KEYS[8]   max priority

ARGV[1]   the layout version the client assumed
ARGV[2]   "end" or "traj"
ARGV[3]   itemsize of the column, 1 to 8 bytes
ARGV[4]   cap: the ring's capacity (rows)
ARGV[5]   L: the slice length, 1 to cap
ARGV[6]   mode: "u", "p", "us" or "ps"
ARGV[7]   n: the number of slices wanted
ARGV[8..] uniforms in [0, 1), at least n of them (the extra ones replace rejected draws)

Flags: no-writes

Returns: {1, starts (absolute positions), the cursor as text, lim, their p as stored joined
          by spaces, their generations (16 digits each, back to back), the least positive p
          of the tree as text, the settings JSON}: fewer than n starts when the uniforms ran
          out (the last four "" when not prioritized);
         {0, {}, cursor, lim} when prioritized and priorities are off;
         {-1, {}, cursor, lim} when no window is valid (the ring holds fewer than L rows; a
          scan found none; prioritized: no positive p).
         lim is 1 when the ring has a rate limiter (the meta hash's "lim"), else 0

Errors:
  TDS_NOSTORE  the store does not exist
  TDS_STALE    the layout version is not the one the client assumed
  TDS_BADARG   an argument is not a number of its range, or an unknown mode
  TDS_CORRUPT  the episode column is not cap * itemsize bytes, or the cursor, the priority
               settings or the tree are damaged
]]
--@include lib/common.lua
--@include lib/prio.lua

return protect(function()
  local bad = check_layout(KEYS[1], ARGV[1])
  if bad then return bad end
  local kind, mode = ARGV[2], ARGV[6]
  local isz, cap, L, want = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[7])
  local function whole(x, lo, hi)
    return x ~= nil and x == x and x >= lo and x <= hi and x == math.floor(x)
  end
  if (kind ~= 'end' and kind ~= 'traj') or not whole(isz, 1, 8) or not whole(cap, 1, 4503599627370496)
    or not whole(L, 1, cap) or not whole(want, 0, #ARGV - 7)
    or (mode ~= 'u' and mode ~= 'p' and mode ~= 'us' and mode ~= 'ps') then
    return fail('TDS_BADARG', 'need "end"|"traj", an itemsize, a capacity, a slice length <= it, a mode and a number of'
      .. ' slices with at least as many uniforms; got ' .. table.concat({ARGV[2] or '', ARGV[3] or '', ARGV[4] or '',
      ARGV[5] or '', ARGV[6] or '', ARGV[7] or ''}, ' '))
  end
  for i = 8, #ARGV do
    local u = tonumber(ARGV[i])
    if u == nil or u ~= u or u < 0 or u >= 1 then
      return fail('TDS_BADARG', 'a uniform must be in [0, 1), got ' .. tostring(ARGV[i]))
    end
  end
  local col_len = redis.pcall('STRLEN', KEYS[4])
  if col_len ~= cap * isz then
    return fail('TDS_CORRUPT', 'the episode column ' .. KEYS[4] .. ' is not the string of ' .. int_str(cap) .. ' rows of '
      .. int_str(isz) .. ' bytes (damaged or evicted)')
  end
  local raw_c = redis.pcall('GET', KEYS[2])
  local bad_c = check_counter(KEYS[2], 'the ring cursor', raw_c)
  if bad_c then return bad_c end
  local cursor = tonumber(raw_c or '0')
  if cursor < 0 then return fail('TDS_CORRUPT', 'the ring cursor ' .. KEYS[2] .. ' is negative') end
  local ctext = int_str(cursor)
  local lim = 0
  if rcall('HGET', KEYS[1], 'lim') then lim = 1 end
  local prioritized = mode == 'p' or mode == 'ps'
  local t, s, total, low
  if prioritized then
    s = prio_settings(KEYS[1])
    if not s then return {0, {}, ctext, lim} end
    t = prio_tree(s, KEYS[5], KEYS[6], KEYS[7], KEYS[8])
    if t.cap ~= cap then
      tds_error('TDS_CORRUPT', 'the priority tree of ' .. KEYS[5] .. ' covers ' .. int_str(t.cap) .. ' rows, not the ring\'s '
        .. int_str(cap) .. '; disable_priorities() and enable_priorities() rebuild it')
    end
    prio_check_sizes(t)
    local root
    root, low = prio_read(t, t.depth, 0, 0, true)
    total = root[1]
    if not (total > 0) then return {-1, {}, ctext, lim} end
  end
  local size = math.min(cursor, cap)
  local first, last = cursor - size, cursor - L -- the window starts the ring holds
  if last < first then return {-1, {}, ctext, lim} end
  local flagged = rcall('EXISTS', KEYS[3]) == 1

  -- the bytes of rows r .. r + count - 1 of the ring (wrapping) of a string of w bytes per row
  local function span(key, r, count, w)
    if r + count <= cap then
      return rcall('GETRANGE', key, iarg(r * w), iarg((r + count) * w - 1))
    end
    return rcall('GETRANGE', key, iarg(r * w), iarg(cap * w - 1))
      .. rcall('GETRANGE', key, '0', iarg((r + count - cap) * w - 1))
  end
  -- when the windows to test would cover the ring's column, it is read once (two GETRANGEs)
  -- and the windows cut from it; else each window's bytes are read on their own
  local whole_col, whole_fl
  if mode == 'u' or mode == 'p' then
    if (#ARGV - 7) * L >= size then
      whole_col = rcall('GETRANGE', KEYS[4], '0', iarg(cap * isz - 1))
      if flagged then whole_fl = rcall('GETRANGE', KEYS[3], '0', iarg(cap - 1)) end
    end
  end
  local function cut(whole, r, count, w)
    if r + count <= cap then return string.sub(whole, r * w + 1, (r + count) * w) end
    return string.sub(whole, r * w + 1, cap * w) .. string.sub(whole, 1, (r + count - cap) * w)
  end
  local ones, zeros = string.rep('\1', L), string.rep('\0', (L - 1) * isz)
  local function valid(a)
    if a < first or a > last then return false end
    local r = a % cap
    local fl, col
    if whole_col then
      if flagged then fl = cut(whole_fl, r, L, 1) end
      col = cut(whole_col, r, L, isz)
    else
      if flagged then fl = span(KEYS[3], r, L, 1) end
      col = span(KEYS[4], r, L, isz)
    end
    if flagged and fl ~= ones then return false end
    if #col ~= L * isz then return false end
    if kind == 'end' then
      return string.sub(col, 1, (L - 1) * isz) == zeros
    end
    return col == string.rep(string.sub(col, 1, isz), L)
  end

  -- the leaf of a row, as stored, and its value
  local function leaf(row)
    local raw = rcall('GETRANGE', t.pl, iarg(row * t.pw), iarg(row * t.pw + t.pw - 1))
    local v = pget(t, raw, 1, t.pl)
    return ptext(t, v, raw), v
  end

  -- a descent of the tree for the mass u * total (lib/prio.lua): the row and its leaf's value
  local descend = t and prio_descender(t, total)

  local starts, values, gens = {}, {}, {}
  local function keep(a, value)
    starts[#starts + 1] = a
    if prioritized then
      values[#values + 1] = value
      local row = a % cap
      gens[#gens + 1] = rcall('GETRANGE', t.pg, iarg(row * GW), iarg(row * GW + GW - 1))
    end
  end

  if mode == 'u' or mode == 'p' then
    local count = last - first + 1
    local next_u = 8
    while #starts < want and next_u <= #ARGV do
      local u = tonumber(ARGV[next_u])
      next_u = next_u + 1
      if mode == 'u' then
        local a = math.min(first + math.floor(u * count), last)
        if valid(a) then keep(a) end
      else
        local row, value = descend(u)
        if t.bin then value = string.format('%.17g', value) end  -- (the reply's text: exact)
        -- the row's latest position: the one the ring holds, if any
        local a = cursor - 1 - ((cursor - 1 - row) % cap)
        if valid(a) then keep(a, value) end
      end
    end
  else
    -- the scan: the ring's rows (offsets 0 .. size-1 from position first) cut into segments
    -- at each row not written (left out) and after each end (or id change); a segment of
    -- m rows holds m - L + 1 valid windows. Ends and unwritten rows are found by
    -- string.find (C speed), so the Lua work is per episode, not per row
    local col = span(KEYS[4], first % cap, size, isz)
    local avail = math.min(size, math.floor(#col / isz))
    local fl
    if flagged then
      fl = string.sub(span(KEYS[3], first % cap, size, 1), 1, avail)
    else
      fl = string.rep('\1', avail)
    end
    if #fl < size then fl = fl .. string.rep('\0', size - #fl) end
    local holes, ends = {}, {}
    local p = 1
    while true do
      local i = string.find(fl, '[^\1]', p)
      if not i then break end
      holes[#holes + 1] = i - 1
      p = i + 1
    end
    if kind == 'end' then
      p = 1
      while true do
        local i = string.find(col, '[\1-\255]', p)
        if not i then break end
        local row = math.floor((i - 1) / isz)
        if row >= size - 1 then break end
        ends[#ends + 1] = row
        p = (row + 1) * isz + 1
      end
    else
      for j = 0, avail - 2 do
        if string.sub(col, j * isz + 1, (j + 1) * isz) ~= string.sub(col, (j + 1) * isz + 1, (j + 2) * isz) then
          ends[#ends + 1] = j
        end
      end
    end
    local segs, cum, total_w = {}, {}, 0
    local s0 = 0
    local function close(last_row, next_start)
      local m = last_row - s0 + 1
      if m >= L then
        segs[#segs + 1] = s0
        total_w = total_w + (m - L + 1)
        cum[#cum + 1] = total_w
      end
      if next_start > s0 then s0 = next_start end
    end
    local hi_, ei = 1, 1
    while hi_ <= #holes or ei <= #ends do
      local h, e = holes[hi_], ends[ei]
      if h and (not e or h <= e) then
        close(h - 1, h + 1)  -- (a row not written: in no window)
        hi_ = hi_ + 1
      else
        close(e, e + 1)  -- (an end: the last row of its windows)
        ei = ei + 1
      end
    end
    close(size - 1, size)
    -- the valid windows, in order: the windows of each segment
    local good, gcum, acc = {}, {}, 0
    if prioritized then
      for si = 1, #segs do
        local count = cum[si] - (cum[si - 1] or 0)
        for o = 0, count - 1 do
          local a = first + segs[si] + o
          local _, v = leaf(a % cap)
          if v > 0 then
            acc = acc + v
            good[#good + 1] = a
            gcum[#gcum + 1] = acc
          end
        end
      end
    end
    if (prioritized and #good == 0) or total_w == 0 then return {-1, {}, ctext, lim} end
    -- the first entry of a cumulative list c whose value passes target (binary search)
    local function find(c, target)
      local lo, hi = 1, #c
      while lo < hi do
        local mid = math.floor((lo + hi) / 2)
        if c[mid] > target then hi = mid else lo = mid + 1 end
      end
      return lo
    end
    for i = 8, 7 + want do
      local u = tonumber(ARGV[i])
      if prioritized then
        local pick = find(gcum, u * acc)
        keep(good[pick], (leaf(good[pick] % cap)))
      else
        -- window number w (0-based) of the total_w, in its segment
        local w = math.min(math.floor(u * total_w), total_w - 1)
        local si = find(cum, w)
        keep(first + segs[si] + w - (cum[si - 1] or 0))
      end
    end
  end
  if not prioritized then return {1, starts, ctext, lim, '', '', '', ''} end
  return {1, starts, ctext, lim, table.concat(values, ' '), table.concat(gens), string.format('%.17g', low[1]), s.raw}
end)
