-- Answer at once, 503, the jobs waiting in `lane` when none of its providers can take
-- work (down, drained, unheard-of), rather than at their queue deadline: a caller learns
-- that the server is down in one round trip. A lane that holds jobs through a provider
-- restart (lane.hold_ms, the model's hold_when_unavailable_ms) refuses a job only that long
-- after it was first seen with no provider (rec.hold_until_ms). `refusal` (dispatcher/wire.py
-- Refusal): reply and replica_jobs key prefixes (the job's replica completes them: every
-- key shares the {iop} slot), ttl_ms of a reply stream, limit of jobs refused per call,
-- silent_down_until_ms (a silent worker's provider counts as down until then: a reaper
-- round's, lib/unavailable_reason.lua). Returns the number refused.
--!include lib/jobs.lua
--!include lib/queue_of.lua
--!include lib/emptied.lua
--!include lib/unavailable_lane.lua

local function refuse_unavailable(lane, now, refusal)
  local qkey = queue_of(lane)
  if redis.call('ZCARD', qkey) == 0 then
    emptied(qkey)
    return 0
  end
  local why = unavailable_lane(lane, now, now <= refusal.silent_down_until_ms)
  if why == nil then return 0 end
  local refused = 0
  for _, job in ipairs(redis.call('ZRANGE', qkey, 0, refusal.limit - 1)) do
    local rec = get_record(job)
    if rec == nil then
      redis.call('ZREM', qkey, job)
    elseif rec.hold_until_ms == nil and lane.hold_ms > 0 then
      -- Its hold starts when it is first seen with no provider.
      rec.hold_until_ms = now + lane.hold_ms
      put_record(job, rec)
    elseif (rec.hold_until_ms or 0) <= now then
      redis.call('ZREM', qkey, job)
      count(rec, 'q', -1)
      local event
      if rec.pin then
        event = cmsgpack.pack({'failed', 503, 'response_provider_unavailable',
          'The provider holding this response is unavailable (' .. why .. '); retry later'})
      else
        event = cmsgpack.pack({'failed', 503, 'no_provider_available',
          "No provider of '" .. rec.model .. "' is available (" .. why .. '); retry later'})
      end
      local reply = refusal.reply .. rec.replica
      redis.call('XADD', reply, '*', 'job', job, 'event', event)
      redis.call('PEXPIRE', reply, refusal.ttl_ms)
      drop_job(job, refusal.replica_jobs .. rec.replica)
      refused = refused + 1
    end
  end
  return refused
end
