-- A dispatched job lost its worker (lease ran out, or the worker shut down mid-job); its
-- slot is already released. If none of its output reached the client and attempts are
-- left, it goes back to its original place in its queue, with a fresh deadline, and its
-- API is told at once (`requeued_event`) so it re-arms its queue timer: the caller then
-- pumps. Otherwise its client gets `event` (unless the client had left).
-- Returns 'requeued' | 'failed' | 'dropped'.
--!include lib/jobs.lua
--!include lib/enqueue.lua
--!include lib/num.lua

local function settle_lost(job, rec, queue_key, reply_key, rj_key, max_attempts, event, requeued_event,
                           reply_ttl_ms, now)
  if rec.state == 'c' then
    drop_job(job, rj_key)
    return 'dropped'
  end
  if rec.output_started ~= 1 and rec.attempt < max_attempts then
    rec.state, rec.attempt, rec.deadline_ms, rec.output_started = 'q', rec.attempt + 1, now + rec.timeout_ms, 0
    rec.provider, rec.node, rec.target, rec.entry_id, rec.fence = nil, nil, nil, nil, nil
    -- Where it waits now: its caller may have chosen another lane than the one it was
    -- submitted to (a reload took that key away), and cancel.lua removes it from this one.
    rec.queue = queue_key
    put_record(job, rec)
    -- Its score (the seq, or its fair-queuing tag) keeps it ahead of everything after it.
    enqueue(queue_key, num(rec.tag or rec.seq), job)
    count(rec, 'q', 1)
    redis.call('ZADD', DEADLINES, rec.deadline_ms, job)
    redis.call('XADD', reply_key, '*', 'job', job, 'event', requeued_event)
    redis.call('PEXPIRE', reply_key, reply_ttl_ms)
    return 'requeued'
  end
  redis.call('XADD', reply_key, '*', 'job', job, 'event', event)
  redis.call('PEXPIRE', reply_key, reply_ttl_ms)
  drop_job(job, rj_key)
  return 'failed'
end
