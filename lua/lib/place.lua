-- The placement decision (docs/DESIGN.md "Models that load and unload"): should `lane`'s
-- model, whose head found no provider holding it loaded with a free slot (lib/next_head.lua),
-- be loaded on one more provider whose models iop manages, and where. Made inside the pump
-- that found the lane waiting, so once for the whole fleet, atomically, whichever process
-- pumps; at most once per lane and call (`ctx`, lib/pump.lua).
--
-- The law: load where it costs least when the model's waiting jobs would start sooner on a
-- new copy than on the copies there are (loaded, being loaded, or on a provider of unknown
-- state, which lib/warm.lua treats as loaded) -- no copy at all (a model loaded nowhere: its first
-- request places the load and waits for it), or the wait for the copies loaded or loading,
-- (jobs waiting) x (their mean service time) / (their slots), longer than the new copy's
-- load time. With copies and no service time measured yet, nothing is placed: the
-- evidence that waiting costs more is not there. Cost: the candidate's expected load time
-- (its last loads of the model there, lua/load_done.lua `ml:`, else its config's load_s);
-- ties: the lower in_flight/capacity, then the provider id. A candidate takes no order
-- while its provider cannot take work, already loads something (lib/load_order.lua), or
-- failed this model's last load a short while ago (`mf:`, growing with each failure); nor
-- when it has no room: every model it holds busy, or used within its unload_idle_s
-- (lib/model_room.lua). A copy being loaded counts as one there is, so one burst orders
-- one load, and a second only if even with it the wait is longer than a load.
--
-- The order: the provider hash's load, load_evict (the model it unloads first), load_at,
-- load_until (its load timeout: an order no worker finished by then lapses), load_by
-- cleared; the model 'loading', the one evicted 'unloading' (neither takes requests).
-- The provider's worker carries it out through the runtime's API (workers/model_lifecycle.py)
-- and reports with lua/load_done.lua, which pumps: the waiting jobs start there.
--!include lib/dispatch_plan.lua
--!include lib/queue_of.lua
--!include lib/provider_state.lua
--!include lib/model_state.lua
--!include lib/load_order.lua
--!include lib/model_room.lua
--!include lib/copies.lua

local function place(ctx, lane)
  ctx.placed = ctx.placed or {}
  if ctx.placed[lane.queue] then return end
  ctx.placed[lane.queue] = true
  local now = ctx.now
  local slots, svc_sum, svc_n, cold = 0, 0, 0, {}
  for _, cand in ipairs(lane.candidates) do
    local pkey = KEYS[BASE + cand.provider_key]
    local s = provider_state(ctx, pkey)
    if s.ok and s.cap > 0 then
      local copy = not cand.managed
      if cand.managed then
        local m = model_state(ctx, pkey, cand.served)
        local order = load_order(ctx, pkey)
        copy = m.state == 'loaded' or m.state == 'unknown' or (m.state == 'loading' and order.served == cand.served)
        if not copy and order.served == '' and m.fail_until <= now then
          cold[#cold + 1] = {cand = cand, pkey = pkey, s = s, cost = m.load_ms or order.load_ms, order = order}
        end
      end
      if copy then
        slots = slots + s.cap
        if s.svc > 0 then svc_sum, svc_n = svc_sum + s.svc, svc_n + 1 end
      end
    end
  end
  if #cold == 0 then return end
  table.sort(cold, function(a, b)
    if a.cost ~= b.cost then return a.cost < b.cost end
    local l, r = a.s.inf * b.s.cap, b.s.inf * a.s.cap
    if l ~= r then return l < r end
    return a.cand.provider < b.cand.provider
  end)
  if slots > 0 then
    if svc_n == 0 then return end
    local waiting = redis.call('ZCARD', queue_of(lane))
    if ctx.arriving ~= nil and ctx.arriving.lane == lane then waiting = waiting + 1 end
    if waiting * (svc_sum / svc_n) / slots <= cold[1].cost then return end
  end
  for _, c in ipairs(cold) do
    local ok, victim = model_room(ctx, c.cand.provider, c.pkey, c.cand.served, c.order)
    if ok then
      local served = c.cand.served
      redis.call('HSET', c.pkey, 'load', served, 'load_evict', victim or '', 'load_at', now,
                 'load_until', now + (tonumber(redis.call('HGET', c.pkey, 'load_timeout_ms')) or 600000),
                 'ms:' .. served, 'loading', 'mt:' .. served, now)
      redis.call('HDEL', c.pkey, 'load_by')
      if victim then
        redis.call('HSET', c.pkey, 'ms:' .. victim, 'unloading', 'mt:' .. victim, now)
        note_copies(redis.call('HGET', c.pkey, 'mm:' .. victim), c.cand.provider, false)
      end
      c.order.served, c.order.evict = served, victim or ''
      local m = model_state(ctx, c.pkey, served)
      m.state, m.since = 'loading', now
      if victim then
        local v = model_state(ctx, c.pkey, victim)
        v.state, v.since = 'unloading', now
      end
      return
    end
  end
end
