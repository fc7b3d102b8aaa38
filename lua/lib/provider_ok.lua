-- Can provider hash `pkey` take work now (lib/takes_work.lua), and is it in rotation (not
-- ejected for its 5xx answers until ej_until: lib/eject.lua)? One read, outside a pump's
-- provider states (lib/provider_state.lua): a job's other candidates (lib/other_candidate.lua).
--!include lib/takes_work.lua

local function provider_ok(pkey, now)
  local v = redis.call('HMGET', pkey, 'health', 'hb_exp', 'capacity', 'drain', 'off', 'ej_until', 'ej_trial')
  return takes_work(v, now) and not (v[7] == '1' and (tonumber(v[6]) or 0) > now)
end
