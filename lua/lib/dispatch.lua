-- Dispatch job `job` of `lane`, offered candidate `cand` (lib/pick.lua): where it goes
-- (lib/route.lua), then the dispatch itself (lib/assign.lua). A job that waits for its busy
-- home hands `cand` to the job look-ahead found behind it, which is routed in its place
-- (once: that one waits for nothing). Returns 'ok' (a job was dispatched), 'held' (the job
-- waits for its home; no job took `cand`), 'blocked' (only candidates it may not use are
-- free: it waits for another to free up), 'full' (`cand` had room only in a home queue,
-- and the job is no hit there) or 'gone' (no record); for a job found ahead, its
-- outcome. `ctx`: the pump() call's state (lib/pump.lua).
--!include lib/route.lua
--!include lib/assign.lua

local function dispatch(ctx, job, lane, cand)
  local outcome, rec, to, other = route(ctx, job, lane, cand, false)
  if outcome == 'ahead' then
    job = other
    outcome, rec, to = route(ctx, job, lane, to, true)
  end
  if outcome == 'ok' then assign(ctx, job, rec, lane, to) end
  return outcome
end
