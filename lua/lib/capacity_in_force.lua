-- The capacity dispatch fills on provider hash `pkey` when its worker proposes `proposed`
-- (the config's capacity, or the limit `capacity: auto` learned): an operator's override
-- (lua/override.lua) stands over both -- `cap_o`, a fixed capacity, else the proposal kept
-- within `cap_lo`..`cap_hi`, the bounds an operator gave a learned limit. The proposal is
-- kept as `cap_c`, so that an override that ends puts the worker's value back at once,
-- rather than at its next heartbeat. Writes both fields; returns the capacity in force.

local function capacity_in_force(pkey, proposed)
  local v = redis.call('HMGET', pkey, 'cap_o', 'cap_lo', 'cap_hi')
  local cap = tonumber(v[1])
  if cap == nil then
    cap = tonumber(proposed) or 0
    local lo, hi = tonumber(v[2]), tonumber(v[3])
    if hi ~= nil and cap > hi then cap = hi end
    if lo ~= nil and cap < lo then cap = lo end
  end
  redis.call('HSET', pkey, 'cap_c', proposed, 'capacity', cap)
  return cap
end
