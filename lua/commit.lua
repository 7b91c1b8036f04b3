--[[ commit
Applies entry writes, deletions and store metadata changes of one store as one step:
the bytes, the registry and the layout version change together or not at all.

KEYS[1]   meta hash of the store (layout: batch size, names, lock, layout version)
KEYS[2]   registry hash (entry path -> JSON metadata)
KEYS[3]   write-version counter of the store (a string key, bumped by every write)
KEYS[4..] data keys and tmp keys, referred to by their index in the ops

ARGV[1]   expected layout version: a decimal string; "" skips the check; "new" creates
          the store and requires that it does not exist
ARGV[2]   "1" bumps the layout version (any change of keys, shapes, dtypes or sizes)
ARGV[3]   "1" refuses the change when the store is locked
ARGV[4]   JSON object of meta hash fields to set (string values; not lv or fmt,
          which only the scripts change), or ""
ARGV[5]   JSON array of ops, applied in order, each an object with string fields:
            {"op":"put",  "f":path, "m":meta, "src":i, "dst":j}  rename tmp KEYS[i] to KEYS[j]
            {"op":"zero", "f":path, "m":meta, "dst":j, "n":bytes} zero-filled string
            {"op":"del",  "f":path, "dst":j}     remove an entry ("dst" absent for a node)
            {"op":"node", "f":path, "m":meta}    register a nested tensordict (no bytes)
            {"op":"move", "f":old, "t":new, "m":meta, "src":i, "dst":j}  rename an entry
          "put", "del" (with a dst) and "move" take an optional "r": a run of r keys, KEYS[src ..
          src + r - 1] to KEYS[dst .. dst + r - 1] (the strings of a chunked entry, see
          tdstore/_chunks.py); the registry changes once per op.
ARGV[6]   the format version written into a new store
ARGV[7]   expected write version (KEYS[3], bumped by every write of any process;
          missing reads as "0"): a decimal string, or "" to skip the check. Read-modify-write
          methods send the one they read with their snapshot (compare-and-set).
          Not checked when ARGV[1] is "new".
ARGV[8]   the first layout version of a new store (decimal string; default "0"). The
          client draws it at random, so that a store re-created under the same td_id
          never repeats a version that a client may still have cached.
ARGV[9]   optional: the lifetime of a new store in ms (a positive decimal of at most 15
          digits), or "" for none; only read when ARGV[1] is "new". Every key of the store
          then expires at that time (see expire.lua; meta fields "exp" and "ttl").
ARGV[10]  optional: a compare-and-set that appends to other entries do not disturb, in
          place of ARGV[7] (send "" there): a JSON object {"w": the write version less
          the number of appends (the sum of the append counters, see
          tdstore/_backend/append.py), "f": {counter field: value ("" for absent)}},
          checked like ARGV[7]; "f" names the append counters ("a:" .. sub-store path)
          of every sub-store whose appends write entries the client read. The counters
          are the hash "<base>:ac" beside the meta hash "<base>:meta" (a key this script
          derives from KEYS[1], not declared). Not checked when ARGV[1] is "new".

The meta field "ne" counts the registry's fields, so that a reader can tell a registry
that was evicted (or deleted by hand) from a store with no entries. A store created before
the field existed has none and keeps none.

A store with an expiry (meta field "exp") gives every key this script creates or renames
into place that same expiry, so that the whole store expires at once.

Returns: the layout version after the change (integer)

Errors:
  TDS_NOSTORE  the store does not exist (and ARGV[1] is not "new")
  TDS_EXISTS   ARGV[1] is "new" and the store exists
  TDS_STALE    the layout version differs from ARGV[1]
  TDS_CONFLICT the write version differs from ARGV[7]
  TDS_LOCKED   ARGV[3] is "1" and the store is locked
  TDS_BUSY     ARGV[2] is "1" and a reader holds a lease on the layout (see lease.lua): the
               client waits and calls again; the tmp keys are kept for that call
  TDS_PARTIAL  a tmp key of a "put" is missing (its SET was refused); every tmp key is deleted
  TDS_BADARG   an op is malformed
  TDS_CORRUPT  the write version, an append counter (ARGV[10]) or the read-lease hash holds
               what no tdstore write makes (another type, garbage); checked before any write

When the last of KEYS is the store's read-lease hash (<prefix>:{<td_id>}:rl), a layout change
(ARGV[2] "1") is refused while a reader's lease on it is live (TDS_BUSY).

On every error but TDS_BUSY the tmp keys of the "put" ops are deleted and nothing else changes.
]]
--@include lib/common.lua
--@include lib/lease.lua

