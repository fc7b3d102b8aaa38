-- finish: a worker is done with a job (answered, failed or aborted). Writes the final
-- event, gives the slot back, acknowledges the node stream entry, then pumps every
-- lane the provider serves so the freed slot goes to the oldest waiting job.
-- Fenced: a worker whose dispatch was taken over (its lease expired) changes nothing
-- but its own delivery's acknowledgement.
-- The call's live figures are not written here: its worker tallies them and flushes the
-- tally about once a second (live.lua).
--
-- KEYS[1..5] jobs, bodies, leases, deadlines, fence (see lib/jobs.lua, lib/dispatch_plan.lua)
-- KEYS[6]    node stream     KEYS[7] reply stream     KEYS[8] replica job set
-- KEYS[9]    provider hash   KEYS[10] the job's lane queue
-- KEYS[11]   the tenants' rate limits and budgets (lib/limits.lua)
-- KEYS[..]   plan keys of the provider's lanes
-- ARGV[1..3] plan id, plan key offset, lease ms (see lib/dispatch_plan.lua)
-- ARGV[4]    job id     ARGV[5] fence     ARGV[6] node stream entry id
-- ARGV[7]    consumer group     ARGV[8] final event ('' = none: nobody is listening)
-- ARGV[9]    reply stream TTL ms
-- ARGV[10]   'done' | 'requeue': the worker gave the job up unfinished (shutdown); it is
--            dispatched again if none of its output reached the client and attempts are
--            left, else its client gets the final event
--            | 'retry': the provider failed the job before any output (unreachable, 5xx);
--            as 'requeue', but never to this provider again, and only if another healthy
--            provider of its lane could take it
-- ARGV[11]   max attempts (requeue only)     ARGV[12] requeued event for the client (requeue only)
-- ARGV[13]   completion tokens the job generated (0: none reported): added, when the job
--            is released here, to the provider's token window (tok_t0 start ms of the
--            current 10 s bucket, tok_cur its tokens, tok_prev the bucket before), which
--            dispatcher/wire.py TokenWindow turns into tokens per second
-- ARGV[14]   prompt tokens of the job, ARGV[15] of them, those its provider served from its
--            prefix cache (0: none reported): added, on a real release, to the provider's
--            totals prompt_tokens and cached_tokens (the catalog's cache hit rate); and
--            with ARGV[13], a limited tenant's tokens settled (rec.limits) when the job ends
-- ARGV[16]   verdict: what the call says of its provider, for its 5xx evidence
--            (lib/evidence.lua): 'ok' it answered (a status under 500), '<status>' a 5xx
--            answer, '' nothing (aborted, or it failed otherwise: its worker took it out)
-- Returns {outcome, dispatched, ejections, queue key...}; outcome 'released' | 'requeued'
-- | 'failed' | 'dropped' | 'stale'; ejections: the providers this finish ejected, in
-- words ('' none); the queue keys: where the release brought parked jobs back to
--!include lib/jobs.lua
--!include lib/released.lua
--!include lib/other_candidate.lua
--!include lib/settle_lost.lua
--!include lib/pump.lua
--!include lib/limits.lua
--!include lib/lane_at.lua
--!include lib/hash_fields.lua
--!include lib/evidence_window.lua
--!include lib/evidence.lua

-- What finish reads of its provider: its token window and totals, and its 5xx evidence.
local PROVIDER_COUNTERS = {'tok_t0', 'tok_cur', 'prompt_tokens', 'cached_tokens'}
for _, name in ipairs(EVIDENCE_FIELDS) do PROVIDER_COUNTERS[#PROVIDER_COUNTERS + 1] = name end

local NODE, REPLY, REPLICA_JOBS, PROVIDER, QUEUE, LIMITS = KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11]
local job, entry, event = ARGV[4], ARGV[6], ARGV[8]

-- The delivery is over whatever happened to the job: a pending entry would never leave.
redis.call('XACK', NODE, ARGV[7], entry)
redis.call('XDEL', NODE, entry)

local rec = get_record(job)
if not owned(rec, ARGV[5]) then
  return {'stale', 0, ''}
end
local woken = {}
local pid = rec.provider
local released_here = release_slot(job, PROVIDER, rec)
if released_here then woken = released(rec) end
local now = now_ms()
local tokens = tonumber(ARGV[13]) or 0
local prompt, cached = tonumber(ARGV[14]) or 0, tonumber(ARGV[15]) or 0
local verdict, rules = ARGV[16] or '', PLAN.ejection
if rules == nil then verdict = '' end
-- The provider's counters, read once and written once (lib/hash_fields.lua).
local counters = nil
if tokens > 0 or (released_here and prompt > 0) or verdict ~= '' then
  counters = read_fields(PROVIDER, PROVIDER_COUNTERS)
end
if tokens > 0 then
  local t0, cur = tonumber(counters.v.tok_t0), tonumber(counters.v.tok_cur) or 0
  if t0 == nil or now < t0 or now - t0 >= 20000 then
    -- Nothing in the last two buckets (or a new primary's clock is behind): start afresh.
    set_field(counters, 'tok_t0', now)
    set_field(counters, 'tok_cur', tokens)
    set_field(counters, 'tok_prev', 0)
  elseif now - t0 >= 10000 then
    set_field(counters, 'tok_t0', t0 + 10000)
    set_field(counters, 'tok_cur', tokens)
    set_field(counters, 'tok_prev', cur)
  else
    set_field(counters, 'tok_cur', cur + tokens)
  end
end
if released_here and prompt > 0 then
  set_field(counters, 'prompt_tokens', (tonumber(counters.v.prompt_tokens) or 0) + prompt)
  if cached > 0 then set_field(counters, 'cached_tokens', (tonumber(counters.v.cached_tokens) or 0) + cached) end
end
if tonumber(verdict) ~= nil then
  -- A 5xx: noted on the job, whose end decides whom it blames (lib/evidence.lua).
  local failed = rec.failed_5xx or {}
  failed[#failed + 1] = pid .. '|' .. verdict
  rec.failed_5xx = failed
end
local outcome = 'released'
if ARGV[10] == 'requeue' or ARGV[10] == 'retry' then
  local max_attempts = tonumber(ARGV[11])
  if ARGV[10] == 'retry' then
    local x = rec.excluded or {}
    x[#x + 1] = rec.provider
    rec.excluded = x
    if not other_candidate(QUEUE, rec, now) then max_attempts = 0 end
  end
  outcome = settle_lost(job, rec, QUEUE, REPLY, REPLICA_JOBS, max_attempts, event, ARGV[12],
                        tonumber(ARGV[9]), now)
  if outcome ~= 'requeued' and rec.limits then settle_limits(LIMITS, rec.limits, prompt + tokens) end
else
  if rec.limits then settle_limits(LIMITS, rec.limits, prompt + tokens) end
  if event ~= '' and rec.state ~= 'c' then
    redis.call('XADD', REPLY, '*', 'job', job, 'event', event)
    redis.call('PEXPIRE', REPLY, tonumber(ARGV[9]))
  end
  drop_job(job, REPLICA_JOBS)
end
local ejections = ''
if counters ~= nil then
  if verdict ~= '' then
    ejections = settle_evidence(counters, pid, verdict, rec, outcome, lane_at(QUEUE), now, rules)
  end
  flush_fields(counters)
end
return {outcome, pump(now), ejections, unpack(woken)}
