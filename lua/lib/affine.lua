-- Cache-aware dispatch (a lane whose model has affinity, a job with blocks: the chained
-- hashes of its prompt's blocks, or the one of its conversation). The lane's index
-- (lane.index) maps a block to the providers that served a prompt with that head, its
-- home first, then second homes in the order they were made. The job goes to the first
-- holder of the longest head that may run it, has a free slot and is within the load
-- bound: its load ratio with this job at most lane.load_bound x the lane's mean, (inf + 1)
-- / cap <= bound x (sum inf + 1) / (sum cap), or at most lane.load_floor (load_floor_auto for
-- a provider whose capacity is learned: its limit is where its engine queues); with none free,
-- to the first of them with room in its home queue (lib/home_room.lua: lane.home_queue).
-- A holder within the bound but busy is waited for while `patient` (the job has not waited
-- lane.max_wait_ms for it): 'spill' with busy = true, and the caller holds the job. A head
-- whose holders are all over the bound spills to a shorter head's, then to `default` (the
-- S04 choice). A provider that may not take work (down, drained, removed, ejected:
-- lib/usable.lua), or does not hold the model loaded (lib/warm.lua), holds nothing. Returns the candidate, 'hit' | 'miss' | 'spill',
-- the index's entries of the job's blocks (lib/remember.lua writes them back) and busy.
-- `ctx`: the pump() call's state (lib/pump.lua).
--!include lib/dispatch_plan.lua
--!include lib/provider_state.lua
--!include lib/usable.lua
--!include lib/serves.lua
--!include lib/excluded.lua
--!include lib/home_room.lua
--!include lib/warm.lua

local function affine(ctx, lane, rec, default, patient)
  local held = redis.call('HMGET', KEYS[BASE + lane.index], unpack(rec.blocks))
  local eligible, total_inf, total_cap = {}, 0, 0
  for _, cand in ipairs(lane.candidates) do
    local s = provider_state(ctx, KEYS[BASE + cand.provider_key])
    if usable(ctx, lane, s) and (not cand.managed or warm(ctx, cand)) and serves(cand, rec) and not excluded(rec, cand.provider) then
      eligible[cand.provider] = cand
      total_inf, total_cap = total_inf + s.inf, total_cap + s.cap
    end
  end
  -- Within the bound: at most ceil(bound x (sum inf + 1) x cap / sum cap) jobs with this
  -- one (the ceiling lets a lightly loaded lane place at all: consistent hashing with
  -- bounded loads, capacity-weighted).
  local function bounded(s)
    return s.inf + 1 <= math.max(math.ceil(lane.load_bound * (total_inf + 1) * s.cap / total_cap - 1e-9),
                                 math.floor((s.auto and lane.load_floor_auto or lane.load_floor) * s.cap + 1e-9))
  end
  local spilled, busy = false, false
  for i = #rec.blocks, 1, -1 do
    if held[i] then
      local queued, waits = nil, false
      for pid in string.gmatch(held[i], '[^,]+') do
        local cand = eligible[pid]
        if cand then
          local s = provider_state(ctx, KEYS[BASE + cand.provider_key])
          if bounded(s) then
            if s.inf < s.cap then return cand, 'hit', held end
            if queued == nil and home_room(lane, s, rec, ctx.now) then queued = cand end
            waits = true
          end
          spilled = true
        end
      end
      if queued then return queued, 'hit', held end
      if waits then
        -- Busy but within the bound: worth waiting for, rather than a second home.
        if patient then return default, 'spill', held, true end
        busy = true
      end
    end
  end
  if spilled then return default, 'spill', held, busy end
  -- A head no provider holds goes to the provider holding the fewest of the index's
  -- blocks per unit of capacity (lane.footprint), among those with a free slot within the
  -- bound: the servers' caches fill evenly, as sglang-router's smallest tree does; ties
  -- go to the lowest in_flight/capacity, then to the one its first block hashes highest
  -- with (rendezvous hashing), so that every replica picks the same home.
  local pids, cands = {}, {}
  for pid, cand in pairs(eligible) do
    pids[#pids + 1], cands[#cands + 1] = pid, cand
  end
  local held_by = #pids > 0 and redis.call('HMGET', KEYS[BASE + lane.footprint], unpack(pids)) or {}
  local home, hs, hf, top
  for i, cand in ipairs(cands) do
    local s = provider_state(ctx, KEYS[BASE + cand.provider_key])
    if s.inf < s.cap and bounded(s) then
      local f = math.max(tonumber(held_by[i]) or 0, 0)
      local score = redis.sha1hex(rec.blocks[1] .. '|' .. cand.provider)
      local better = home == nil
      if not better then
        local fl, fr = f * hs.cap, hf * s.cap
        local l, r = s.inf * hs.cap, hs.inf * s.cap
        better = fl < fr or (fl == fr and (l < r or (l == r and score > top)))
      end
      if better then home, hs, hf, top = cand, s, f, score end
    end
  end
  return home or default, 'miss', held
end
