-- The load iop ordered on provider hash `pkey` (lib/place.lua), as one pump() call sees it
-- (`ctx`, lib/pump.lua), with the provider's lifecycle settings its worker publishes
-- (lua/models.lua):
--   served     the model being loaded ('' none: no order in force, or its time ran out --
--              its worker died, or never answered -- so another may be placed)
--   evict      the model unloaded first to make room ('' none)
--   max_loaded models the runtime holds at once
--   load_ms    the expected load time of a model never timed there (the config's load_s)
--   idle_ms    a model unused for less than this is never unloaded for another
-- At most one order per provider at a time: a runtime loads one model at a time, and a
-- second would only wait behind the first, holding its room.

local function load_order(ctx, pkey)
  ctx.orders = ctx.orders or {}
  local o = ctx.orders[pkey]
  if o == nil then
    local v = redis.call('HMGET', pkey, 'load', 'load_evict', 'load_until', 'max_loaded', 'load_ms0', 'unload_idle_ms')
    local live = (v[1] or '') ~= '' and (tonumber(v[3]) or 0) > ctx.now
    o = {served = live and v[1] or '', evict = live and (v[2] or '') or '', max_loaded = tonumber(v[4]) or 1,
         load_ms = tonumber(v[5]) or 30000, idle_ms = tonumber(v[6]) or 0}
    ctx.orders[pkey] = o
  end
  return o
end
