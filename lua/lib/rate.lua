--[[ lib/rate
The rate limiter of a ring (tdstore/replay/rate_limit.py), shared by reserve.lua and
rate_sample.lua: DeepMind Reverb's semantics. A sample of n rows is allowed once the ring
holds at least "min" rows, and while inserts * spi - samples - n stays at least "lo"; an
insert of n rows is allowed while the ring holds at most "min" rows after it, or while
(inserts + n) * spi - samples stays at most "hi".

The limiter's hash: "min" the minimum size to sample, "spi" samples per insert, "lo" and
"hi" the bounds of inserts * spi - samples, "to" the wait's timeout in ms ("" for none),
"ins" and "smp" the rows inserted and sampled since the limit was set (or the ring emptied),
"tok" the tokens of the last samples counted (rate_sample.lua: a try sent again counts once).
Requires lib/common.lua.
]]

-- The limiter in the hash at key (a table), nil when there is none, or nil and an error reply
-- (TDS_CORRUPT) when the hash is damaged: checked before any write.
local function rate_read(key)
  local v = redis.pcall('HMGET', key, 'min', 'spi', 'lo', 'hi', 'ins', 'smp', 'to')
  if type(v) == 'table' and v.err then
    return nil, fail('TDS_CORRUPT', 'the rate limiter ' .. key .. ' is not a hash')
  end
  if not v[1] then return nil, nil end
  local r = {min = tonumber(v[1]), spi = tonumber(v[2]), lo = tonumber(v[3]), hi = tonumber(v[4]),
             ins = tonumber(v[5] or '0'), smp = tonumber(v[6] or '0'), to = v[7] or ''}
  for _, name in ipairs({'min', 'spi', 'lo', 'hi', 'ins', 'smp'}) do
    local x = r[name]
    -- x ~= x: nan; the counts and the size are exact integers below 2^53
    if x == nil or x ~= x or ((name == 'min' or name == 'ins' or name == 'smp')
        and (x < 0 or x ~= math.floor(x) or x > 9007199254740992)) then
      return nil, fail('TDS_CORRUPT', 'the rate limiter ' .. key .. ' holds a bad "' .. name .. '"')
    end
  end
  if r.to ~= '' and not string.match(r.to, '^%d+$') then
    return nil, fail('TDS_CORRUPT', 'the rate limiter ' .. key .. ' holds a bad "to"')
  end
  return r, nil
end

-- Whether an insert of n rows that leaves the ring holding size_after rows is allowed.
local function rate_can_insert(r, size_after, n)
  if size_after <= r.min then return true end
  return (r.ins + n) * r.spi - r.smp <= r.hi
end

-- Whether a sample of n rows from a ring holding size rows is allowed.
local function rate_can_sample(r, size, n)
  if size < r.min then return false end
  return r.ins * r.spi - r.smp - n >= r.lo
end
