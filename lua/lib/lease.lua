--[[ lib/lease
Read leases (see lease.lua): the hash <prefix>:{<td_id>}:rl maps each reader's nonce to the
end of its lease, in ms on the server's clock. Needs lib/common.lua before it.
]]
-- ms since the epoch on the server's clock
local function now_ms()
  local t = rcall('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- the ms left on the longest live lease of the hash key, or false when none is live
-- (an empty or missing hash costs no TIME call); nil and a message when the key is not a
-- hash (damage: the caller refuses before any write)
local function lease_left(key)
  local leases = redis.pcall('HGETALL', key)
  if type(leases) == 'table' and leases.err then return nil, 'the read leases ' .. key .. ' are not a hash' end
  if #leases == 0 then return false end
  local now, left = now_ms(), false
  for i = 2, #leases, 2 do
    local ends = tonumber(leases[i])
    -- lease.lua grants at most 999999999 ms: a lease ending later was not made by it
    if ends and ends - now > 999999999 then
      return nil, 'the read lease ' .. leases[i - 1] .. ' of ' .. key .. ' ends in ' .. leases[i] .. ', past any lease'
    end
    if ends and ends > now and (not left or ends - now > left) then left = ends - now end
  end
  return left
end
