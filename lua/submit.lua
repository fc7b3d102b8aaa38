-- submit: put a job in its lane's queue (dispatcher/plans.py), then pump that lane.
-- A free slot means the job is dispatched in this same call (when the queue was empty,
-- without entering it). The plan is the lane's own
-- (one lane: PLAN.only, lib/dispatch_plan.lua).
--
-- KEYS[1..5] jobs, bodies, leases, deadlines, fence (see lib/jobs.lua, lib/dispatch_plan.lua)
-- KEYS[6]    seq counter: global submit order, so heads of different lanes compare exactly
-- KEYS[7]    the lane's queue zset (job id -> seq)
-- KEYS[8]    the replica's job set (so the reaper can cancel a dead replica's jobs)
-- KEYS[9]    the tenants' rate limits and budgets (lib/limits.lua)
-- KEYS[..]   plan keys of the lane (from ARGV[2] on)
-- ARGV[1..3] plan id, plan key offset, lease ms (see lib/dispatch_plan.lua)
-- ARGV[4]    options, JSON (dispatcher/wire.py SubmitOptions):
--              job, model, replica, endpoint, stream (0/1), lane ('' for the lane of all the
--              model's providers), timeout_ms (queue), max_queue,
--              pinned: the job must go to the lane's one provider (its state is there), so
--                it is refused at once when that provider cannot take work,
--              with flow control (a plan with tenants, see lib/pump.lua): tenant, weight,
--                max_queued (0: none); the job id is '<tenant>~<id>'
--              limits (a tenant with rate limits or a budget): wire.Limits, lib/limits.lua
--              predict_ms: refuse a job that would wait, when its place in the queue and
--                the lane's drain interval (lib/drain_rate.lua drain_interval; before it
--                is measured, lib/service_interval.lua's, from the providers' service
--                times and limits) say it would
--                wait longer than this 1 time in 20 (the caller's deadline, or the
--                model's refuse_predicted_over_ms)
--              excluded, first: a continuation of a cut stream (api/continuation.py) never
--                goes to these providers (lib/excluded.lua), and waits ahead of the lane's
--                new work: at score 0 (first), or under flow control one below the lowest of
--                its band's virtual time and its lane's head (the tenant's next tag not moved)
-- ARGV[5]    request body
-- Returns {status, queue length, deadline ms, now ms, why, limits}; status is
--   'dispatched' | 'queued' | 'full' (refused: max_queue jobs already wait) | 'duplicate'
--   | 'unavailable' (pinned, and the provider is down) | 'tenant_full' (its tenant has
--   max_queued jobs waiting) | 'no_provider' (none of the lane's providers can take work,
--   and the lane holds nothing: its hold_ms, the model's hold_when_unavailable_ms, is 0)
--   | 'rate_limited' | 'budget_exhausted' (its tenant's limits) | 'deadline_unmeetable' (its
--   predicted wait is over predict_ms); why: each provider's reason, for unavailable and
--   no_provider; for deadline_unmeetable, the predicted wait minus predict_ms, ms ('' otherwise);
--   limits: the tenant's windows after this submit, JSON (lib/limits.lua admit_limits; ''
--   without limits)
--!include lib/jobs.lua
--!include lib/dispatch_plan.lua
--!include lib/num.lua
--!include lib/unavailable_lane.lua
--!include lib/drain_rate.lua
--!include lib/service_interval.lua
--!include lib/pump.lua
--!include lib/limits.lua

local SEQ, QUEUE, REPLICA_JOBS, LIMITS = KEYS[6], KEYS[7], KEYS[8], KEYS[9]
-- The rates hash's field of a queue's refusals for want of room or time (keys.shed_field).
local SHED_SUFFIX = '|shed'
local LANE = PLAN.only
local opts = cjson.decode(ARGV[4])
local job, body, model, replica = opts.job, ARGV[5], opts.model, opts.replica
local timeout_ms, max_queue = opts.timeout_ms, opts.max_queue

if redis.call('HEXISTS', JOBS, job) == 1 then
  return {'duplicate', 0, 0, 0}
end

local now = now_ms()
if opts.pinned then
  local why = unavailable_lane(LANE, now)
  if why ~= nil then
    return {'unavailable', 0, 0, now, why, ''}
  end
end
local tenant, score, ftag, old_f
if FAIR ~= nil then
  tenant = opts.tenant
  local max_queued = opts.max_queued or 0
  if max_queued > 0 and (tonumber(redis.call('HGET', TENANTS, 'q:' .. tenant) or '0') or 0) >= max_queued then
    return {'tenant_full', 0, 0, now, '', ''}
  end
  -- Start-time fair queuing (lib/pump.lua): the tag, and where the tenant's next one starts,
  -- on its band's clock. A tenant with nothing waiting (anywhere: F is the tenant's across
  -- lanes, and so is this count) starts again from V: requests of its that left unserved
  -- (cancelled, timed out) are not charged to it. (Its last served tag is at most V, so
  -- its order is kept.)
  local weight = opts.weight or 1
  ftag = tenant
  old_f = redis.call('HGET', FAIR.f, ftag)
  local v = tonumber(redis.call('HGET', FAIR.v, 'band:' .. LANE.band) or '0') or 0
  local f = tonumber(old_f or '0') or 0
  if (tonumber(redis.call('HGET', TENANTS, 'q:' .. tenant) or '0') or 0) == 0 then
    f = math.min(f, v + 1 / weight)
  end
  score = math.max(v, f)
end
local limited, undo_limits = '', nil
if opts.limits then
  local refused
  refused, limited, undo_limits = admit_limits(LIMITS, opts.limits, now)
  if refused then return {refused, 0, 0, now, '', limited} end
end
if opts.first then
  if FAIR ~= nil then
    -- Before every tag waiting in its lane (an older one may be below the band's clock V,
    -- which moves on with each dispatch), and V itself: dispatch never moves V back.
    score = tonumber(redis.call('HGET', FAIR.v, 'band:' .. LANE.band) or '0') or 0
    local head = redis.call('ZRANGE', QUEUE, 0, 0, 'WITHSCORES')
    if head[2] ~= nil then score = math.min(score, tonumber(head[2])) end
    score = score - 1
  end
elseif ftag ~= nil then
  redis.call('HSET', FAIR.f, ftag, num(score + 1 / (opts.weight or 1)))
end
local seq = redis.call('INCR', SEQ)
local deadline = now + timeout_ms
local rec = {
  model = model, replica = replica, state = 'q', seq = seq, deadline_ms = deadline, timeout_ms = timeout_ms,
  submitted_ms = now, attempt = 1, endpoint = opts.endpoint, stream = opts.stream,
  lane = opts.lane ~= '' and opts.lane or nil, tenant = tenant, tag = score,
  pin = opts.pinned and LANE.candidates[1].provider or nil,
  blocks = opts.blocks and #opts.blocks > 0 and opts.blocks or nil,
  -- The wait it is admitted for: a home's queue takes it only if it starts there within it
  -- (lib/home_room.lua).
  predict_ms = (opts.predict_ms or 0) > 0 and opts.predict_ms or nil,
  never = opts.excluded and #opts.excluded > 0 and opts.excluded or nil,
}
local L = opts.limits
if L and (L.tokens_per_minute > 0 or L.tokens_per_day > 0) then
  -- What finish settles against the usage reported (lib/limits.lua settle_limits).
  rec.limits = {tenant = L.tenant, tokens_per_minute = L.tokens_per_minute, tokens_per_day = L.tokens_per_day,
                tokens = L.tokens, day = L.day}
end
count(rec, 'q', 1)
redis.call('HSET', BODIES, job, body)
redis.call('SADD', REPLICA_JOBS, job)
-- A lane that holds nothing has this job as its head: the pump is offered it as it is
-- (lib/pump.lua `arriving`), and it enters the queue only if it must wait -- ten commands
-- fewer than a pass through the queue. Not with a capped tenant, whose head the pump may
-- park instead (lib/head.lua).
local arriving = nil
if deadline > now and not (FAIR ~= nil and PLAN.capped) and redis.call('EXISTS', QUEUE) == 0 then
  arriving = {job = job, score = score or (opts.first and 0) or seq, rec = rec, body = body, lane = LANE}
  pump(now, arriving)
  if rec.state == 'd' then return {'dispatched', 0, deadline, now, '', limited} end
end
put_record(job, rec)
redis.call('ZADD', QUEUE, score and num(score) or (opts.first and 0) or seq, job)
redis.call('ZADD', DEADLINES, deadline, job)
if arriving == nil then pump(now) end

local waiting = redis.call('ZCARD', QUEUE)
local in_queue = redis.call('ZSCORE', QUEUE, job)
if not in_queue and FAIR ~= nil and PLAN.capped and (get_record(job) or {}).state == 'q' then
  -- Parked by that pump (its tenant at its max_in_flight: lib/park_job.lua): it waits
  -- too, with its deadline.
  return {'queued', waiting, deadline, now, '', limited}
end
if in_queue then
  -- Not taken: it may wait only if it fits, and only for a provider that can take work.
  local status, why = nil, nil
  if waiting > max_queue then
    status = 'full'
  else
    why = unavailable_lane(LANE, now)
    if why ~= nil and LANE.hold_ms == 0 then status = 'no_provider' end
  end
  if status == nil and why == nil and opts.predict_ms then
    -- Its wait is the next k = rank + 1 dispatch intervals: about k x interval, spread like
    -- a sum of k independent intervals as spread as their mean (sd sqrt(k) x interval). It
    -- is refused when even the 95th percentile of that, k + 1.65 sqrt(k) intervals, is over
    -- its deadline: what it admits starts in time 19 times out of 20.
    local interval = drain_interval(QUEUE) or service_interval(LANE, now)
    local k = interval and redis.call('ZRANK', QUEUE, job) + 1
    local predicted = interval and (k + 1.65 * math.sqrt(k)) * interval
    if predicted and predicted > opts.predict_ms then
      status, why = 'deadline_unmeetable', tostring(math.ceil(predicted - opts.predict_ms))
    end
  end
  if status ~= nil then
    redis.call('ZREM', QUEUE, job)
    count(rec, 'q', -1)
    if status ~= 'no_provider' then
      -- Demand the lane had no room or time for: a learned limit reads it as a backlog
      -- (workers/capacity_control.py), since shedding keeps the queue itself short.
      redis.call('HINCRBY', KEYS[BASE + PLAN.rates], QUEUE .. SHED_SUFFIX, 1)
    end
    if ftag ~= nil then
      -- Refused: its tag is given back.
      if old_f then redis.call('HSET', FAIR.f, ftag, old_f) else redis.call('HDEL', FAIR.f, ftag) end
    end
    if undo_limits then undo_limits() end
    drop_job(job, REPLICA_JOBS)
    return {status, waiting - 1, deadline, now, why or '', limited}
  end
  if why ~= nil then
    -- Held through a restart (the lane's hold_when_unavailable_ms): refused once the hold
    -- is over and still no provider is up (lib/refuse_unavailable.lua).
    rec.hold_until_ms = now + LANE.hold_ms
    put_record(job, rec)
  end
  -- It waits: its lane goes in the index of lanes that hold jobs (lib/enqueue.lua;
  -- one dispatched at once needs no mark).
  redis.call('SADD', WAITING, QUEUE)
  return {'queued', waiting, deadline, now, '', limited}
end
return {'dispatched', waiting, deadline, now, '', limited}
