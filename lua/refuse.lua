-- refuse: answer at once, 503, the jobs waiting in lanes none of whose providers can take
-- work (lib/refuse_unavailable.lua). Heartbeats and drains do it for the lanes of the
-- provider they concern; a reaper round does it for every lane, which catches a provider
-- whose worker died (its heartbeat only expires) and holds that ran out.
--
-- KEYS[1..5] jobs, bodies, leases, deadlines, fence (see lib/jobs.lua, lib/dispatch_plan.lua)
-- KEYS[..]   plan keys of every lane
-- ARGV[1..3] plan id, plan key offset, lease ms (see lib/dispatch_plan.lua)
-- ARGV[4]    refusal options, JSON (dispatcher/wire.py Refusal)
-- Returns the number of jobs refused
--!include lib/jobs.lua
--!include lib/refuse_plan.lua

return refuse_plan(now_ms(), cjson.decode(ARGV[4]))
