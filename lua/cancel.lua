-- cancel: the API gives up on a job (its client left, its queue deadline passed, or the
-- reaper found its replica dead or its deadline long gone).
--
-- KEYS[1..4] jobs, bodies, leases, deadlines (see lib/jobs.lua)
-- KEYS[5]    the job's group queue zset
-- KEYS[6]    the job's replica job set
-- KEYS[7]    the tenants hash (flow control's counters, lib/jobs.lua)
-- ARGV[1]    job id
-- ARGV[2]    reason: 'timeout' (queue deadline; a dispatched job keeps running)
--                    | 'client' (the caller left: a running job is aborted too)
-- ARGV[3]    cancel channel prefix (the node id is appended; workers subscribe to it)
-- Returns {outcome, ms}; outcome is
--   'removed'    the job was waiting; it is gone        'expired'  it expired in the queue; gone
--   'wait'       timeout asked before the deadline; ms = how long still to wait
--   'running'    it holds a slot (timeout only): keep waiting for its worker
--   'cancelling' its worker was told to abort and will release the slot
--   'gone'       no such job (it already ended)
--!include lib/jobs.lua

local QUEUE, REPLICA_JOBS = KEYS[5], KEYS[6]
TENANTS = KEYS[7]
local job, reason = ARGV[1], ARGV[2]

local rec = get_record(job)
if rec == nil then
  return {'gone', 0}
end
local now = now_ms()

if rec.st == 'q' then
  if reason == 'timeout' and rec.d > now then
    return {'wait', rec.d - now}
  end
  redis.call('ZREM', QUEUE, job)
  -- Moved by a reaper round since its submit (lua/rehome.lua): that queue holds it now (the
  -- key is in the {iop} slot like every key).
  if rec.qk and rec.qk ~= QUEUE then redis.call('ZREM', rec.qk, job) end
  count(rec, 'q', -1)
  drop_job(job, REPLICA_JOBS)
  return {'removed', 0}
end
if rec.st == 'x' then
  drop_job(job, REPLICA_JOBS)
  return {'expired', 0}
end
if reason == 'timeout' then
  return {'running', 0}
end
if rec.st ~= 'c' then
  rec.st = 'c'
  put_record(job, rec)
end
redis.call('PUBLISH', ARGV[3] .. rec.n, job)
return {'cancelling', 0}
