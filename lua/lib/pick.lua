-- The candidate of `lane` a job goes to (nil: none has a free slot): among those that may
-- take work (lib/usable.lua) and have a free slot, the highest in the model's preference
-- (`rank`: models[].preference or an operator's override; 0 for the rest), then the lowest
-- in_flight/capacity, compared exactly as a*d < c*b; ties: lower in_flight, then provider
-- id. Only where its model is loaded (lib/warm.lua). `rec`: the job's record, when known:
-- only candidates that may run it (lib/serves.lua, lib/excluded.lua). `ctx`: the pump()
-- call's state (lib/pump.lua).
--!include lib/dispatch_plan.lua
--!include lib/provider_state.lua
--!include lib/usable.lua
--!include lib/serves.lua
--!include lib/excluded.lua
--!include lib/warm.lua

local function pick(ctx, lane, rec)
  local best, bs
  for _, cand in ipairs(lane.candidates) do
    local s = provider_state(ctx, KEYS[BASE + cand.provider_key])
    if s.inf < s.cap and usable(ctx, lane, s) and (not cand.managed or warm(ctx, cand))
       and (rec == nil or (serves(cand, rec) and not excluded(rec, cand.provider))) then
      if best == nil then
        best, bs = cand, s
      else
        local ra, rb = cand.rank or 0, best.rank or 0
        local l, r = s.inf * bs.cap, bs.inf * s.cap
        if ra > rb or (ra == rb and (l < r or (l == r and (s.inf < bs.inf or
            (s.inf == bs.inf and cand.provider < best.provider))))) then
          best, bs = cand, s
        end
      end
    end
  end
  return best
end
