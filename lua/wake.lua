-- wake: pump lanes that a release brought a capped tenant's parked jobs back to
-- (lib/released.lua) when the script that released did not pump them: the provider
-- that freed does not serve them, so their own providers may be idle.
--
-- KEYS[1..5] jobs, bodies, leases, deadlines, fence (see lib/jobs.lua, lib/dispatch_plan.lua)
-- KEYS[..]   plan keys of the lanes
-- ARGV[1..3] plan id, plan key offset, lease ms (see lib/dispatch_plan.lua)
-- Returns the number of jobs dispatched
--!include lib/jobs.lua
--!include lib/pump.lua

return pump(now_ms())
