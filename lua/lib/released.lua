-- A job of record `rec` gave its slot back: if that takes its tenant under its
-- max_in_flight, its parked jobs come back (before the pump that follows: lib/parking.lua
-- unpark_tenant). Returns the queue keys they went back to: the caller has those of them
-- its plan lacks pumped (lua/wake.lua), since the provider that freed may not serve them.
--!include lib/jobs.lua
--!include lib/dispatch_plan.lua
--!include lib/parking.lua

local function released(rec)
  if FAIR == nil or not PLAN.capped or rec.tenant == nil then return {} end
  local lim = tonumber(redis.call('HGET', FAIR.lim, rec.tenant) or '')
  if lim == nil then return {} end
  local run = tonumber(redis.call('HGET', TENANTS, 'r:' .. rec.tenant) or '0') or 0
  if run < lim then return unpark_tenant(FAIR.park, rec.tenant, WAITING) end
  return {}
end
