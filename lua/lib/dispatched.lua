-- Flow control: the job of record `rec`, of `lane`, was dispatched: its tenant's counters
-- move from waiting to running (in Redis and in the pump() call's view, `ctx`), and its
-- band's clock V moves on to its tag if that is later (start-time fair queuing: the file
-- header of lib/pump.lua). Without flow control, nothing.
--!include lib/jobs.lua
--!include lib/dispatch_plan.lua
--!include lib/tenant_state.lua
--!include lib/num.lua

local function dispatched(ctx, rec, lane)
  if FAIR == nil then return end
  count(rec, 'q', -1)
  count(rec, 'r', 1)
  if rec.tenant then tenant_state(ctx, rec.tenant).run = tenant_state(ctx, rec.tenant).run + 1 end
  local band = 'band:' .. lane.band
  local vtime = ctx.vtime
  if vtime[band] == nil then vtime[band] = tonumber(redis.call('HGET', FAIR.v, band) or '0') or 0 end
  if rec.tag and rec.tag > vtime[band] then
    vtime[band] = rec.tag
    redis.call('HSET', FAIR.v, band, num(rec.tag))
  end
end
