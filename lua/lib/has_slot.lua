-- Has candidate `cand` a free slot (in_flight under its capacity, in the pump() call's view
-- `ctx`: lib/pump.lua)? Only a home's queue takes a job past that (lib/home_room.lua).
--!include lib/dispatch_plan.lua
--!include lib/provider_state.lua

local function has_slot(ctx, cand)
  local s = provider_state(ctx, KEYS[BASE + cand.provider_key])
  return s.inf < s.cap
end
