-- heartbeat: a worker publishes one provider's description and probed health, then pumps
-- the provider's lanes (a provider that just became available takes waiting jobs), or,
-- when it is not available, answers the jobs waiting in lanes it leaves with no provider
-- at all (lib/refuse_unavailable.lua).
-- in_flight is never written here: only dispatch and release move it. The time since the
-- last heartbeat goes into the provider's uptime buckets (lib/uptime.lua), read with the
-- heartbeat fields and written with them.
--
-- KEYS[1..5] jobs, bodies, leases, deadlines, fence (see lib/jobs.lua, lib/dispatch_plan.lua)
-- KEYS[6]    provider hash   KEYS[..] plan keys of the provider's lanes
-- ARGV[1..3] plan id, plan key offset, lease ms (see lib/dispatch_plan.lua)
-- ARGV[4]    health: 'available' | 'unavailable'
-- ARGV[5]    heartbeat TTL ms: the provider is not chosen once it passes
-- ARGV[6]    refusal options, JSON (dispatcher/wire.py Refusal)
-- ARGV[7..]  field, value, ... (node, type, category, capacity, models, probe reason, ...);
--            the capacity as an operator's override lets it (lib/capacity_in_force.lua)
-- Returns the number of jobs dispatched (available) or refused (not)
--!include lib/jobs.lua
--!include lib/refuse_plan.lua
--!include lib/pump.lua
--!include lib/hash_fields.lua
--!include lib/uptime.lua
--!include lib/capacity_in_force.lua

local PROVIDER = KEYS[6]
local now = now_ms()
local names, up_names, numbers = uptime_fields(now)
local f = read_fields(PROVIDER, names)
note_uptime(f, now, up_names, numbers)
for i = 7, #ARGV, 2 do
  if ARGV[i] == 'capacity' then
    capacity_in_force(PROVIDER, ARGV[i + 1])
  else
    redis.call('HSET', PROVIDER, ARGV[i], ARGV[i + 1])
  end
end
set_field(f, 'health', ARGV[4])
set_field(f, 'hb_ms', now)
set_field(f, 'hb_exp', now + tonumber(ARGV[5]))
flush_fields(f)
redis.call('HSETNX', PROVIDER, 'in_flight', 0)
if ARGV[4] ~= 'available' then
  return refuse_plan(now, cjson.decode(ARGV[6]))
end
return pump(now)
