-- Is the deadline of head `h` ({lane, job, ...}, lib/next_head.lua) still ahead? One that
-- passed leaves its queue (lib/expire.lua). A submit's arriving job (lib/next_head.lua)
-- carries its deadline, which its submit made later than now.
--!include lib/jobs.lua
--!include lib/queue_of.lua
--!include lib/expire.lua

local function live(ctx, h)
  if h.arriving then return true end
  local dl = tonumber(redis.call('ZSCORE', DEADLINES, h.job))
  if dl == nil or dl > ctx.now then return true end
  expire(ctx, queue_of(h.lane), h.job)
  return false
end
