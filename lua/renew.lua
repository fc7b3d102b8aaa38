-- renew: extend the leases of the jobs a worker is running, and tell it which ones it
-- must stop (cancelled by their API, or taken over after its lease expired).
--
-- KEYS[1..4] jobs, bodies, leases, deadlines (see lib/jobs.lua)
-- ARGV[1]    lease ms
-- ARGV[2..]  job id, fence, job id, fence, ...
-- Returns a flat list job id, fence, reason, ... of the runs to abort; reason 'cancelled' | 'stale'
-- (one worker may hold two runs of a job: a taken-over one and its new dispatch)
--!include lib/jobs.lua

local expiry = now_ms() + tonumber(ARGV[1])
local abort = {}
for i = 2, #ARGV, 2 do
  local job = ARGV[i]
  local rec = get_record(job)
  if not owned(rec, ARGV[i + 1]) or redis.call('ZSCORE', LEASES, job) == false then
    abort[#abort + 1] = job
    abort[#abort + 1] = ARGV[i + 1]
    abort[#abort + 1] = 'stale'
  else
    redis.call('ZADD', LEASES, 'XX', expiry, job)
    if rec.state == 'c' then
      abort[#abort + 1] = job
      abort[#abort + 1] = ARGV[i + 1]
      abort[#abort + 1] = 'cancelled'
    end
  end
end
return abort
