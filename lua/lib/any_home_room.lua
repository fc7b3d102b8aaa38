-- A candidate of `lane` with room in its home queue (lib/home_room.lua), for a lane none of
-- whose candidates has a free slot (lib/next_head.lua): offered to the lane's head, which
-- goes there only as a hit (lib/route.lua). nil: none has room, or the lane has no home
-- queue. `ctx`: the pump() call's state (lib/pump.lua).
--!include lib/dispatch_plan.lua
--!include lib/provider_state.lua
--!include lib/usable.lua
--!include lib/home_room.lua
--!include lib/warm.lua

local function any_home_room(ctx, lane)
  if lane.home_queue <= 0 then return nil end
  for _, cand in ipairs(lane.candidates) do
    local s = provider_state(ctx, KEYS[BASE + cand.provider_key])
    if usable(ctx, lane, s) and (not cand.managed or warm(ctx, cand)) and home_room(lane, s, nil, ctx.now) then return cand end
  end
  return nil
end
