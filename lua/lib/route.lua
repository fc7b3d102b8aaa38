-- Where job `job` of `lane` goes, offered `cand` (the lane's pick, lib/pick.lua). Returns
--   'ok', rec, the candidate: dispatch it there (lib/assign.lua); `cand` itself, or, when
--        the job may not go there, the best candidate that may take it; with affinity, the
--        one lib/affine.lua chose (its blocks remembered there, the decision counted)
--   'ahead', rec, cand, other: the job waits for its busy home and `cand` goes to job
--        `other` instead (lib/look_ahead.lua): route that one, `looked` set
--   'held': the job waits for its busy home and nothing behind it takes `cand`
--   'blocked': the only free candidates are ones it may not use: it waits for another
--   'full': no candidate has a free slot and no home of its prompt has room in its home
--        queue (`cand` was offered for that queue: lib/next_head.lua): it waits
--   'gone': it has no record (it leaves the queue)
-- `looked`: the job is one look_ahead found, which waits for nothing. A submit's arriving
-- job (ctx.arriving) has its record in hand, not yet in Redis. `ctx`: the pump()
-- call's state (lib/pump.lua).
--!include lib/jobs.lua
--!include lib/dispatch_plan.lua
--!include lib/queue_of.lua
--!include lib/serves.lua
--!include lib/excluded.lua
--!include lib/pick.lua
--!include lib/other_candidate.lua
--!include lib/affine.lua
--!include lib/look_ahead.lua
--!include lib/remember.lua
--!include lib/has_slot.lua
--!include lib/arrived.lua

local function route(ctx, job, lane, cand, looked)
  local qkey, now = queue_of(lane), ctx.now
  local a = arrived(ctx, job)
  local rec = a and a.rec or get_record(job)
  if rec == nil then
    redis.call('ZREM', qkey, job)
    redis.call('ZREM', DEADLINES, job)
    return 'gone'
  end
  if not serves(cand, rec) or excluded(rec, cand.provider) then
    cand = pick(ctx, lane, rec)
    if cand == nil and rec.excluded ~= nil and not other_candidate(qkey, rec, now) then
      -- Every provider it may still try is down: the ones that failed it are its only
      -- chance left, rather than a head that waits for nobody.
      rec.excluded = nil
      cand = pick(ctx, lane, rec)
    end
    if cand == nil then return 'blocked' end
  end
  if lane.load_bound > 0 and rec.blocks then
    local chosen, decision, held, busy
    local patient = not looked and lane.max_wait_ms > 0 and (rec.passed_ms == nil or now - rec.passed_ms < lane.max_wait_ms)
    chosen, decision, held, busy = affine(ctx, lane, rec, cand, patient)
    if decision == 'spill' and patient then
      local other = look_ahead(ctx, lane, job, cand)
      if other ~= nil or busy then
        if rec.passed_ms == nil then
          rec.passed_ms = now
          put_record(job, rec)
        end
        if other ~= nil then return 'ahead', rec, cand, other end
        return 'held'
      end
    end
    cand = chosen
    if decision ~= 'hit' and not has_slot(ctx, cand) then return 'full' end
    remember(lane, rec, cand.provider, held, now)
    redis.call('HINCRBY', KEYS[BASE + PLAN.affinity_stats], lane.model .. '\t' .. decision, 1)
  elseif not has_slot(ctx, cand) then
    return 'full'
  end
  return 'ok', rec, cand
end