local meta_key, reg_key, wv_key = KEYS[1], KEYS[2], KEYS[3]
local expected, bump, check_lock = ARGV[1], ARGV[2], ARGV[3]
local meta_updates = {}
if ARGV[4] ~= '' then meta_updates = cjson.decode(ARGV[4]) end
local ops = cjson.decode(ARGV[5])

-- r: the number of keys of an op (its "r", 1 by default), or nil when malformed
local function run_of(op)
  local r = 1
  if op.r ~= nil then r = tonumber(op.r) end
  if r == nil or r < 1 or r ~= math.floor(r) then return nil end
  return r
end

-- the i-th key (0-based) of an op's run at field name, or nil when out of KEYS
local function key_at(op, name, i)
  local idx = tonumber(op[name])
  local r = run_of(op)
  if idx == nil or r == nil or idx ~= math.floor(idx) or idx < 4 or idx + r - 1 > #KEYS then return nil end
  return KEYS[idx + (i or 0)]
end

local function drop_tmps()
  for _, op in ipairs(ops) do
    if type(op) == 'table' and op.op == 'put' and key_at(op, 'src') then
      for i = 0, run_of(op) - 1 do rcall('DEL', key_at(op, 'src', i)) end
    end
  end
end

local function is_count(value)
  local n = tonumber(value)
  return n ~= nil and n >= 0 and n == math.floor(n)
end

-- validate everything before the first write
local needs_meta = {put = true, zero = true, node = true, move = true, del = false}
local function op_error(op)
  if type(op) ~= 'table' or type(op.op) ~= 'string' or needs_meta[op.op] == nil or type(op.f) ~= 'string' then
    return 'malformed op'
  end
  if needs_meta[op.op] and type(op.m) ~= 'string' then
    return 'op ' .. op.op .. ' needs metadata m'
  end
  if op.r ~= nil and (run_of(op) == nil or not (op.op == 'put' or op.op == 'move' or (op.op == 'del' and op.dst ~= nil))) then
    return 'op ' .. op.op .. ' has a bad run of keys r'
  end
  if (op.op == 'put' or op.op == 'move') and not (key_at(op, 'src') and key_at(op, 'dst')) then
    return 'op ' .. op.op .. ' needs src and dst keys'
  end
  if op.op == 'move' and type(op.t) ~= 'string' then
    return 'op move needs a target t'
  end
  if op.op == 'zero' and not (key_at(op, 'dst') and is_count(op.n)) then
    return 'op zero needs dst and a byte count n'
  end
  if op.op == 'del' and op.dst ~= nil and not key_at(op, 'dst') then
    return 'op del names a dst that is not in KEYS'
  end
  return nil
end
-- the counters and the expiry are owned by the scripts: a meta update must not overwrite them
for _, reserved in ipairs({'lv', 'fmt', 'exp', 'ttl', 'ne', 'clearing'}) do
  if meta_updates[reserved] ~= nil then
    drop_tmps()
    return fail('TDS_BADARG', 'meta field ' .. reserved .. ' cannot be set')
  end
end
for field, value in pairs(meta_updates) do
  if type(field) ~= 'string' or type(value) ~= 'string' then
    drop_tmps()
    return fail('TDS_BADARG', 'meta updates must map strings to strings')
  end
