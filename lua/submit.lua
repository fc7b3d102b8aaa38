-- submit: put a job in its lane's queue (dispatcher/plans.py), then pump that lane.
-- A free slot means the job is dispatched in this same call.
--
-- KEYS[1..5] jobs, bodies, leases, deadlines, fence (see lib/jobs.lua, lib/pump.lua)
-- KEYS[6]    seq counter: global submit order, so heads of different groups compare exactly
-- KEYS[7]    the lane's queue zset (job id -> seq)
-- KEYS[8]    the replica's job set (so the reaper can cancel a dead replica's jobs)
-- KEYS[..]   plan keys of the group (from ARGV[2] on)
-- ARGV[1..3] plan, plan key offset, lease ms (see lib/pump.lua)
-- ARGV[4]    job id            ARGV[5]  request body     ARGV[6]  model id
-- ARGV[7]    replica id        ARGV[8]  endpoint         ARGV[9]  stream flag (0/1)
-- ARGV[10]   queue timeout ms  ARGV[11] max_queue
-- ARGV[12]   lane name ('' for the lane of all the model's providers)
-- ARGV[13]   '1': the job must go to the lane's one provider (its state is there), so it is
--            refused at once when that provider cannot take work
-- ARGV[14..16] with flow control (a plan with tenants, see lib/pump.lua): the tenant, its
--            weight, and its max_queued (0: none); the job id is '<tenant>~<id>'
-- Returns {status, queue length, deadline ms, now ms}; status is
--   'dispatched' | 'queued' | 'full' (refused: max_queue jobs already wait) | 'duplicate'
--   | 'unavailable' (pinned, and the provider is down) | 'tenant_full' (its tenant has
--   max_queued jobs waiting)
--!include lib/jobs.lua
--!include lib/pump.lua

local SEQ, QUEUE, REPLICA_JOBS = KEYS[6], KEYS[7], KEYS[8]
local job, body, model, replica = ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local timeout_ms, max_queue = tonumber(ARGV[10]), tonumber(ARGV[11])

if redis.call('HEXISTS', JOBS, job) == 1 then
  return {'duplicate', 0, 0, 0}
end

local now = now_ms()
if ARGV[13] == '1' then
  local c = GROUPS[1].c[1]
  if c == nil or not provider_ok(KEYS[tonumber(ARGV[2]) + c[3]], now) then
    return {'unavailable', 0, 0, now}
  end
end
local tenant, score, ftag, old_f
if FAIR ~= nil then
  tenant = ARGV[14]
  local max_queued = tonumber(ARGV[16])
  if max_queued > 0 and (tonumber(redis.call('HGET', TENANTS, 'q:' .. tenant) or '0') or 0) >= max_queued then
    return {'tenant_full', 0, 0, now}
  end
  -- Start-time fair queuing (lib/pump.lua): the tag, and where the tenant's next one starts.
  -- A tenant with nothing waiting starts again from V: requests of its that left unserved
  -- (cancelled, timed out) are not charged to it. (Its last served tag is at most V, so its
  -- order is kept.)
  local weight = tonumber(ARGV[15])
  ftag = QUEUE .. '\t' .. tenant
  old_f = redis.call('HGET', FAIR.f, ftag)
  local v = tonumber(redis.call('HGET', FAIR.v, QUEUE) or '0') or 0
  local f = tonumber(old_f or '0') or 0
  if (tonumber(redis.call('HGET', TENANTS, 'q:' .. tenant .. ':' .. model) or '0') or 0) == 0 then
    f = math.min(f, v + 1 / weight)
  end
  score = math.max(v, f)
  redis.call('HSET', FAIR.f, ftag, num(score + 1 / weight))
end
local seq = redis.call('INCR', SEQ)
local deadline = now + timeout_ms
local rec = {
  m = model, rep = replica, st = 'q', seq = seq, d = deadline, to = timeout_ms,
  t0 = now, a = 1, ep = ARGV[8], s = tonumber(ARGV[9]), ln = ARGV[12] ~= '' and ARGV[12] or nil,
  tn = tenant, sc = score,
}
put_record(job, rec)
count(rec, 'q', 1)
redis.call('HSET', BODIES, job, body)
redis.call('ZADD', QUEUE, score and num(score) or seq, job)
redis.call('ZADD', DEADLINES, deadline, job)
redis.call('SADD', REPLICA_JOBS, job)

pump(now)

local waiting = redis.call('ZCARD', QUEUE)
if redis.call('ZSCORE', QUEUE, job) then
  if waiting > max_queue then
    redis.call('ZREM', QUEUE, job)
    count(rec, 'q', -1)
    if ftag ~= nil then
      -- Refused: its tag is given back.
      if old_f then redis.call('HSET', FAIR.f, ftag, old_f) else redis.call('HDEL', FAIR.f, ftag) end
    end
    drop_job(job, REPLICA_JOBS)
    return {'full', waiting - 1, deadline, now}
  end
  return {'queued', waiting, deadline, now}
end
return {'dispatched', waiting, deadline, now}
