-- reconcile: make each provider's in_flight equal the number of live leases it holds,
-- and drop leases that no job record backs. A safety net run at worker start-up and
-- now and then by the reaper: every script keeps the two in step, but an operator's
-- manual edit or a restore from an old snapshot may not.
--
-- KEYS[1..4] jobs, bodies, leases, deadlines (see lib/jobs.lua)
-- KEYS[5..]  provider hashes, in the order of ARGV
-- ARGV[1..]  provider ids
-- Returns a flat list provider id, old in_flight, new in_flight of every correction
--!include lib/jobs.lua

local held = {}
for _, job in ipairs(redis.call('ZRANGE', LEASES, 0, -1)) do
  local rec = get_record(job)
  if rec == nil or rec.p == nil then
    redis.call('ZREM', LEASES, job)
  else
    held[rec.p] = (held[rec.p] or 0) + 1
  end
end
local fixed = {}
for i, provider in ipairs(ARGV) do
  local key = KEYS[4 + i]
  if redis.call('EXISTS', key) == 1 then
    local old = tonumber(redis.call('HGET', key, 'in_flight') or '0') or 0
    local new = held[provider] or 0
    if old ~= new then
      redis.call('HSET', key, 'in_flight', new)
      fixed[#fixed + 1] = provider
      fixed[#fixed + 1] = old
      fixed[#fixed + 1] = new
    end
  end
end
return fixed
