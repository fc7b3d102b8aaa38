-- submit: put a job in its model group's queue, then pump that group.
-- A free slot means the job is dispatched in this same call.
--
-- KEYS[1..5] jobs, bodies, leases, deadlines, fence (see lib/jobs.lua, lib/pump.lua)
-- KEYS[6]    seq counter: global submit order, so heads of different groups compare exactly
-- KEYS[7]    the group's queue zset (job id -> seq)
-- KEYS[8]    the replica's job set (so the reaper can cancel a dead replica's jobs)
-- KEYS[..]   plan keys of the group (from ARGV[2] on)
-- ARGV[1..3] plan, plan key offset, lease ms (see lib/pump.lua)
-- ARGV[4]    job id            ARGV[5]  request body     ARGV[6]  model id
-- ARGV[7]    replica id        ARGV[8]  endpoint         ARGV[9]  stream flag (0/1)
-- ARGV[10]   queue timeout ms  ARGV[11] max_queue
-- Returns {status, queue length, deadline ms, now ms}; status is
--   'dispatched' | 'queued' | 'full' (refused: max_queue jobs already wait) | 'duplicate'
--!include lib/jobs.lua
--!include lib/pump.lua

local SEQ, QUEUE, REPLICA_JOBS = KEYS[6], KEYS[7], KEYS[8]
local job, body, model, replica = ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local timeout_ms, max_queue = tonumber(ARGV[10]), tonumber(ARGV[11])

if redis.call('HEXISTS', JOBS, job) == 1 then
  return {'duplicate', 0, 0, 0}
end

local now = now_ms()
local seq = redis.call('INCR', SEQ)
local deadline = now + timeout_ms
put_record(job, {
  m = model, rep = replica, st = 'q', seq = seq, d = deadline, to = timeout_ms,
  t0 = now, a = 1, ep = ARGV[8], s = tonumber(ARGV[9]),
})
redis.call('HSET', BODIES, job, body)
redis.call('ZADD', QUEUE, seq, job)
redis.call('ZADD', DEADLINES, deadline, job)
redis.call('SADD', REPLICA_JOBS, job)

pump(now)

local waiting = redis.call('ZCARD', QUEUE)
if redis.call('ZSCORE', QUEUE, job) then
  if waiting > max_queue then
    redis.call('ZREM', QUEUE, job)
    drop_job(job, REPLICA_JOBS)
    return {'full', waiting - 1, deadline, now}
  end
  return {'queued', waiting, deadline, now}
end
return {'dispatched', waiting, deadline, now}
