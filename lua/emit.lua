-- emit: a worker's first output of a streamed job. Writing it marks the job as having
-- reached its client, after which a lost worker means an error, never a redispatch.
--
-- KEYS[1..4] jobs, bodies, leases, deadlines (see lib/jobs.lua)
-- KEYS[5]    the replica's reply stream
-- ARGV[1]    job id     ARGV[2] fence of the worker's dispatch     ARGV[3] lease ms
-- ARGV[4]    event (the encoded start event with the first chunks)
-- ARGV[5]    reply stream TTL ms
-- Returns 'ok' | 'cancelled' (abort, then finish) | 'stale' (not this worker's job any more)
--!include lib/jobs.lua

local REPLY = KEYS[5]
local job = ARGV[1]

local rec = get_record(job)
if not owned(rec, ARGV[2]) then
  return 'stale'
end
if rec.state == 'c' then
  return 'cancelled'
end
if rec.output_started == 1 then
  -- A retry of a call whose reply was lost: the event is already there.
  return 'ok'
end
rec.output_started = 1
put_record(job, rec)
redis.call('ZADD', LEASES, 'XX', now_ms() + tonumber(ARGV[3]), job)
redis.call('XADD', REPLY, '*', 'job', job, 'event', ARGV[4])
redis.call('PEXPIRE', REPLY, tonumber(ARGV[5]))
return 'ok'
