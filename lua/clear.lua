--[[ clear
Deletes every key of one store as one step, or seals it first (ARGV[1] "seal").

A clear is two steps (tdstore/_backend/lifecycle.py). The seal moves the meta field "lv"
to "clearing": every script and every WATCHed transaction then finds no store (no "lv"),
so no writer changes the keys any more, and no new store is made at the id while the meta
hash exists. The client lists the keys once, and the second step deletes them. A clear
therefore never retries because writers keep changing the store under it.

Seal: KEYS[1] the meta hash, ARGV[1] "seal". Returns 1 when it sealed a store, 0 when
there was none to seal (no meta hash, one of another type, no "lv": sealed already,
or damaged).

Doom: KEYS the meta hash and every key the client can name of the sealed store (its
registry's data keys, the fixed families), ARGV[1] "doom", ARGV[2] a grace in ms. Each
key that exists and would outlive the grace expires at its end, so that a clear cut off
before its delete (the process killed) still frees the store's keys within the grace. Does
nothing unless the store is sealed (a store made at the id meanwhile is left alone).
Returns the number of keys given the grace.

KEYS[1]   meta hash of the store
KEYS[2]   registry hash
KEYS[3..] the store's other keys: its write-version counter, its ring cursor and the
          data key of every entry

ARGV[1]   expected layout version (decimal string; "" skips the check), or "absent": the
          meta hash must hold no layout version (a sealed store, or one whose meta hash
          was evicted or damaged; the client found the leftover keys with SCAN)
ARGV[2]   the number of registry entries the client knows of (leaves and nested nodes),
          or "" to skip the check
ARGV[3]   optional: p, the number of (key, trash key) pairs that end KEYS: each key (a chunk
          of a chunked entry) is renamed to its trash key, which expires in 10 minutes,
          instead of deleted, so that the client can then free the chunks one per command
          (freeing a large string blocks the server; see tdstore/_chunks.py)

Returns: the number of keys deleted or moved to the trash (integer)

Errors:
  TDS_NOSTORE  the store does not exist
  TDS_STALE    the layout version differs from ARGV[1]
  TDS_BADARG   ARGV[3] is not a count of pairs that KEYS holds
]]
--@include lib/common.lua

-- a meta or registry key of another type is damage: never read as a hash, deleted with the rest
local function is_hash(key)
  local kind = rcall('TYPE', key)
  if type(kind) == 'table' then kind = kind.ok end
  return kind == 'hash'
end

if ARGV[1] == 'seal' then
  if not is_hash(KEYS[1]) then return 0 end
  local lv = rcall('HGET', KEYS[1], 'lv')
  if not lv then return 0 end
  rcall('HSET', KEYS[1], 'clearing', lv)
  rcall('HDEL', KEYS[1], 'lv')
  return 1
end

if ARGV[1] == 'doom' then
  local grace = tonumber(ARGV[2] or '')
  if grace == nil or grace < 1 or grace ~= math.floor(grace) or grace > 86400000 then
    return fail('TDS_BADARG', 'bad grace ' .. tostring(ARGV[2]))
  end
  if not is_hash(KEYS[1]) or rcall('HGET', KEYS[1], 'lv') or not rcall('HGET', KEYS[1], 'clearing') then
    return 0
  end
  local doomed = 0
  for i = 1, #KEYS do
    local left = rcall('PTTL', KEYS[i])
    if left == -1 or left > grace then
      rcall('PEXPIRE', KEYS[i], grace)
      doomed = doomed + 1
    end
  end
  return doomed
end

if ARGV[1] == 'absent' then
  if is_hash(KEYS[1]) and rcall('HGET', KEYS[1], 'lv') then
    return fail('TDS_STALE', 'a store was created at ' .. KEYS[1] .. ' meanwhile')
  end
else
  local err = check_layout(KEYS[1], ARGV[1])
  if err then return err end
end
-- the client listed the data keys at this layout version, so the list is complete
local n = 0
if is_hash(KEYS[2]) then n = rcall('HLEN', KEYS[2]) end
if ARGV[2] ~= '' and n ~= tonumber(ARGV[2]) then
  return fail('TDS_STALE', 'registry has ' .. n .. ' entries, client knows of ' .. ARGV[2])
end
local pairs_n = tonumber(ARGV[3] or '0')
if pairs_n == nil or pairs_n < 0 or pairs_n ~= math.floor(pairs_n) or 2 * pairs_n > #KEYS - 2 then
  return fail('TDS_BADARG', 'bad number of trash pairs ' .. tostring(ARGV[3]))
end
local last = #KEYS - 2 * pairs_n
-- DEL in batches: unpack() of a very long table overflows the Lua C stack
local deleted = 0
local batch = {}
for i = 1, last do
  batch[#batch + 1] = KEYS[i]
  if #batch == 1000 or i == last then
    deleted = deleted + rcall('DEL', unpack(batch))
    batch = {}
  end
end
for i = last + 1, #KEYS, 2 do
  if rcall('EXISTS', KEYS[i]) == 1 then
    rcall('RENAME', KEYS[i], KEYS[i + 1])
    rcall('PEXPIRE', KEYS[i + 1], 600000)
    deleted = deleted + 1
  end
end
return deleted
