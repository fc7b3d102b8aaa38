-- The lane's next job to run past the `skip` ones the pump found blocked, and its score
-- (nil: none this call). With flow control, a head whose tenant is at its max_in_flight
-- (lib/may_run.lua) is parked (lib/park_job.lua) and the jobs behind it surface, however
-- many of them are capped, up to the pump() call's budget of parkings (`ctx`,
-- lib/pump.lua); once that is spent the lane has no head this call.
--!include lib/dispatch_plan.lua
--!include lib/queue_of.lua
--!include lib/first_waiting.lua
--!include lib/may_run.lua
--!include lib/park_job.lua

local function head(ctx, lane, skip)
  if FAIR == nil then return first_waiting(lane, skip) end
  while true do
    local job, tag = first_waiting(lane, skip)
    if job == nil or may_run(ctx, job) then return job, tag end
    if ctx.park_budget == 0 then return nil end
    ctx.park_budget = ctx.park_budget - 1
    park_job(queue_of(lane), job, tag)
  end
end
