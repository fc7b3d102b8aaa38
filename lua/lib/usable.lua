-- May a pump give provider state `s` (lib/provider_state.lua), a candidate of `lane`, work:
-- it can take work and is not ejected -- or it is ejected, but none of the lane's other
-- providers can take work: a 5xx alone never leaves a request with no provider
-- (lib/eject.lua). Busy or not does not matter here. `ctx`: the pump() call's state; what
-- it finds of a lane is kept there (ctx.in_rotation).
--!include lib/dispatch_plan.lua
--!include lib/provider_state.lua

local function usable(ctx, lane, s)
  if not s.ok then return false end
  if not s.ejected then return true end
  ctx.in_rotation = ctx.in_rotation or {}
  local any = ctx.in_rotation[lane.queue]
  if any == nil then
    any = false
    for _, cand in ipairs(lane.candidates) do
      local other = provider_state(ctx, KEYS[BASE + cand.provider_key])
      if other.ok and not other.ejected then
        any = true
        break
      end
    end
    ctx.in_rotation[lane.queue] = any
  end
  return not any
end
