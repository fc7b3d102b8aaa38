-- The plan's lane queued at `qkey` (nil if it has none), read once per script.
--!include lib/dispatch_plan.lua
--!include lib/queue_of.lua

local function lane_at(qkey)
  if PLAN.only then
    if queue_of(PLAN.only) == qkey then return PLAN.only end
    return nil
  end
  local lane = lane_cache[qkey]
  if lane == nil then
    local raw = redis.call('HGET', PLAN_KEY, qkey)
    lane = raw and cjson.decode(raw) or false
    lane_cache[qkey] = lane
  end
  return lane or nil
end
