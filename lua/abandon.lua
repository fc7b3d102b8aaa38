-- abandon: answer at once, 503, jobs waiting in a lane queue that no plan of the current
-- config pumps, pinned to a provider a reload removed (its stored Response went with it, and
-- its worker marked it 'removed'): no lane may take them (dispatcher/plans.py home_of), and
-- they would otherwise wait out their queue deadline in a queue nothing pumps.
--
-- KEYS[1..4] jobs, bodies, leases, deadlines (see lib/jobs.lua)
-- KEYS[5]    the queue     KEYS[6] the tenants hash (flow control's counters, lib/jobs.lua)
-- KEYS[7]    the reply stream of the replica that submitted them     KEYS[8] its job set
-- ARGV[1]    reply stream TTL ms     ARGV[2] the event to answer them
-- ARGV[3..]  job ids (all of that replica)
-- Returns the number answered; a job no longer waiting in the queue, or not pinned, is left alone
--!include lib/jobs.lua

local QUEUE = KEYS[5]
counts_in(KEYS[6])
local REPLY, REPLICA_JOBS = KEYS[7], KEYS[8]
local answered = 0
for i = 3, #ARGV do
  local job = ARGV[i]
  local rec = redis.call('ZSCORE', QUEUE, job) and get_record(job)
  if rec and rec.state == 'q' and rec.pin then
    redis.call('ZREM', QUEUE, job)
    count(rec, 'q', -1)
    redis.call('XADD', REPLY, '*', 'job', job, 'event', ARGV[2])
    redis.call('PEXPIRE', REPLY, tonumber(ARGV[1]))
    drop_job(job, REPLICA_JOBS)
    answered = answered + 1
  end
end
return answered
