-- The plan's lanes that may hold jobs. The index WAITING has every lane a job was put in
-- (lib/enqueue.lua) until a pump finds it empty (lib/emptied.lua), so lanes with nothing
-- waiting cost nothing: a finish with every queue empty makes one SINTER, however many
-- lanes its provider is in. A plan of one lane reads its queue instead (as cheap as the
-- index).
--!include lib/dispatch_plan.lua

local function lanes_with_jobs()
  if PLAN.only then return {PLAN.only} end
  local queues = redis.call('SINTER', PLAN_LANES, WAITING)
  local lanes = {}
  for i = 1, #queues, 500 do
    local specs = redis.call('HMGET', PLAN_KEY, unpack(queues, i, math.min(i + 499, #queues)))
    for j, raw in ipairs(specs) do
      if raw then
        local lane = cjson.decode(raw)
        lane_cache[queues[i + j - 1]] = lane
        lanes[#lanes + 1] = lane
      end
    end
  end
  return lanes
end
