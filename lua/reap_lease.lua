-- reap_lease: a lease ran out (its worker died, hung, or never read the node stream).
-- The slot comes back. A job whose output never reached its client is dispatched again,
-- up to max_attempts; otherwise its client gets the given error event. A job whose
-- client had left is simply dropped.
-- A round that lost sight of Redis after it began (the marker reap_round set is old)
-- judges nothing: the next round's reap_round first gives every lease a fresh period.
--
-- KEYS[1..5] jobs, bodies, leases, deadlines, fence (see lib/jobs.lua, lib/dispatch_plan.lua)
-- KEYS[6]    node stream     KEYS[7] reply stream     KEYS[8] replica job set
-- KEYS[9]    provider hash   KEYS[10] the job's lane queue   KEYS[11] last-round marker
-- KEYS[..]   plan keys of the provider's lanes
-- ARGV[1..3] plan id, plan key offset, lease ms (see lib/dispatch_plan.lua)
-- ARGV[4]    job id     ARGV[5] consumer group     ARGV[6] max attempts
-- ARGV[7]    error event for the client     ARGV[8] reply stream TTL ms
-- ARGV[9]    gap ms (see reap_round.lua)     ARGV[10] requeued event for the client
-- Returns {outcome, dispatched, queue key...} (the queue keys: see finish.lua); outcome
-- 'requeued' | 'failed' | 'dropped' | 'skip' (lease is
-- live, or the round is stale)
--!include lib/jobs.lua
--!include lib/released.lua
--!include lib/settle_lost.lua
--!include lib/pump.lua

local NODE, REPLY, REPLICA_JOBS, PROVIDER, QUEUE = KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local job = ARGV[4]
local now = now_ms()

local seen = tonumber(redis.call('HGET', KEYS[11], 'ms') or '')
if seen == nil or now - seen > tonumber(ARGV[9]) then
  return {'skip', 0}
end

local expiry = tonumber(redis.call('ZSCORE', LEASES, job))
if expiry == nil or expiry > now then
  return {'skip', 0}
end
local rec = get_record(job)
if rec == nil then
  redis.call('ZREM', LEASES, job)
  return {'skip', 0}
end
local woken = {}
if release_slot(job, PROVIDER, rec) then woken = released(rec) end
if rec.entry_id then
  redis.call('XACK', NODE, ARGV[5], rec.entry_id)
  redis.call('XDEL', NODE, rec.entry_id)
end
local outcome = settle_lost(job, rec, QUEUE, REPLY, REPLICA_JOBS, tonumber(ARGV[6]), ARGV[7],
                            ARGV[10], tonumber(ARGV[8]), now)
return {outcome, pump(now), unpack(woken)}
