-- The dispatch step, shared by every script that may hand out slots: pump(now) hands free
-- slots to waiting jobs across the plan's lanes (lib/dispatch_plan.lua: what a script
-- that includes this file takes in KEYS and ARGV). Never run alone.
--
-- Flow control is start-time fair queuing per band: a job's score is its tag,
-- max(V, F[tenant]), and F[tenant] moves on by 1/weight; V is the tag of the band's last
-- dispatch, one clock for every lane of the band, so heads of different lanes (models,
-- endpoints) compare by their tags and weights hold across them. Backlogged tenants get
-- slots in proportion to their weights, a tenant's own jobs stay FIFO, and a newcomer's tag
-- is V: it waits behind at most one round, not behind a flood. Without flow control the
-- score is the global submit sequence (plain FIFO). (submit.lua sets the tags,
-- lib/dispatched.lua moves V.)
--
-- One call's parts: the next head and its candidate (lib/next_head.lua: the ordering,
-- lib/before.lua; the candidate, lib/pick.lua), its deadline (lib/live.lua), its dispatch
-- (lib/dispatch.lua). What they share of one call is the context `ctx` made here and
-- passed to each:
--   now            server ms of the call
--   providers      provider hash key -> its state (lib/provider_state.lua)
--   tenants, vtime flow control: tenant -> its state (lib/tenant_state.lua), 'band:<n>' ->
--                  the band's clock V (lib/dispatched.lua)
--   heads          lane i -> its head (lib/next_head.lua)
--   skips          lane i -> how many of its jobs this call passed over as blocked
--   held_band      the band of a head held for its busy home: later bands get no slot
--                  this call
--   park_budget, expire_budget  what is left of the call's budgets (below)
--   arriving       the job a submit offers as its lane's head without queueing it first
--                  ({job, score, rec, body, lane}: lua/submit.lua), or nil
--!include lib/dispatch_plan.lua
--!include lib/lanes_with_jobs.lua
--!include lib/next_head.lua
--!include lib/live.lua
--!include lib/dispatch.lua

-- Jobs one call parks at most (the rest at the next call): bounds a call's length when a
-- capped tenant's flood reaches the head of a lane (lib/head.lua).
local PARK_BUDGET = 256
-- Jobs of a lane one call passes over because only busy providers may run them.
local BLOCKED_SKIPS = 16
-- Waiting jobs one call drops because their deadline passed (their APIs collect them:
-- lib/expire.lua).
local EXPIRE_BUDGET = 64

-- Hand out free slots to waiting jobs: the first head across the plan's lanes in the
-- ordering (band, then fair tag; or submit order), each to the candidate with the lowest
-- in_flight/capacity. Returns the number dispatched. `arriving` (optional): a job that is
-- its lane's only one, offered as that lane's head as it is: it is dispatched like any head,
-- and when it is not, it is in no queue yet (its submit queues it) and nothing of its lane
-- comes after it this call.
local function pump(now, arriving)
  local lanes = lanes_with_jobs()
  if #lanes == 0 then return 0 end
  local ctx = {now = now, providers = {}, tenants = {}, vtime = {}, heads = {}, skips = {}, held_band = nil,
               park_budget = PARK_BUDGET, expire_budget = EXPIRE_BUDGET, arriving = arriving}
  local heads, skips = ctx.heads, ctx.skips
  local count_dispatched = 0
  while true do
    local best, best_cand = next_head(ctx, lanes)
    if best == nil then break end
    local outcome = 'expired'
    if live(ctx, best) then
      outcome = dispatch(ctx, best.job, best.lane, best_cand)
    elseif ctx.expire_budget == 0 then
      break  -- the rest of the expired heads at the next call
    end
    heads[best.i] = nil
    if best.arriving then
      heads[best.i] = false  -- its lane held nothing else
      if outcome == 'ok' then count_dispatched = count_dispatched + 1 end
    elseif outcome == 'ok' then
      count_dispatched = count_dispatched + 1
    elseif outcome == 'held' then
      heads[best.i] = false
      ctx.held_band = math.min(ctx.held_band or best.lane.band, best.lane.band)
    elseif outcome == 'full' then
      heads[best.i] = false  -- nothing of this lane runs before it
    elseif outcome == 'blocked' then
      -- Only busy or failed providers may run it: it keeps its place, and the jobs behind
      -- it go on (a few per lane and call, which bounds the call's cost).
      skips[best.i] = (skips[best.i] or 0) + 1
      if skips[best.i] > BLOCKED_SKIPS then heads[best.i] = false end
    end
  end
  return count_dispatched
end
