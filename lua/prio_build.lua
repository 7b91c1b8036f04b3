--[[ prio_build
Turns prioritized sampling on ("enable"), rebuilds its tree ("reset": the ring was emptied
or its cursor set, lua/ring_total.lua; sent in the same MULTI) or turns it off ("off"), as
one step. See lua/lib/prio.lua for the keys and docs/replay.md for the semantics.

"enable" writes the settings (meta field "prio") and builds the tree: every row flagged as
written (lua/reserve.lua; with no flags key, the first min(cursor, capacity) rows) gets the
initial priority 1, so p = (1 + eps)^alpha; the other rows 0 (never drawn, until their
append gives them the max priority). Every generation is 0, the max priority none. It
bumps the layout version, so that every appender re-plans and its next append's MULTI
carries lua/prio_new.lua. Called again with the same alpha, eps, arity, capacity and encoding, it
only replaces the settings (a new beta) and keeps the priorities. "reset" rebuilds the
tree under the settings kept (nothing when priorities are off). "off" deletes the tree
and the settings and bumps the layout version. The keys written get the store's expiry.

KEYS[1]   meta hash of the store ("lv", "exp", "prio")
KEYS[2]   ring cursor
KEYS[3]   row flags
KEYS[4]   priority leaves
KEYS[5]   priority tree (inner levels)
KEYS[6]   generations
KEYS[7]   max priority

ARGV[1]   "enable", "reset" or "off"
ARGV[2]   "enable": the settings, a JSON object {alpha, beta, eps, k, cap} (cap: the capacity),
          and optionally enc ("f64" or "text", lua/lib/prio.lua); without it, the settings
          kept get "enc": "f64" where this server's Lua has struct, else "text"

Returns: "enable": 2 when it built the tree, 1 when it only replaced the settings;
         "reset", "off": 1, or 0 when priorities were off (nothing written)

Damaged settings or a damaged tree are replaced by "enable" and deleted by "off".

Errors:
  TDS_NOSTORE  the store does not exist
  TDS_BADARG   an unknown mode, or the encoding "f64" on a server whose Lua has no struct
  TDS_CORRUPT  the settings (given, or kept for "reset") are malformed, or the cursor is
               not a row count
]]
--@include lib/common.lua
--@include lib/prio.lua

return protect(function()
  local meta = rcall('HMGET', KEYS[1], 'lv', 'exp')
  if not meta[1] then
    return fail('TDS_NOSTORE', 'no store at ' .. KEYS[1])
  end
  local exp = meta[2] or ''
  local mode = ARGV[1]
  -- (damaged settings or tree: "enable" and "off" replace them, "reset" refuses them)
  local kept, old = pcall(prio_settings, KEYS[1])
  if not kept then
    if mode == 'reset' then error(old) end
    old = {damaged = true}
  end
  if mode == 'off' then
    if not old then return 0 end
    rcall('HDEL', KEYS[1], 'prio')
    rcall('DEL', KEYS[4], KEYS[5], KEYS[6], KEYS[7])
    rcall('HINCRBY', KEYS[1], 'lv', 1)
    return 1
  end
  local s
  if mode == 'enable' then
    s = prio_parse(ARGV[2] or '', 'the settings given')  -- (checked before the first write)
    if not s.enc_given then
      -- (doubles wherever this server's Lua can read them: lib/prio.lua)
      if STRUCT then s.enc = 'f64' end
      local raw, n = string.gsub(s.raw, '}%s*$', ', "enc": "' .. s.enc .. '"}', 1)
      if n ~= 1 then return fail('TDS_BADARG', 'the settings given are not a JSON object') end
      s.raw = raw
    elseif s.enc == 'f64' and not STRUCT then
      return fail('TDS_BADARG', 'the encoding "f64" needs the struct library, which this server\'s Lua has not')
    end
    rcall('HSET', KEYS[1], 'prio', s.raw)
    if old and not old.damaged and old.alpha == s.alpha and old.eps == s.eps and old.k == s.k and old.cap == s.cap
        and old.enc == s.enc and pcall(prio_check_sizes, prio_tree(old, KEYS[4], KEYS[5], KEYS[6], KEYS[7])) then
      return 1
    end
  elseif mode == 'reset' then
    if not old then return 0 end
    s = old
  else
    return fail('TDS_BADARG', 'unknown mode ' .. tostring(mode))
  end
  local t = prio_tree(s, KEYS[4], KEYS[5], KEYS[6], KEYS[7])
  local cap, k = t.cap, t.k

  -- the rows written: their flags, or (no flags key: a ring appended to before flags existed)
  -- the first min(cursor, capacity)
  local flags
  if rcall('EXISTS', KEYS[3]) == 1 then
    flags = rcall('GETRANGE', KEYS[3], '0', iarg(cap - 1))
  else
    local cursor = tonumber(rcall('GET', KEYS[2]) or '0')
    if cursor == nil or cursor ~= cursor or cursor < 0 then
      tds_error('TDS_CORRUPT', 'the ring cursor ' .. KEYS[2] .. ' is not a row count')
    end
    flags = string.rep('\1', math.min(cursor, cap))
  end
  local p0 = (1 + s.eps) ^ s.alpha
  local one, zero = penc(t, p0), penc(t, 0)

  -- leaves: runs of written rows, and of the others
  local out, pos = {}, 1
  while pos <= #flags do
    local a, b = string.find(flags, '\1+', pos)
    if not a then break end
    if a > pos then out[#out + 1] = string.rep(zero, a - pos) end
    out[#out + 1] = string.rep(one, b - a + 1)
    pos = b + 1
  end
  out[#out + 1] = string.rep(zero, cap - math.min(pos - 1, cap))
  local leaves = table.concat(out)  -- (rows past the flags are unwritten)

  -- level 1 from the counts of written rows in each group, then each level from the one below
  local full = string.rep('\1', k)
  local sums, mins = {}, {}
  for g = 0, t.sizes[1] - 1 do
    local part = string.sub(flags, g * k + 1, g * k + k)
    local c
    if part == full then
      c = k
    elseif not string.find(part, '\1', 1, true) then
      c = 0
    else
      local _, m = string.gsub(part, '\1', '')
      c = m
    end
    sums[g + 1] = c * p0
    if c > 0 then mins[g + 1] = p0 else mins[g + 1] = 0 end
  end
  local levels = {}
  for l = 1, t.depth do
    if l > 1 then
      local up_s, up_m = {}, {}
      for p = 0, t.sizes[l] - 1 do
        local su, mi = 0, 0
        for c = p * k + 1, math.min(p * k + k, t.sizes[l - 1]) do
          su = su + sums[c]
          if mins[c] > 0 and (mi == 0 or mins[c] < mi) then mi = mins[c] end
        end
        up_s[p + 1] = su
        up_m[p + 1] = mi
      end
      sums, mins = up_s, up_m
    end
    local text = {}
    for i = 1, #sums do text[i] = penc_node(t, sums[i], mins[i]) end
    levels[t.depth - l + 1] = table.concat(text)
  end

  rcall('SET', KEYS[4], leaves)
  rcall('SET', KEYS[5], table.concat(levels))
  rcall('SET', KEYS[6], string.rep(gfmt(0), cap))
  rcall('SET', KEYS[7], string.rep(' ', PW))
  if exp ~= '' then
    for _, key in ipairs({KEYS[4], KEYS[5], KEYS[6], KEYS[7]}) do rcall('PEXPIREAT', key, exp) end
  end
  if mode == 'reset' then return 1 end
  rcall('HINCRBY', KEYS[1], 'lv', 1)
  return 2
end)
