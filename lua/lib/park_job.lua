-- Park job `job` of lane queue `qkey`, its fair tag `tag` kept as its score (flow control:
-- its tenant is at its max_in_flight; lib/parking.lua says how parking works).
--!include lib/dispatch_plan.lua
--!include lib/parking.lua
--!include lib/num.lua

local function park_job(qkey, job, tag)
  park(FAIR.park, qkey, job, num(tag))
end
