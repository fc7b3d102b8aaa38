-- The queue key of a plan's lane.
--!include lib/dispatch_plan.lua

local function queue_of(lane)
  return KEYS[BASE + lane.queue]
end
