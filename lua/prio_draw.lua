--[[ prio_draw
Draws rows in proportion to their priority values p (lua/lib/prio.lua), with replacement,
among the rows flagged as written: the first step of a prioritized sample. No row byte
passes through this script; the client then reads the rows and checks their generations
(lua/prio_check.lua).

Each uniform u of ARGV gives the mass u * (sum of p), found by a descent of the tree; a
drawn row whose flag is clear (an append in flight, or one that died between its two steps)
is rejected and the next uniform is used, so the rows returned are drawn in proportion to p
among the written rows. Where every row is flagged (BITCOUNT), no flag is read per row.

KEYS[1]   meta hash of the store ("lv", "prio", "lim")
KEYS[2]   ring cursor
KEYS[3]   row flags
KEYS[4]   priority leaves
KEYS[5]   priority tree (inner levels)
KEYS[6]   generations
KEYS[7]   max priority

ARGV[1]   n: the number of rows wanted
ARGV[2..] uniforms in [0, 1), at least n of them (the extra ones replace rejected draws), as
          text; or ARGV[2] = "f64" and ARGV[3] the uniforms as little-endian doubles, 8 bytes
          each, back to back (needs the struct library: Redis, Valkey; no tonumber and no
          argument per uniform)

Flags: no-writes

Returns: {1, rows (0-based), their p, their generations (16 digits each, back to back), the
          least positive p of the tree as text, the settings JSON, lim, the ring cursor as
          stored (false: none)}. The p are, on a tree of doubles (the settings' "enc" is
          "f64"), little-endian doubles back to back; on a tree of text, the text as stored
          (exact) joined by spaces. Fewer than n rows
          when the uniforms ran out. A row drawn is not appended to later as long as the
          cursor has not reached its next position: the client reads the cursor again with
          the rows' bytes, and draws again the rows reserved in between;
         {0} when priorities are off; {-1, lim} when no row has a positive p.
         lim is 1 when the ring has a rate limiter (the meta hash's "lim": the client counts
         the sample against it, lua/rate_sample.lua), else 0

Errors:
  TDS_NOSTORE  the store does not exist
  TDS_BADARG   n or a uniform is not a number of the range
  TDS_CORRUPT  the settings or the tree are damaged
]]
--@include lib/common.lua
--@include lib/prio.lua

return protect(function()
  if not rcall('HGET', KEYS[1], 'lv') then
    return fail('TDS_NOSTORE', 'no store at ' .. KEYS[1])
  end
  local s = prio_settings(KEYS[1])
  if not s then return {0} end
  local want = tonumber(ARGV[1])
  local argc = #ARGV
  local us, first, last = nil, 2, argc  -- (the uniforms: ARGV[first..last] as text, or us[first..last])
  if ARGV[2] == 'f64' then
    us, first = doubles(ARGV[3] or ''), 1
    if not us then
      return fail('TDS_BADARG', 'the uniforms in "f64" are not doubles (8 bytes each), or this server has no struct library')
    end
    last = #us
  end
  if want == nil or want ~= want or want < 0 or want ~= math.floor(want) or want > last - first + 1 then
    return fail('TDS_BADARG', 'need a number of rows and at least as many uniforms, got ' .. tostring(ARGV[1]))
  end
  local t = prio_tree(s, KEYS[4], KEYS[5], KEYS[6], KEYS[7])
  prio_check_sizes(t)
  local lim = 0
  if rcall('HGET', KEYS[1], 'lim') then lim = 1 end
  local root, low = prio_read(t, t.depth, 0, 0, true)
  local total = root[1]
  if not (total > 0) then return {-1, lim} end

  local flagged = rcall('EXISTS', KEYS[3]) == 1
  -- every row flagged (a bit per flag byte of the ring's rows): no draw can be rejected, so no
  -- flag is read per row (the client's read checks the flags again, in its own snapshot)
  local all = false
  if flagged then all = redis.pcall('BITCOUNT', KEYS[3], '0', iarg(t.cap - 1)) == t.cap end
  local cursor = redis.pcall('GET', KEYS[2])
  if type(cursor) == 'table' then cursor = false end  -- (not a string: the client checks the rows instead)
  local counted = 0
  if not flagged then counted = math.min(tonumber(cursor or '0') or 0, t.cap) end
  local descend = prio_descender(t, total)
  local rows, values, gens = {}, {}, {}
  local next_u = first
  while #rows < want and next_u <= last do
    local u
    if us then u = us[next_u] else u = tonumber(ARGV[next_u]) end
    next_u = next_u + 1
    if u == nil or u ~= u or u < 0 or u >= 1 then
      local given = us and us[next_u - 1] or ARGV[next_u - 1]
      return fail('TDS_BADARG', 'a uniform must be in [0, 1), got ' .. tostring(given))
    end
    local node, value = descend(u)
    local ok
    if flagged then
      ok = all or rcall('GETRANGE', KEYS[3], iarg(node), iarg(node)) == '\1'
    else
      ok = node < counted
    end
    if ok then
      rows[#rows + 1] = node
      values[#values + 1] = value
      gens[#gens + 1] = rcall('GETRANGE', t.pg, iarg(node * GW), iarg(node * GW + GW - 1))
    end
  end
  local pvals
  if t.bin then pvals = pack_doubles(values) else pvals = table.concat(values, ' ') end
  return {1, rows, pvals, table.concat(gens), string.format('%.17g', low[1]), s.raw, lim, cursor}
end)
