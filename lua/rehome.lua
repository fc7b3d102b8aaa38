-- rehome: move waiting jobs out of a lane queue that no plan of the current config pumps
-- (a reload renamed or removed the lane: a provider added or removed, a band renamed) into
-- the lane each belongs in now (dispatcher/plans.py home_of, worked out by the caller).
-- A job keeps its score, so its place among the jobs it waited with (global submit order,
-- or fair tags on the band's clock) is kept; its record names its new lane. Then the new
-- lane is pumped, as a submit would be.
--
-- KEYS[1..5] jobs, bodies, leases, deadlines, fence (see lib/jobs.lua, lib/dispatch_plan.lua)
-- KEYS[6]    the old queue   KEYS[7] the new queue (the plan's lane)
-- KEYS[..]   plan keys of the new lane
-- ARGV[1..3] plan id, plan key offset, lease ms (see lib/dispatch_plan.lua)
-- ARGV[4]    the new lane's name     ARGV[5..] job ids
-- Returns {moved, dispatched}; a job no longer waiting in the old queue is left alone
--!include lib/jobs.lua
--!include lib/enqueue.lua
--!include lib/pump.lua

local OLD, NEW = KEYS[6], KEYS[7]
local moved = 0
for i = 5, #ARGV do
  local job = ARGV[i]
  local score = redis.call('ZSCORE', OLD, job)
  local rec = score and get_record(job)
  if rec and rec.state == 'q' then
    redis.call('ZREM', OLD, job)
    enqueue(NEW, score, job)
    rec.lane = ARGV[4] ~= '' and ARGV[4] or nil
    -- Its API still names the queue it submitted to: cancel.lua removes it from this one.
    rec.queue = NEW
    put_record(job, rec)
    moved = moved + 1
  end
end
return {moved, pump(now_ms())}
