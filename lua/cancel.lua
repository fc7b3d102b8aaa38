-- cancel: the API gives up on a job (its client left, its queue deadline passed, or the
-- reaper found its replica dead or its deadline long gone).
--
-- KEYS[1..4] jobs, bodies, leases, deadlines (see lib/jobs.lua)
-- KEYS[5]    the job's lane queue zset
-- KEYS[6]    the job's replica job set
-- KEYS[7]    the tenants hash (flow control's counters, lib/jobs.lua)
-- KEYS[8]    the tenant limits hash (tenant -> max_in_flight)
-- KEYS[9]    the index of lanes that hold jobs (lib/lanes_with_jobs.lua)
-- ARGV[1]    job id
-- ARGV[2]    reason: 'timeout' (queue deadline; a dispatched job keeps running)
--                    | 'client' (the caller left: a running job is aborted too)
-- ARGV[3]    cancel channel prefix (the node id is appended; workers subscribe to it)
-- ARGV[4]    the prefix of a tenant's parked-jobs keys (lib/parking.lua)
-- Returns {outcome, ms}; outcome is
--   'removed'    the job was waiting; it is gone        'expired'  it expired in the queue; gone
--   'wait'       timeout asked before the deadline; ms = how long still to wait
--   'running'    it holds a slot (timeout only): keep waiting for its worker
--   'cancelling' its worker was told to abort and will release the slot
--   'gone'       no such job (it already ended)
-- and, for 'removed' and 'expired', the queue key a parked job of the same tenant went back
-- to in its place, if one did: its caller pumps that lane (lua/wake.lua)
--!include lib/jobs.lua
--!include lib/parking.lua

local QUEUE, REPLICA_JOBS = KEYS[5], KEYS[6]
counts_in(KEYS[7])
local LIMITS, WAITING = KEYS[8], KEYS[9]

-- A job of a tenant under its max_in_flight left lane queue `qkey` without running: if the
-- tenant has jobs parked in that lane, the earliest comes back in its place (it may be the
-- one a release brought back; nothing else would bring the others back).
local function back_in_place(rec, qkey)
  if rec.tenant == nil then return nil end
  local lim = tonumber(redis.call('HGET', LIMITS, rec.tenant) or '')
  if lim == nil then return nil end
  if (tonumber(redis.call('HGET', TENANTS, 'r:' .. rec.tenant) or '0') or 0) >= lim then return nil end
  if unpark_lane(ARGV[4], rec.tenant, qkey, WAITING) then return qkey end
  return nil
end
local job, reason = ARGV[1], ARGV[2]

local rec = get_record(job)
if rec == nil then
  return {'gone', 0}
end
local now = now_ms()

if rec.state == 'q' then
  if reason == 'timeout' and rec.deadline_ms > now then
    return {'wait', rec.deadline_ms - now}
  end
  redis.call('ZREM', QUEUE, job)
  -- Moved by a reaper round since its submit (lua/rehome.lua): that queue holds it now (the
  -- key is in the {iop} slot like every key).
  if rec.queue and rec.queue ~= QUEUE then redis.call('ZREM', rec.queue, job) end
  count(rec, 'q', -1)
  drop_job(job, REPLICA_JOBS)
  return {'removed', 0, back_in_place(rec, rec.queue or QUEUE)}
end
if rec.state == 'x' then
  drop_job(job, REPLICA_JOBS)
  return {'expired', 0, back_in_place(rec, rec.queue or QUEUE)}
end
if reason == 'timeout' then
  return {'running', 0}
end
if rec.state ~= 'c' then
  rec.state = 'c'
  put_record(job, rec)
end
redis.call('PUBLISH', ARGV[3] .. rec.node, job)
return {'cancelling', 0}
