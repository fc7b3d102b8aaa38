-- The one health predicate: can provider hash `v` (HMGET of health, hb_exp, capacity,
-- drain, off, in that order) take work now -- healthy, heard from, a capacity, not drained
-- by an operator (lua/drain.lua), not disabled by one (lua/override.lua)?
-- lib/unavailable_reason.lua says why not, in words.
-- Its readers: lib/provider_state.lua (a pump's view) and lib/provider_ok.lua (one look).

local function takes_work(v, now)
  return v[1] == 'available' and (tonumber(v[2]) or 0) >= now and (tonumber(v[3]) or 0) > 0
    and (v[4] or '') == '' and (v[5] or '') == ''
end
