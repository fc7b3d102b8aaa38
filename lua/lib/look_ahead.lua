-- Under saturation (affinity): the head job `head_job` may not run on its home (busy, or
-- over the bound) and `cand` is free. Rather than run it there uncached, `cand` goes to
-- the first of the next lane.look_ahead jobs whose home `cand` is (the first holder of
-- the deepest of its blocks the index holds) or that has none, if one may run now; the
-- head keeps its place. The caller passes a head over so for at most lane.max_wait_ms
-- (rec.passed_ms: lib/route.lua). Returns that job's id, or nil. `ctx`: the pump() call's
-- state (lib/pump.lua).
--!include lib/jobs.lua
--!include lib/dispatch_plan.lua
--!include lib/queue_of.lua
--!include lib/tenant_of.lua
--!include lib/may_run.lua
--!include lib/serves.lua
--!include lib/excluded.lua

local function look_ahead(ctx, lane, head_job, cand)
  if lane.look_ahead == 0 then return nil end
  local index = KEYS[BASE + lane.index]
  local rank = redis.call('ZRANK', queue_of(lane), head_job)
  if rank == false then return nil end
  -- FIFO within a tenant (flow control) holds: a job never runs before an earlier one of
  -- its tenant (the head, or one this call found blocked ahead of it).
  local passed = {}
  for i, job in ipairs(redis.call('ZRANGE', queue_of(lane), 0, rank + lane.look_ahead)) do
    local t = FAIR ~= nil and tenant_of(job)
    local r = i > rank + 1 and not (t and passed[t]) and may_run(ctx, job) and get_record(job)
    if t then passed[t] = true end
    local dl = r and tonumber(redis.call('ZSCORE', DEADLINES, job))
    if r and serves(cand, r) and not excluded(r, cand.provider) and (dl == nil or dl > ctx.now) then
      if not r.blocks then return job end  -- it has no home: it loses nothing there
      local held = redis.call('HMGET', index, unpack(r.blocks))
      local home
      for b = #r.blocks, 1, -1 do
        if held[b] then
          home = string.match(held[b], '^[^,]+')
          break
        end
      end
      if home == nil or home == cand.provider then return job end
    end
  end
  return nil
end
