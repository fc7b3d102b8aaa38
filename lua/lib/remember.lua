-- Provider `pid` now holds the job's blocks: added last to each block's holders if it was
-- not one (at most HOLDERS kept: a new one takes the last place), each block's last use
-- now, the providers' footprints moved by as much; then the index kept within its bounds
-- (at most lane.index_max blocks, none unused for lane.index_ttl_ms), oldest first. `held`:
-- the index's entries of the job's blocks, as lib/affine.lua read them.
--!include lib/dispatch_plan.lua

-- Providers a block of the index remembers (its home first, then second homes in the
-- order they were made): a hot head that spilled keeps its second and third homes.
local HOLDERS = 4

local function remember(lane, rec, pid, held, now)
  local index, recency, footprint = KEYS[BASE + lane.index], KEYS[BASE + lane.recency], KEYS[BASE + lane.footprint]
  local entries, uses, delta = {}, {}, {}
  for i, block in ipairs(rec.blocks) do
    local list, n, found = nil, 0, false
    for other in string.gmatch(held[i] or '', '[^,]+') do
      if other == pid then found = true end
      if n < HOLDERS - 1 or (n < HOLDERS and found) then
        list, n = list and (list .. ',' .. other) or other, n + 1
      else
        delta[other] = (delta[other] or 0) - 1
      end
    end
    if not found then
      list = list and (list .. ',' .. pid) or pid
      delta[pid] = (delta[pid] or 0) + 1
    end
    entries[#entries + 1], entries[#entries + 2] = block, list
    uses[#uses + 1], uses[#uses + 2] = now, block
  end
  redis.call('HSET', index, unpack(entries))
  redis.call('ZADD', recency, unpack(uses))
  local gone = redis.call('ZRANGEBYSCORE', recency, '-inf', now - lane.index_ttl_ms, 'LIMIT', 0, 256)
  local excess = redis.call('ZCARD', recency) - #gone - lane.index_max
  if excess > 0 then
    for _, block in ipairs(redis.call('ZRANGE', recency, #gone, #gone + math.min(excess, 256) - 1)) do
      gone[#gone + 1] = block
    end
  end
  if #gone > 0 then
    for _, list in ipairs(redis.call('HMGET', index, unpack(gone))) do
      for other in string.gmatch(list or '', '[^,]+') do delta[other] = (delta[other] or 0) - 1 end
    end
    redis.call('HDEL', index, unpack(gone))
    redis.call('ZREM', recency, unpack(gone))
  end
  for other, d in pairs(delta) do
    if d ~= 0 then redis.call('HINCRBY', footprint, other, d) end
  end
end
