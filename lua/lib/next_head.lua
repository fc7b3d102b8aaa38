-- The head to dispatch next across `lanes` and the candidate it is offered (nil: none this
-- call): the first of the lanes' heads in the ordering (lib/before.lua) whose lane has a
-- candidate with a free slot (lib/pick.lua), or with room in a home queue
-- (lib/any_home_room.lua). Each lane's head is read once per pump() call
-- (`ctx`, lib/pump.lua) and again only after the lane gave one up: ctx.heads[i] is lane i's
-- head {lane, job, score, i}; nil: to be read (a submit's arriving job first, ctx.arriving:
-- it is its lane's only one); false: nothing more this call (empty, or no
-- free provider may take its jobs). A head held for its busy home keeps the slot from the
-- lanes of later bands (ctx.held_band). In a plan with models iop loads and unloads (its
-- header's `copies`), a head that found no provider holding its model loaded with a free
-- slot may place a load (lib/place.lua).
--!include lib/pick.lua
--!include lib/place.lua
--!include lib/any_home_room.lua
--!include lib/head.lua
--!include lib/may_run.lua
--!include lib/before.lua

local function next_head(ctx, lanes)
  local heads, best, best_cand = ctx.heads, nil, nil
  for i, lane in ipairs(lanes) do
    local h = heads[i]
    if ctx.held_band ~= nil and lane.band > ctx.held_band then h = false end
    if h and not may_run(ctx, h.job) then h = nil end  -- its tenant reached its cap meanwhile
    local a = ctx.arriving
    if h == nil and a ~= nil and a.lane == lane and not a.offered then
      a.offered = true
      h = {lane = lane, job = a.job, score = a.score, i = i, arriving = true}
      heads[i] = h
    elseif h == nil then
      local job, score = head(ctx, lane, ctx.skips[i] or 0)
      h = job and {lane = lane, job = job, score = score, i = i} or false
      heads[i] = h
    end
    if h then
      local cand = pick(ctx, lane, nil) or any_home_room(ctx, lane)
      if cand == nil then
        if PLAN.copies then place(ctx, lane) end
        heads[i] = false  -- a dispatch only fills providers: none frees up this call
      elseif best == nil or before(h, best) then
        best, best_cand = h, cand
      end
    end
  end
  return best, best_cand
end
