-- Dispatch job `job` (record `rec`) of `lane` to candidate `cand`, as lib/route.lua chose:
-- out of its queue, a fence, a lease, its provider's in_flight (in Redis and in the pump()
-- call's view, `ctx`: lib/pump.lua), the clocks and counters of flow control
-- (lib/dispatched.lua), the queue's drain rate if it waited (lib/drain_rate.lua), an entry
-- on its node's stream (`queued` when it goes past capacity, a hit to its home's queue,
-- also counted for the catalog), and its record. On a provider whose models iop manages,
-- the model's running count and last use (lib/model_state.lua), and `rec.managed`, so
-- that its release gives the count back (lib/jobs.lua release_slot).
--!include lib/jobs.lua
--!include lib/dispatch_plan.lua
--!include lib/queue_of.lua
--!include lib/drain_rate.lua
--!include lib/dispatched.lua
--!include lib/provider_state.lua
--!include lib/arrived.lua
--!include lib/model_state.lua

local function assign(ctx, job, rec, lane, cand)
  local qkey, now = queue_of(lane), ctx.now
  local pkey, nkey = KEYS[BASE + cand.provider_key], KEYS[BASE + cand.node_key]
  -- A submit's arriving job is in no queue yet, and its body is in hand.
  local a = arrived(ctx, job)
  if a == nil then
    redis.call('ZREM', qkey, job)
    redis.call('ZREM', DEADLINES, job)
  end
  -- Never below ten per millisecond of server time: a failover that loses the last
  -- writes rolls the counter back, and a fence handed out again would let a run the new
  -- primary forgot pass for the one it dispatches now. (14 digits: exact in cjson.)
  local fence = redis.call('INCR', FENCE)
  if fence < now * 10 then
    fence = now * 10
    redis.call('SET', FENCE, fence)
  end
  if rec.submitted_ms < now then note_drain(qkey, now) end
  dispatched(ctx, rec, lane)
  local s = provider_state(ctx, pkey)
  -- Past its capacity: a hit sent to wait in its home's queue (lib/home_room.lua).
  local queued = s.inf >= s.cap and 1 or 0
  if queued == 1 and PLAN.affinity_stats ~= 0 then
    redis.call('HINCRBY', KEYS[BASE + PLAN.affinity_stats], lane.model .. '\thome_queued', 1)
  end
  redis.call('HINCRBY', pkey, 'in_flight', 1)
  s.inf = s.inf + 1
  if cand.managed then
    -- What keeps a model from being unloaded for another (lib/model_room.lua).
    redis.call('HINCRBY', pkey, 'mr:' .. cand.served, 1)
    redis.call('HSET', pkey, 'mu:' .. cand.served, now)
    local m = model_state(ctx, pkey, cand.served)
    m.running, m.used = m.running + 1, now
  end
  rec.managed = cand.managed and 1 or nil
  redis.call('ZADD', LEASES, now + LEASE_MS, job)
  local body = a and a.body or redis.call('HGET', BODIES, job) or ''
  -- The node stream entry (dispatcher/events.py Assignment, by the same names).
  local entry = redis.call('XADD', nkey, '*',
    'job', job, 'fence', fence, 'provider', cand.provider, 'target', cand.served, 'model', lane.model,
    'lane', lane.name, 'replica', rec.replica, 'endpoint', rec.endpoint, 'stream', rec.stream,
    'attempt', rec.attempt, 'submitted_ms', rec.submitted_ms, 'dispatched_ms', now,
    'pinned', rec.pin and 1 or 0, 'queued', queued, 'body', body)
  rec.state, rec.provider, rec.node, rec.target, rec.fence = 'd', cand.provider, cand.node, cand.served, fence
  rec.entry_id, rec.dispatched_ms, rec.output_started = entry, now, 0
  put_record(job, rec)
end
