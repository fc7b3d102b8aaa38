-- A provider as one pump() call sees it (`ctx`, lib/pump.lua), read from provider hash
-- `pkey` once per call and kept up to date by the call's dispatches (lib/assign.lua):
--   ok       it can take work (lib/takes_work.lua)
--   cap      the slots dispatch fills: its capacity (the limit in force: the config's, or
--            the learned one, lua/capacity.lua); one while it is on trial after an ejection
--   inf      its in_flight, plus what its engine runs and queues for other clients (ext:
--            load iop does not send counts against it); at least cap while a rate limit
--            holds it (hold_until: nothing new goes there)
--   ejected  out of rotation for its 5xx answers (lib/eject.lua) until ej_until: a lane
--            uses it only when none of its other providers can take work (lib/usable.lua)
--   firm     nothing goes past cap, not even to a home's queue (lib/home_room.lua): it is on
--            trial, or a rate limit holds it
--   svc      the median time of its recent calls, ms (svc_ms, lua/capacity.lua; 0: unknown)
--   auto     its capacity is learned (capacity_mode 'auto'): cap is where its engine queues
--!include lib/takes_work.lua

local function provider_state(ctx, pkey)
  local s = ctx.providers[pkey]
  if s == nil then
    local v = redis.call('HMGET', pkey, 'health', 'hb_exp', 'capacity', 'drain', 'off', 'in_flight', 'ext',
                         'hold_until', 'ej_until', 'ej_trial', 'svc_ms', 'capacity_mode')
    local now = ctx.now
    s = {ok = takes_work(v, now), cap = tonumber(v[3]) or 0, inf = (tonumber(v[6]) or 0) + (tonumber(v[7]) or 0),
         ejected = false, firm = false, svc = tonumber(v[11]) or 0, auto = v[12] == 'auto'}
    if v[10] == '1' then
      if (tonumber(v[9]) or 0) > now then
        s.ejected = true
      else
        s.cap = math.min(s.cap, 1)  -- on trial: one request at a time until one is answered
        s.firm = true
      end
    end
    if (tonumber(v[8]) or 0) > now then
      s.inf = math.max(s.inf, s.cap)
      s.firm = true
    end
    ctx.providers[pkey] = s
  end
  return s
end
