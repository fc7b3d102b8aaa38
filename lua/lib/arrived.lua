-- The submit's arriving job (lib/pump.lua: ctx.arriving) when that is job `job`, else nil:
-- its record and body are in hand, and it is in no queue yet (lib/route.lua, lib/assign.lua).

local function arrived(ctx, job)
  local a = ctx.arriving
  if a ~= nil and a.job == job then return a end
  return nil
end
