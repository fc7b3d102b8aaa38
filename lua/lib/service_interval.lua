-- How long a place in `lane`'s queue takes when its drain has not been measured yet
-- (lib/drain_rate.lua measures it only over a backlog of several dispatches): from what
-- its providers' workers publish (lua/capacity.lua), each provider frees a slot every
-- svc_ms / capacity on average (svc_ms: the median time of its recent calls; capacity:
-- the limit in force), so the lane every 1 / sum(capacity / svc_ms). Only providers that
-- can take work count; nil when one of them has no service time yet (nothing is predicted
-- from a guess), or none can take work. Ms.
--!include lib/dispatch_plan.lua
--!include lib/takes_work.lua

local function service_interval(lane, now)
  local rate = 0
  for _, cand in ipairs(lane.candidates) do
    local v = redis.call('HMGET', KEYS[BASE + cand.provider_key], 'health', 'hb_exp', 'capacity', 'drain', 'off', 'svc_ms')
    if takes_work(v, now) then
      local svc = tonumber(v[6]) or 0
      if svc <= 0 then return nil end
      rate = rate + (tonumber(v[3]) or 0) / svc
    end
  end
  if rate <= 0 then return nil end
  return 1 / rate
end
