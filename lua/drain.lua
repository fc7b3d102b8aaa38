-- drain: an operator stops, or lets again, new dispatch to one provider across the fleet
-- (dispatcher/control.py). The mark is the provider hash's field 'drain', the server ms it
-- was set: the pump hands a marked provider nothing new (lib/takes_work.lua), while the
-- jobs it runs finish and release as usual. Heartbeats write only the fields they are
-- given, so the mark outlives them (and a mark set before the provider's first heartbeat
-- holds from its start).
--
-- KEYS[1..5] jobs, bodies, leases, deadlines, fence (see lib/jobs.lua, lib/dispatch_plan.lua)
-- KEYS[6]    provider hash   KEYS[7] audit stream   KEYS[8] audit counts (lib/audit.lua)
-- KEYS[..]   plan keys of the provider's lanes
-- ARGV[1..3] plan id, plan key offset, lease ms (see lib/dispatch_plan.lua)
-- ARGV[4]    'drain': set the mark (one already set keeps its time)
--            | 'resume': clear it, then pump the provider's lanes, so waiting jobs take its
--            free slots now rather than at its next heartbeat
-- ARGV[5]    refusal options, JSON (dispatcher/wire.py Refusal): a drain that leaves a lane
--            with no provider answers its waiting jobs at once (lib/refuse_unavailable.lua)
-- ARGV[6]    by (an admin key's name)   ARGV[7] via   ARGV[8] audit entries kept
-- ARGV[9]    the audit's target: a drain that set the mark, and a resume that cleared one,
--            are audited; a repeat is not
-- Returns {mark ('' when open), in_flight, jobs dispatched}
--!include lib/jobs.lua
--!include lib/refuse_plan.lua
--!include lib/pump.lua
--!include lib/audit.lua

local PROVIDER = KEYS[6]
local now = now_ms()
local dispatched = 0
if ARGV[4] == 'drain' then
  if (redis.call('HGET', PROVIDER, 'drain') or '') == '' then
    redis.call('HSET', PROVIDER, 'drain', now)
    audit(KEYS[7], KEYS[8], ARGV[8], now, ARGV[6], 'drain', ARGV[9], '"open"',
          '"drained"', ARGV[7])
  end
  refuse_plan(now, cjson.decode(ARGV[5]))
else
  if redis.call('HDEL', PROVIDER, 'drain') == 1 then
    audit(KEYS[7], KEYS[8], ARGV[8], now, ARGV[6], 'resume', ARGV[9], '"drained"',
          '"open"', ARGV[7])
  end
  dispatched = pump(now)
end
local v = redis.call('HMGET', PROVIDER, 'drain', 'in_flight')
return {v[1] or '', tonumber(v[2]) or 0, dispatched}
