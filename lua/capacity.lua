-- capacity: a worker publishes what it knows of one provider's load (workers/capacity_control.py),
-- then pumps the provider's lanes: a limit that rose, or load elsewhere that fell, takes
-- waiting jobs at once. in_flight is never written here: only dispatch and release move it.
--
-- KEYS[1..5] jobs, bodies, leases, deadlines, fence (see lib/jobs.lua, lib/pump.lua)
-- KEYS[6]    provider hash   KEYS[7] its limit's history (list of '<ms>:<limit>', last 240)
-- KEYS[..]   plan keys of the provider's lanes
-- ARGV[1..3] plan id, plan key offset, lease ms (see lib/pump.lua)
-- ARGV[4]    the report, JSON (dispatcher/wire.py CapacityReport): capacity (the limit in
--            force), mode ('auto' | 'fixed'), external (what its engine runs and queues
--            beyond iop's in_flight: counted against it in routing), hold_ms (nothing new
--            goes there for this long: a rate limit) and hold_reason, reason (why the limit
--            last moved), engine (its last reading, JSON, kept as is), service_ms (the
--            median time of its recent calls), moved (append the limit to its history)
-- Writes capacity (as an operator's override lets it: lib/capacity_in_force.lua),
-- capacity_mode, ext, hold_until (server ms; 0 none), hold_reason, cap_reason, engine,
-- engine_ms (now), svc_ms.
-- Returns the number of jobs dispatched.
--!include lib/jobs.lua
--!include lib/parking.lua
--!include lib/pump.lua
--!include lib/capacity_in_force.lua

local PROVIDER, HISTORY = KEYS[6], KEYS[7]
local report = cjson.decode(ARGV[4])
local now = now_ms()
local cap = capacity_in_force(PROVIDER, report.capacity)
redis.call('HSET', PROVIDER, 'capacity_mode', report.mode,
           'ext', report.external or 0,
           'hold_until', (report.hold_ms or 0) > 0 and now + report.hold_ms or 0,
           'hold_reason', report.hold_reason or '', 'cap_reason', report.reason or '',
           'engine', report.engine or '', 'engine_ms', now, 'svc_ms', report.service_ms or 0)
if report.moved then
  redis.call('RPUSH', HISTORY, now .. ':' .. cap)
  redis.call('LTRIM', HISTORY, -240, -1)
  redis.call('PEXPIRE', HISTORY, 86400000)
end
return pump(now)
