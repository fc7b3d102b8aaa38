-- A provider as one pump() call sees it (`ctx`, lib/pump.lua): {ok = it can take work
-- (lib/takes_work.lua), cap = its capacity, inf = its in_flight}, read from provider hash
-- `pkey` once per call and kept up to date by the call's dispatches (lib/assign.lua).
--!include lib/takes_work.lua

local function provider_state(ctx, pkey)
  local s = ctx.providers[pkey]
  if s == nil then
    local v = redis.call('HMGET', pkey, 'health', 'hb_exp', 'capacity', 'drain', 'in_flight')
    s = {ok = takes_work(v, ctx.now), cap = tonumber(v[3]) or 0, inf = tonumber(v[5]) or 0}
    ctx.providers[pkey] = s
  end
  return s
end
