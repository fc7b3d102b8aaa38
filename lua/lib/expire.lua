-- Job `job` of queue `qkey` is past its deadline: it leaves the queue (state 'x': it keeps
-- its record and its deadline entry until its API collects it), unless the pump() call
-- `ctx` (lib/pump.lua) has spent its budget of expiries. True if it left.
--!include lib/jobs.lua

local function expire(ctx, qkey, job)
  if ctx.expire_budget == 0 then return false end
  ctx.expire_budget = ctx.expire_budget - 1
  redis.call('ZREM', qkey, job)
  local rec = get_record(job)
  if rec then
    count(rec, 'q', -1)
    rec.state = 'x'
    put_record(job, rec)
  end
  redis.call('HDEL', BODIES, job)
  return true
end
