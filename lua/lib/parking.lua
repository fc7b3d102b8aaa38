-- Parking (flow control), shared by the pump (lib/park_job.lua, lib/released.lua) and
-- cancel.lua (never run alone). A group of three, not three files: one key layout, written
-- by park and read back by the two unparks.
--
-- A tenant at its max_in_flight cannot run the jobs it has waiting, so they leave their lane
-- for the tenant's parked set of that lane (key <prefix><tenant>|<lane key>, score their
-- tag; the tenant's index <prefix><tenant> lists the lanes it has parked jobs in; every key
-- in the {iop} slot). Jobs behind them run: no look-ahead limit leaves capacity idle. When
-- the tenant's running jobs drop below its limit (finish, reap_lease: unpark_tenant), the
-- earliest parked job of each of those lanes goes back with its tag, ahead of what came
-- since, so whichever lane has a free provider runs it; the others are parked again when
-- they reach a head while it is capped. One brought back that leaves without running
-- (cancelled, expired) hands its place to the next parked job of its lane (cancel.lua:
-- unpark_lane), so a tenant under its cap never has only parked jobs in a lane. A parked
-- job keeps its record, deadline and counters; one cancelled or expired meanwhile is
-- dropped when it comes back.
--!include lib/jobs.lua
--!include lib/tenant_of.lua

-- Park job `job` (score `tag`, as Redis stores it) of lane queue `qkey`.
local function park(prefix, qkey, job, tag)
  local t = tenant_of(job)
  redis.call('ZREM', qkey, job)
  redis.call('ZADD', prefix .. t .. '|' .. qkey, tag, job)
  redis.call('SADD', prefix .. t, qkey)
end

-- Bring back tenant `t`'s earliest parked job of lane queue `qkey` still waiting, marking
-- the lane in the index `waiting` of lanes that hold jobs; true if one came back.
local function unpark_lane(prefix, t, qkey, waiting)
  local index = prefix .. t
  local key = index .. '|' .. qkey
  while true do
    local h = redis.call('ZPOPMIN', key)
    if #h == 0 then
      redis.call('SREM', index, qkey)
      return false
    end
    local rec = get_record(h[1])
    if rec and rec.state == 'q' then
      redis.call('ZADD', qkey, h[2], h[1])
      redis.call('SADD', waiting, qkey)
      if redis.call('EXISTS', key) == 0 then redis.call('SREM', index, qkey) end
      return true
    end
  end
end

-- unpark_lane over every lane tenant `t` has parked jobs in; the queue keys jobs went back to.
local function unpark_tenant(prefix, t, waiting)
  local lanes = {}
  for _, qkey in ipairs(redis.call('SMEMBERS', prefix .. t)) do
    if unpark_lane(prefix, t, qkey, waiting) then lanes[#lanes + 1] = qkey end
  end
  return lanes
end