end
for _, op in ipairs(ops) do
  local problem = op_error(op)
  if problem then
    drop_tmps()
    return fail('TDS_BADARG', problem .. ': ' .. cjson.encode(op))
  end
end

if expected == 'new' then
  -- a plain decimal: the value is stored as is and later bumped with HINCRBY
  if ARGV[8] ~= nil and not (string.match(ARGV[8], '^[1-9]%d*$') or ARGV[8] == '0') then
    drop_tmps()
    return fail('TDS_BADARG', 'the first layout version must be a non-negative integer')
  end
  local ttl = ARGV[9] or ''
  if ttl ~= '' and not (string.match(ttl, '^[1-9]%d*$') and #ttl <= 15) then
    drop_tmps()
    return fail('TDS_BADARG', 'the lifetime must be a positive number of ms, got ' .. ttl)
  end
  if rcall('EXISTS', meta_key) == 1 then
    drop_tmps()
    local kind = rcall('TYPE', meta_key)
    if type(kind) == 'table' then kind = kind.ok end
    if kind == 'hash' and rcall('HGET', meta_key, 'clearing') then
      return fail('TDS_EXISTS', 'the store at ' .. meta_key .. ' is being deleted: a clear_redis() has not finished'
        .. ' (clear_redis() or `tdstore rm` finishes an interrupted one)')
    end
    return fail('TDS_EXISTS', 'a store already exists at ' .. meta_key)
  end
else
  local err = check_layout(meta_key, expected)
  if err then
    drop_tmps()
    return err
  end
  -- the write version, read once and only when needed (a compare-and-set, or a bump: ops)
  local wv_raw = nil
  if #ops > 0 or (ARGV[7] or '') ~= '' or (ARGV[10] or '') ~= '' then
    wv_raw = redis.pcall('GET', wv_key)
    err = check_counter(wv_key, 'the write version', wv_raw)
    if err then
      drop_tmps()
      return err
    end
  end
  if (ARGV[7] or '') ~= '' and (wv_raw or '0') ~= ARGV[7] then
    drop_tmps()
    return fail('TDS_CONFLICT', 'the store was written since the client read it')
  end
  if (ARGV[10] or '') ~= '' then
    local cas = cjson.decode(ARGV[10])
    local counters = {}
    local appends = 0
    local ac_key = string.sub(meta_key, 1, -5) .. 'ac'
    local flat = redis.pcall('HGETALL', ac_key)
    if type(flat) == 'table' and flat.err then
      drop_tmps()
      return fail('TDS_CORRUPT', 'the append counters ' .. ac_key .. ' are not a hash')
    end
    for i = 1, #flat, 2 do
      local count = tonumber(flat[i + 1])
      if count == nil or count ~= math.floor(count) then
        drop_tmps()
        return fail('TDS_CORRUPT', 'the append counter ' .. flat[i] .. ' of ' .. ac_key .. ' is not a count')
      end
      counters[flat[i]] = flat[i + 1]
      appends = appends + count
    end
    local same = tonumber(wv_raw or '0') - appends == tonumber(cas.w)
    for field, value in pairs(cas.f or {}) do
      if (counters[field] or '') ~= value then same = false end
    end
    if not same then
      drop_tmps()
      return fail('TDS_CONFLICT', 'the entries read were written since the client read them')
    end
  end
  if check_lock == '1' and rcall('HGET', meta_key, 'lock') == '1' then
    drop_tmps()
    return fail('TDS_LOCKED', 'the store at ' .. meta_key .. ' is locked')
  end
  -- a reader holds the layout still (lease.lua): the client waits and calls again
  local leased, bad = false, nil
  if bump == '1' and KEYS[#KEYS] == string.sub(meta_key, 1, -5) .. 'rl' then
    leased, bad = lease_left(KEYS[#KEYS])
  end
  if bad then
    drop_tmps()
    return fail('TDS_CORRUPT', bad)
  end
  if leased then
    return fail('TDS_BUSY', 'a read lease holds the layout of ' .. meta_key .. ' for ' .. int_str(leased) .. ' ms')
  end
end

for _, op in ipairs(ops) do
  if op.op == 'put' then
    for i = 0, run_of(op) - 1 do
      if rcall('EXISTS', key_at(op, 'src', i)) == 0 then
        drop_tmps()
        return fail('TDS_PARTIAL', 'the bytes of ' .. op.f .. ' did not reach the server')
      end
    end
  end
end

-- apply
-- exp: the absolute expiry (ms, server clock) every key of the store shares, or false
local exp = false
if expected == 'new' then
  rcall('HSET', meta_key, 'lv', ARGV[8] or '0', 'fmt', ARGV[6], 'lock', '0', 'ne', '0')
  if (ARGV[9] or '') ~= '' then
    local now = rcall('TIME')
    exp = int_str(tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) + tonumber(ARGV[9]))
    rcall('HSET', meta_key, 'exp', exp, 'ttl', ARGV[9])
    rcall('PEXPIREAT', meta_key, exp)
  end
else
  exp = rcall('HGET', meta_key, 'exp')
  if exp == '' then exp = false end
end
for field, value in pairs(meta_updates) do
  rcall('HSET', meta_key, field, value)
end
-- ne: the change in the number of registry fields
local ne = 0
local function reg_set(field, value)
  ne = ne + rcall('HSET', reg_key, field, value)
end
local function reg_del(field)
  ne = ne - rcall('HDEL', reg_key, field)
end
for _, op in ipairs(ops) do
  local kind = op.op
  if kind == 'put' then
    for i = 0, run_of(op) - 1 do
      local dst = key_at(op, 'dst', i)
      rcall('RENAME', key_at(op, 'src', i), dst)
      -- tmp keys carry a TTL so that an abandoned one expires; the entry must not, or
      -- must expire with its store
      if exp then rcall('PEXPIREAT', dst, exp) else rcall('PERSIST', dst) end
    end
    reg_set(op.f, op.m)
  elseif kind == 'zero' then
    local dst = key_at(op, 'dst')
    local n = tonumber(op.n)
    rcall('DEL', dst)
    if n > 0 then
      rcall('SETRANGE', dst, iarg(n - 1), '\0')
    else
      rcall('SET', dst, '')
    end
    if exp then rcall('PEXPIREAT', dst, exp) end
    reg_set(op.f, op.m)
  elseif kind == 'del' then
    reg_del(op.f)
    if op.dst ~= nil then
      for i = 0, run_of(op) - 1 do rcall('DEL', key_at(op, 'dst', i)) end
    end
  elseif kind == 'node' then
    reg_set(op.f, op.m)
  elseif kind == 'move' then
    for i = 0, run_of(op) - 1 do
      local src, dst = key_at(op, 'src', i), key_at(op, 'dst', i)
      if rcall('EXISTS', src) == 1 then
        rcall('RENAME', src, dst)
        if exp then rcall('PEXPIREAT', dst, exp) end
      end
    end
    reg_del(op.f)
    reg_set(op.t, op.m)
  end
end
if ne ~= 0 and (expected == 'new' or rcall('HGET', meta_key, 'ne')) then
  rcall('HINCRBY', meta_key, 'ne', ne)
end
if #ops > 0 then
  rcall('INCR', wv_key)
  -- the registry and the counter may have been created just now (a hash emptied by
  -- "del" is deleted); the meta hash is left alone, as writers WATCH it
  if exp then
    rcall('PEXPIREAT', reg_key, exp)
    rcall('PEXPIREAT', wv_key, exp)
  end
end
if bump == '1' then
  return rcall('HINCRBY', meta_key, 'lv', 1)
end
return tonumber(rcall('HGET', meta_key, 'lv'))
