-- Is the deadline of head `h` ({lane, job, ...}, lib/next_head.lua) still ahead? One that
-- passed leaves its queue (lib/expire.lua).
--!include lib/jobs.lua
--!include lib/queue_of.lua
--!include lib/expire.lua

local function live(ctx, h)
  local dl = tonumber(redis.call('ZSCORE', DEADLINES, h.job))
  if dl == nil or dl > ctx.now then return true end
  expire(ctx, queue_of(h.lane), h.job)
  return false
end
