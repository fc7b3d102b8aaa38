-- Flow control: tenant `t` as one pump() call sees it (`ctx`, lib/pump.lua): {lim = its
-- max_in_flight (nil: none), run = its running jobs}, read once per call and kept up to date
-- by the call's dispatches (lib/dispatched.lua).
--!include lib/jobs.lua
--!include lib/dispatch_plan.lua

local function tenant_state(ctx, t)
  local s = ctx.tenants[t]
  if s == nil then
    s = {lim = tonumber(redis.call('HGET', FAIR.lim, t) or ''),
         run = tonumber(redis.call('HGET', TENANTS, 'r:' .. t) or '0') or 0}
    ctx.tenants[t] = s
  end
  return s
end
