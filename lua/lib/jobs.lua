-- Job records and slots: helpers shared by the scripts (included by scripts.py, never run alone).
-- A group, not a file per function: the four keys every script takes first, and the small
-- helpers over a job's record and slot that most scripts use together.
--
-- Every script that includes this file takes these first:
--   KEYS[1] jobs hash      job id -> JSON record (state, model, replica, provider, fence, ...)
--   KEYS[2] bodies hash    job id -> request body (kept until the job ends, for redispatch)
--   KEYS[3] leases zset    job id -> lease expiry ms: the proof that a slot is held
--   KEYS[4] deadlines zset job id -> queue deadline ms (jobs waiting or expired in a queue)
-- Record states: 'q' waiting in its lane queue, 'd' dispatched (holds a lease),
-- 'c' dispatched and cancel requested, 'x' expired in the queue. A finished job has no record.
-- Time comes from the server (TIME), never from a client clock.
--!include lib/now_ms.lua

local JOBS, BODIES, LEASES, DEADLINES = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
-- With flow control, the tenants hash: q:<tenant> and q:<tenant>:<model> count waiting
-- jobs, r:... running ones. A script that moves jobs of tenants names it once, at its top
-- (counts_in; lib/dispatch_plan.lua does from its plan); until then nothing is counted.
local TENANTS = nil
local function counts_in(key)
  TENANTS = key
end

-- Move a flow-controlled job's tenant counters: kind 'q' (waiting) or 'r' (running).
local function count(rec, kind, d)
  if TENANTS == nil or rec.tenant == nil then return end
  redis.call('HINCRBY', TENANTS, kind .. ':' .. rec.tenant, d)
  redis.call('HINCRBY', TENANTS, kind .. ':' .. rec.tenant .. ':' .. rec.model, d)
end

local function get_record(job)
  local raw = redis.call('HGET', JOBS, job)
  if not raw then return nil end
  return cjson.decode(raw)
end

local function put_record(job, rec)
  redis.call('HSET', JOBS, job, cjson.encode(rec))
end

-- Is this record still the dispatch the caller holds? (A requeued or redispatched job is not.)
local function owned(rec, fence)
  return rec ~= nil and rec.fence == tonumber(fence) and (rec.state == 'd' or rec.state == 'c')
end

-- Forget a job entirely (it reached a terminal state).
local function drop_job(job, rj_key)
  redis.call('HDEL', JOBS, job)
  redis.call('HDEL', BODIES, job)
  redis.call('ZREM', DEADLINES, job)
  if rj_key then redis.call('SREM', rj_key, job) end
end

-- Give a slot back. Only a live lease gives one back, so a second release is a no-op
-- and in_flight never goes below zero; nor does a managed model's running count
-- (lib/assign.lua, lib/model_state.lua).
local function release_slot(job, pkey, rec)
  if redis.call('ZREM', LEASES, job) == 1 then
    local inf = tonumber(redis.call('HGET', pkey, 'in_flight') or '0') or 0
    if inf > 0 then redis.call('HINCRBY', pkey, 'in_flight', -1) end
    if rec.managed and rec.target then
      local field = 'mr:' .. rec.target
      if (tonumber(redis.call('HGET', pkey, field) or '0') or 0) > 0 then redis.call('HINCRBY', pkey, field, -1) end
    end
    count(rec, 'r', -1)
    return true
  end
  return false
end
