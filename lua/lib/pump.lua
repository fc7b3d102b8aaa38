-- The dispatch step, shared by every script that may hand out slots (included after
-- lib/jobs.lua by scripts.py, never run alone). In four parts: the plan and its lanes,
-- providers, the ordering of lane heads (FIFO or fair), dispatch; then the pump, a short
-- loop over them, and what a release or a dead provider sets off (parking, refusals).
--
-- A script that includes this file takes, besides KEYS[1..4] of lib/jobs.lua:
--   KEYS[5]   fence counter  one INCR per dispatch (floored at 10 x server ms): the fencing token
--   ARGV[1]   the plan's id (dispatcher/plans.py: a digest of its content)
--   ARGV[2]   offset of the plan's keys in KEYS: KEYS[offset + 1] the plan hash, + 2 the set
--             of its lane queue keys, + 3 the index of lanes that may hold jobs; then the
--             keys its lanes name by position (queues, providers, nodes, flow control's)
--   ARGV[3]   lease ms given to a fresh dispatch
--
-- The plan lives in Redis, written once by whichever process first needs it
-- (lua/plan.lua), so a call sends its id, not its lanes: a provider in 240 lanes would
-- otherwise send and decode them all on every finish. Its hash holds field '' -> the
-- header (dispatcher/wire.py PlanHeader) and <queue key> -> that lane (wire.LaneSpec).
-- A call whose plan is missing (a new Redis, a failover that lost it, its TTL) changes
-- nothing and fails 'NOPLAN': the caller writes the plan and calls again.
--
-- Flow control is start-time fair queuing per band: a job's score is its tag,
-- max(V, F[tenant]), and F[tenant] moves on by 1/weight; V is the tag of the band's last
-- dispatch, one clock for every lane of the band, so heads of different lanes (models,
-- endpoints) compare by their tags and weights hold across them. Backlogged tenants get
-- slots in proportion to their weights, a tenant's own jobs stay FIFO, and a newcomer's tag
-- is V: it waits behind at most one round, not behind a flood. Without flow control the
-- score is the global submit sequence (plain FIFO).

-- ---- The plan and its lanes ------------------------------------------------------------

local PLAN_ID, BASE, LEASE_MS = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local FENCE = KEYS[5]
local PLAN_KEY, PLAN_LANES, WAITING = KEYS[BASE + 1], KEYS[BASE + 2], KEYS[BASE + 3]
local PLAN_RAW = redis.call('HGET', PLAN_KEY, '')
if not PLAN_RAW then
  return redis.error_reply('NOPLAN plan ' .. PLAN_ID .. ' is not in Redis')
end
local PLAN = cjson.decode(PLAN_RAW)
-- Flow control's keys (nil without it: no tenant is looked at).
local FAIR = nil
if PLAN.fair then
  FAIR = {lim = KEYS[BASE + PLAN.limits], v = KEYS[BASE + PLAN.vtime], f = KEYS[BASE + PLAN.ftags],
          park = PLAN.park}
  counts_in(KEYS[BASE + PLAN.tenants])
end
-- Jobs one call parks at most (the rest at the next call): bounds a call's length when a
-- capped tenant's flood reaches the head of a lane.
local PARK_BUDGET = 256
-- Jobs of a lane one call passes over because only busy providers may run them.
local BLOCKED_SKIPS = 16
-- Waiting jobs one call drops because their deadline passed (their APIs collect them).
local EXPIRE_BUDGET = 64
-- Providers a block of the prefix index remembers (its home first, then second homes in the
-- order they were made): a hot head that spilled
-- keeps its second and third homes.
local HOLDERS = 4

-- A number as Redis should store it: every digit a double has.
local function num(x)
  return string.format('%.17g', x)
end

-- The queue key of a lane.
local function queue_of(lane)
  return KEYS[BASE + lane.queue]
end

-- The plan's lane queued at `qkey` (nil if it has none), read once per call.
local lane_cache = {}
local function lane_at(qkey)
  if PLAN.only then
    if queue_of(PLAN.only) == qkey then return PLAN.only end
    return nil
  end
  local lane = lane_cache[qkey]
  if lane == nil then
    local raw = redis.call('HGET', PLAN_KEY, qkey)
    lane = raw and cjson.decode(raw) or false
    lane_cache[qkey] = lane
  end
  return lane or nil
end

-- The plan's lanes that may hold jobs. The index WAITING has every lane a job was put in
-- (enqueue) until a pump finds it empty, so lanes with nothing waiting cost nothing: a
-- finish with every queue empty makes one SINTER, however many lanes its provider is in.
-- A plan of one lane reads its queue instead (as cheap as the index).
local function lanes_with_jobs()
  if PLAN.only then return {PLAN.only} end
  local queues = redis.call('SINTER', PLAN_LANES, WAITING)
  local lanes = {}
  for i = 1, #queues, 500 do
    local specs = redis.call('HMGET', PLAN_KEY, unpack(queues, i, math.min(i + 499, #queues)))
    for j, raw in ipairs(specs) do
      if raw then
        local lane = cjson.decode(raw)
        lane_cache[queues[i + j - 1]] = lane
        lanes[#lanes + 1] = lane
      end
    end
  end
  return lanes
end

-- Put a job in a lane's queue with its score (its place: submit sequence or fair tag).
local function enqueue(qkey, score, job)
  redis.call('ZADD', qkey, score, job)
  redis.call('SADD', WAITING, qkey)
end

-- A lane found empty leaves the index (it comes back with its next job: enqueue).
-- How long a place in queue `qkey` takes: the mean interval between dispatches from it
-- while it had a backlog (nil: not measured yet). Kept by note_drain, read by submit's
-- deadline check. The field is '<block start ms>|<dispatches since>|<interval ms>'.
local DRAIN_BLOCK = 8
local function drain_state(qkey)
  local raw = redis.call('HGET', KEYS[BASE + PLAN.rates], qkey) or ''
  local t0, n, interval = string.match(raw, '^(%d*)|(%d*)|([%d%.]*)$')
  return tonumber(t0), tonumber(n) or 0, tonumber(interval)
end

local function drain_interval(qkey)
  local _, _, interval = drain_state(qkey)
  return interval
end

-- A job that waited left `qkey` at `now`. Dispatches come in bursts (a server's step ends
-- several requests at once), so the interval is measured over blocks of DRAIN_BLOCK
-- dispatches made while the queue had a backlog all along: each block's mean interval
-- moves the estimate halfway. A queue that empties ends the block unmeasured.
local function note_drain(qkey, now)
  local t0, n, interval = drain_state(qkey)
  if t0 == nil then
    t0, n = now, 0
  else
    n = n + 1
    if n >= DRAIN_BLOCK then
      local sample = (now - t0) / n
      interval = interval and (interval + sample) / 2 or sample
      t0, n = now, 0
    end
  end
  if redis.call('ZCARD', qkey) == 0 then t0, n = nil, 0 end
  redis.call('HSET', KEYS[BASE + PLAN.rates], qkey,
             (t0 or '') .. '|' .. n .. '|' .. (interval and string.format('%.1f', interval) or ''))
end

local function emptied(qkey)
  if not PLAN.only then redis.call('SREM', WAITING, qkey) end
end

-- ---- Providers -------------------------------------------------------------------------

-- The one health predicate: can provider hash `v` (health, hb_exp, capacity, drain) take
-- work now -- healthy, heard from, a capacity, not drained by an operator (lua/drain.lua)?
-- dispatcher/catalog.py classify says the same in Python.
local function takes_work(v, now)
  return v[1] == 'available' and (tonumber(v[2]) or 0) >= now and (tonumber(v[3]) or 0) > 0
    and (v[4] or '') == ''
end

local function provider_ok(pkey, now)
  return takes_work(redis.call('HMGET', pkey, 'health', 'hb_exp', 'capacity', 'drain'), now)
end

-- Why a provider cannot take work now, in words ('' when it can; nil when it cannot but may
-- be about to: see below): the reasons of dispatcher/catalog.py's classify, and the drain
-- mark. A provider whose worker is silent (never heard of, or a heartbeat past its TTL)
-- counts as down only when `silent_is_down`: a reaper round says so, which knows whether
-- Redis itself was away (no heartbeat could land then); a submit or a heartbeat does not.
local function unavailable_reason(pkey, now, silent_is_down)
  local v = redis.call('HMGET', pkey, 'health', 'hb_exp', 'capacity', 'drain', 'hb_ms', 'reason', 'removed')
  -- A reload removed it: processes not yet reloaded may still name it as a lane's only
  -- provider, while in the new config other providers serve that key (or reaper rounds
  -- move its jobs there). Not a reason to refuse.
  if (v[7] or '') ~= '' then return nil end
  if not v[5] then
    return silent_is_down and 'never seen: no heartbeat from its worker yet' or nil
  end
  if (tonumber(v[2]) or 0) < now then
    if not silent_is_down then return nil end
    return string.format('stale heartbeat: last one %.1fs ago', (now - (tonumber(v[5]) or 0)) / 1000)
  end
  if v[1] ~= 'available' then return (v[6] and v[6] ~= '') and v[6] or 'reported unavailable' end
  if (v[4] or '') ~= '' then return 'drained by an operator' end
  if (tonumber(v[3]) or 0) <= 0 then return 'capacity 0' end
  return ''
end

-- nil when some provider of `lane` can take work (or may be about to: unavailable_reason);
-- otherwise each one's reason, in words.
local function unavailable_lane(lane, now, silent_is_down)
  local why = {}
  for _, cand in ipairs(lane.candidates) do
    local r = unavailable_reason(KEYS[BASE + cand.provider_key], now, silent_is_down)
    if r == nil or r == '' then return nil end
    why[#why + 1] = cand.provider .. ': ' .. r
  end
  if #why == 0 then return 'none of its providers is in the config' end
  return table.concat(why, '; ')
end

-- May candidate `cand` run the job of record `rec`: does it serve the job's endpoint, and is
-- it the provider the job is pinned to, if any? Checked at dispatch whatever the lane: after
-- a reload a lane's key may stand for other providers than when the job was queued.
local function serves(cand, rec)
  if rec.pin ~= nil and rec.pin ~= cand.provider then return false end
  return string.find(cand.endpoints, ',' .. rec.endpoint .. ',', 1, true) ~= nil
end

-- Is provider `pid` one the job must not go to again (it failed the job before)?
local function excluded(rec, pid)
  if rec == nil or rec.excluded == nil then return false end
  for _, p in ipairs(rec.excluded) do
    if p == pid then return true end
  end
  return false
end

-- Could a provider of the lane queued at `qkey` other than those `rec` excludes take the
-- job (is one healthy)? Busy is fine: the job waits for it.
local function other_candidate(qkey, rec, now)
  local lane = lane_at(qkey)
  if lane == nil then return false end
  for _, cand in ipairs(lane.candidates) do
    if not excluded(rec, cand.provider) and serves(cand, rec) and provider_ok(KEYS[BASE + cand.provider_key], now) then
      return true
    end
  end
  return false
end

-- ---- Tenants: counters, limits, parking ------------------------------------------------

-- The tenant of a flow-controlled job id ('<tenant>~<id>').
local function tenant_of(job)
  return string.match(job, '^(.-)~') or 'default'
end

-- Parking (flow control): lib/parking.lua.
local function park_job(qkey, job, tag)
  park(FAIR.park, qkey, job, num(tag))
end

local function unpark(t)
  return unpark_tenant(FAIR.park, t, WAITING)
end

-- A job of record `rec` gave its slot back: if that takes its tenant under its
-- max_in_flight, its parked jobs come back (before the pump that follows). Returns the
-- queue keys they went back to: the caller has those of them its plan lacks pumped
-- (lua/wake.lua), since the provider that freed may not serve them.
local function released(rec)
  if FAIR == nil or not PLAN.capped or rec.tenant == nil then return {} end
  local lim = tonumber(redis.call('HGET', FAIR.lim, rec.tenant) or '')
  if lim == nil then return {} end
  local run = tonumber(redis.call('HGET', TENANTS, 'r:' .. rec.tenant) or '0') or 0
  if run < lim then return unpark(rec.tenant) end
  return {}
end

-- A dispatched job lost its worker (lease ran out, or the worker shut down mid-job); its
-- slot is already released. If none of its output reached the client and attempts are
-- left, it goes back to its original place in its queue, with a fresh deadline, and its
-- API is told at once (`requeued_event`) so it re-arms its queue timer: the caller then
-- pumps. Otherwise its client gets `event` (unless the client had left).
-- Returns 'requeued' | 'failed' | 'dropped'.
local function settle_lost(job, rec, queue_key, reply_key, rj_key, max_attempts, event, requeued_event,
                           reply_ttl_ms, now)
  if rec.state == 'c' then
    drop_job(job, rj_key)
    return 'dropped'
  end
  if rec.output_started ~= 1 and rec.attempt < max_attempts then
    rec.state, rec.attempt, rec.deadline_ms, rec.output_started = 'q', rec.attempt + 1, now + rec.timeout_ms, 0
    rec.provider, rec.node, rec.target, rec.entry_id, rec.fence = nil, nil, nil, nil, nil
    -- Where it waits now: its caller may have chosen another lane than the one it was
    -- submitted to (a reload took that key away), and cancel.lua removes it from this one.
    rec.queue = queue_key
    put_record(job, rec)
    -- Its score (the seq, or its fair-queuing tag) keeps it ahead of everything after it.
    enqueue(queue_key, num(rec.tag or rec.seq), job)
    count(rec, 'q', 1)
    redis.call('ZADD', DEADLINES, rec.deadline_ms, job)
    redis.call('XADD', reply_key, '*', 'job', job, 'event', requeued_event)
    redis.call('PEXPIRE', reply_key, reply_ttl_ms)
    return 'requeued'
  end
  redis.call('XADD', reply_key, '*', 'job', job, 'event', event)
  redis.call('PEXPIRE', reply_key, reply_ttl_ms)
  drop_job(job, rj_key)
  return 'failed'
end

-- ---- Refusals: lanes left with no provider ---------------------------------------------

-- Answer at once, 503, the jobs waiting in `lane` when none of its providers can take
-- work (down, drained, unheard-of), rather than at their queue deadline: a caller learns
-- that the server is down in one round trip. A lane that holds jobs through a provider
-- restart (lane.hold_ms, the model's hold_when_unavailable_ms) refuses a job only that long
-- after it was first seen with no provider (rec.hold_until_ms). `refusal` (dispatcher/wire.py
-- Refusal): reply and replica_jobs key prefixes (the job's replica completes them: every
-- key shares the {iop} slot), ttl_ms of a reply stream, limit of jobs refused per call,
-- silent_is_down (see unavailable_reason). Returns the number refused.
local function refuse_unavailable(lane, now, refusal)
  local qkey = queue_of(lane)
  if redis.call('ZCARD', qkey) == 0 then
    emptied(qkey)
    return 0
  end
  local why = unavailable_lane(lane, now, refusal.silent_is_down)
  if why == nil then return 0 end
  local refused = 0
  for _, job in ipairs(redis.call('ZRANGE', qkey, 0, refusal.limit - 1)) do
    local rec = get_record(job)
    if rec == nil then
      redis.call('ZREM', qkey, job)
    elseif rec.hold_until_ms == nil and lane.hold_ms > 0 then
      -- Its hold starts when it is first seen with no provider.
      rec.hold_until_ms = now + lane.hold_ms
      put_record(job, rec)
    elseif (rec.hold_until_ms or 0) <= now then
      redis.call('ZREM', qkey, job)
      count(rec, 'q', -1)
      local event
      if rec.pin then
        event = cmsgpack.pack({'failed', 503, 'response_provider_unavailable',
          'The provider holding this response is unavailable (' .. why .. '); retry later'})
      else
        event = cmsgpack.pack({'failed', 503, 'no_provider_available',
          "No provider of '" .. rec.model .. "' is available (" .. why .. '); retry later'})
      end
      local reply = refusal.reply .. rec.replica
      redis.call('XADD', reply, '*', 'job', job, 'event', event)
      redis.call('PEXPIRE', reply, refusal.ttl_ms)
      drop_job(job, refusal.replica_jobs .. rec.replica)
      refused = refused + 1
    end
  end
  return refused
end

-- refuse_unavailable over every lane of the plan that holds jobs.
local function refuse_plan(now, refusal)
  local refused = 0
  for _, lane in ipairs(lanes_with_jobs()) do refused = refused + refuse_unavailable(lane, now, refusal) end
  return refused
end

-- ---- The pump --------------------------------------------------------------------------

-- Hand out free slots to waiting jobs: the first head across the plan's lanes in the
-- ordering (band, then fair tag; or submit order), each to the candidate with the lowest
-- in_flight/capacity. Each lane's head is read once per call, and again only after the
-- lane gave one up. Returns the number dispatched.
local function pump(now)
  local lanes = lanes_with_jobs()
  if #lanes == 0 then return 0 end

  -- Providers: their state, read once per call and kept up to date by dispatch.
  local pstate = {}
  local function state(pkey)
    local s = pstate[pkey]
    if s == nil then
      local v = redis.call('HMGET', pkey, 'health', 'hb_exp', 'capacity', 'drain', 'in_flight')
      s = {ok = takes_work(v, now), cap = tonumber(v[3]) or 0, inf = tonumber(v[5]) or 0}
      pstate[pkey] = s
    end
    return s
  end

  -- The lane's candidate with the lowest in_flight/capacity, compared exactly as
  -- a*d < c*b; ties: lower in_flight, then provider id. `rec`: the job's record, when
  -- known: only candidates that may run it (serves, excluded).
  local function pick(lane, rec)
    local best, bs
    for _, cand in ipairs(lane.candidates) do
      local s = state(KEYS[BASE + cand.provider_key])
      if s.ok and s.inf < s.cap and (rec == nil or (serves(cand, rec) and not excluded(rec, cand.provider))) then
        if best == nil then
          best, bs = cand, s
        else
          local l, r = s.inf * bs.cap, bs.inf * s.cap
          if l < r or (l == r and (s.inf < bs.inf or (s.inf == bs.inf and cand.provider < best.provider))) then
            best, bs = cand, s
          end
        end
      end
    end
    return best
  end

  -- Lane heads. A job whose deadline passed leaves its queue on the way (state 'x': it
  -- keeps its record and its deadline entry until its API collects it).
  local expire_budget = EXPIRE_BUDGET
  local function expire(qkey, job)
    if expire_budget == 0 then return false end
    expire_budget = expire_budget - 1
    redis.call('ZREM', qkey, job)
    local rec = get_record(job)
    if rec then
      count(rec, 'q', -1)
      rec.state = 'x'
      put_record(job, rec)
    end
    redis.call('HDEL', BODIES, job)
    return true
  end

  -- The lane's first waiting job past the `skip` ones this call found blocked, and its score.
  -- Its deadline is looked at only when it is the one to run (live): one read per lane.
  local function first(lane, skip)
    local h = redis.call('ZRANGE', queue_of(lane), skip, skip, 'WITHSCORES')
    if #h == 0 then
      if skip == 0 then emptied(queue_of(lane)) end
      return nil
    end
    return h[1], tonumber(h[2])
  end

  -- Is the head's deadline still ahead? One that passed leaves its queue (expire).
  local function live(h)
    local dl = tonumber(redis.call('ZSCORE', DEADLINES, h.job))
    if dl == nil or dl > now then return true end
    expire(queue_of(h.lane), h.job)
    return false
  end

  -- The ordering, chosen once: FIFO by submit sequence, or (flow control) band, then fair
  -- tag, then job id. `head(lane, skip)` is the lane's next job to run, `before(a, b)`
  -- compares two heads {lane, job, score}, `may_run(job)` says whether a head read
  -- earlier in the call may still run (its tenant not capped since), `dispatched(rec,
  -- lane)` moves the clocks and counters.
  local head, before, may_run, dispatched
  if FAIR == nil then
    head = first
    before = function(a, b) return a.score < b.score end
    may_run = function(job) return true end
    dispatched = function(rec, lane) end
  else
    -- Each tenant's running jobs and limit, and each band's clock, read once per call.
    local tstate, vtime = {}, {}
    local function tenant(t)
      local s = tstate[t]
      if s == nil then
        s = {lim = tonumber(redis.call('HGET', FAIR.lim, t) or ''),
             run = tonumber(redis.call('HGET', TENANTS, 'r:' .. t) or '0') or 0}
        tstate[t] = s
      end
      return s
    end
    may_run = function(job)
      if not PLAN.capped then return true end  -- no tenant has a max_in_flight
      local t = tenant(tenant_of(job))
      return t.lim == nil or t.run < t.lim
    end
    -- A head whose tenant is at its max_in_flight is parked (park_job): the jobs behind it
    -- surface, however many of them are capped.
    local park_budget = PARK_BUDGET
    head = function(lane, skip)
      while true do
        local job, tag = first(lane, skip)
        if job == nil or may_run(job) then return job, tag end
        if park_budget == 0 then return nil end
        park_budget = park_budget - 1
        park_job(queue_of(lane), job, tag)
      end
    end
    before = function(a, b)
      if a.lane.band ~= b.lane.band then return a.lane.band < b.lane.band end
      if a.score ~= b.score then return a.score < b.score end
      return a.job < b.job
    end
    dispatched = function(rec, lane)
      count(rec, 'q', -1)
      count(rec, 'r', 1)
      if rec.tenant then tenant(rec.tenant).run = tenant(rec.tenant).run + 1 end
      local band = 'band:' .. lane.band
      if vtime[band] == nil then vtime[band] = tonumber(redis.call('HGET', FAIR.v, band) or '0') or 0 end
      if rec.tag and rec.tag > vtime[band] then
        vtime[band] = rec.tag
        redis.call('HSET', FAIR.v, band, num(rec.tag))
      end
    end
  end

  -- Cache-aware dispatch (a lane whose model has affinity, a job with blocks: the chained
  -- hashes of its prompt's blocks, or the one of its conversation). The lane's index
  -- (lane.index) maps a block to the providers that served a prompt with that head, its
  -- home first, then second homes in the order they were made. The job goes to the first
  -- holder of the longest head that may run it, has a free slot and is within the load
  -- bound: its load ratio with this job at most lane.load_bound x the lane's mean, (inf + 1)
  -- / cap <= bound x (sum inf + 1) / (sum cap), or at most lane.load_floor. A holder within
  -- the bound but busy is waited for while `patient` (the job has not waited
  -- lane.max_wait_ms for it): 'spill' with busy = true, and the caller holds the job. A head
  -- whose holders are all over the bound spills to a shorter head's, then to `default` (the
  -- S04 choice). A provider that cannot take work (down, drained, removed: state) holds
  -- nothing. Returns the candidate, 'hit' | 'miss' | 'spill', the index's entries of the
  -- job's blocks (remember writes them back) and busy.
  local function affine(lane, rec, default, patient)
    local held = redis.call('HMGET', KEYS[BASE + lane.index], unpack(rec.blocks))
    local eligible, total_inf, total_cap = {}, 0, 0
    for _, cand in ipairs(lane.candidates) do
      local s = state(KEYS[BASE + cand.provider_key])
      if s.ok and serves(cand, rec) and not excluded(rec, cand.provider) then
        eligible[cand.provider] = cand
        total_inf, total_cap = total_inf + s.inf, total_cap + s.cap
      end
    end
    -- Within the bound: at most ceil(bound x (sum inf + 1) x cap / sum cap) jobs with this
    -- one (the ceiling lets a lightly loaded lane place at all: consistent hashing with
    -- bounded loads, capacity-weighted).
    local function bounded(s)
      return s.inf + 1 <= math.max(math.ceil(lane.load_bound * (total_inf + 1) * s.cap / total_cap - 1e-9),
                                   math.floor(lane.load_floor * s.cap + 1e-9))
    end
    local spilled, busy = false, false
    for i = #rec.blocks, 1, -1 do
      if held[i] then
        for pid in string.gmatch(held[i], '[^,]+') do
          local cand = eligible[pid]
          if cand then
            local s = state(KEYS[BASE + cand.provider_key])
            if bounded(s) then
              if s.inf < s.cap then return cand, 'hit', held end
              -- Busy but within the bound: worth waiting for, rather than a second home.
              if patient then return default, 'spill', held, true end
              busy = true
            end
            spilled = true
          end
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
      local s = state(KEYS[BASE + cand.provider_key])
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

  -- Provider `pid` now holds the job's blocks: added last to each block's holders if it was
  -- not one (at most HOLDERS kept: a new one takes the last place), each block's last use
  -- now, the providers' footprints moved by as much; then the index kept within its bounds
  -- (at most lane.index_max blocks, none unused for lane.index_ttl_ms), oldest first.
  local function remember(lane, rec, pid, held)
    local index, recency, footprint = KEYS[BASE + lane.index], KEYS[BASE + lane.recency], KEYS[BASE + lane.footprint]
    local entries, uses, delta = {}, {}, {}
    for i, block in ipairs(rec.blocks) do
      local list, n, found = nil, 0, false
      for other in string.gmatch(held[i] or '', '[^,]+') do
        if other == pid then found = true end
        if n < HOLDERS - 1 or (n < HOLDERS and found) then
          list, n = list and (list .. ',' .. other) or other, n + 1
        else
          delta[other] = (delta[other] or 0) - 1
        end
      end
      if not found then
        list = list and (list .. ',' .. pid) or pid
        delta[pid] = (delta[pid] or 0) + 1
      end
      entries[#entries + 1], entries[#entries + 2] = block, list
      uses[#uses + 1], uses[#uses + 2] = now, block
    end
    redis.call('HSET', index, unpack(entries))
    redis.call('ZADD', recency, unpack(uses))
    local gone = redis.call('ZRANGEBYSCORE', recency, '-inf', now - lane.index_ttl_ms, 'LIMIT', 0, 256)
    local excess = redis.call('ZCARD', recency) - #gone - lane.index_max
    if excess > 0 then
      for _, block in ipairs(redis.call('ZRANGE', recency, #gone, #gone + math.min(excess, 256) - 1)) do
        gone[#gone + 1] = block
      end
    end
    if #gone > 0 then
      for _, list in ipairs(redis.call('HMGET', index, unpack(gone))) do
        for other in string.gmatch(list or '', '[^,]+') do delta[other] = (delta[other] or 0) - 1 end
      end
      redis.call('HDEL', index, unpack(gone))
      redis.call('ZREM', recency, unpack(gone))
    end
    for other, d in pairs(delta) do
      if d ~= 0 then redis.call('HINCRBY', footprint, other, d) end
    end
  end

  -- Under saturation (affinity): the head job `head_job` may not run on its home (busy, or
  -- over the bound) and `cand` is free. Rather than run it there uncached, `cand` goes to
  -- the first of the next lane.look_ahead jobs whose home `cand` is (the first holder of
  -- the deepest of its blocks the index holds) or that has none, if one may run now; the
  -- head keeps its place. The caller passes a head over so for at most lane.max_wait_ms (rec.passed_ms).
  local function look_ahead(lane, head_job, cand)
    if lane.look_ahead == 0 then return nil end
    local index = KEYS[BASE + lane.index]
    local rank = redis.call('ZRANK', queue_of(lane), head_job)
    if rank == false then return nil end
    -- FIFO within a tenant (flow control) holds: a job never runs before an earlier one of
    -- its tenant (the head, or one this call found blocked ahead of it).
    local passed = {}
    for i, job in ipairs(redis.call('ZRANGE', queue_of(lane), 0, rank + lane.look_ahead)) do
      local t = FAIR ~= nil and tenant_of(job)
      local r = i > rank + 1 and not (t and passed[t]) and may_run(job) and get_record(job)
      if t then passed[t] = true end
      local dl = r and tonumber(redis.call('ZSCORE', DEADLINES, job))
      if r and serves(cand, r) and not excluded(r, cand.provider) and (dl == nil or dl > now) then
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

  -- Dispatch: give job `job` of `lane` to `cand` (or, when the job may not go there, to the
  -- best candidate that may take it). Returns 'ok', 'gone' (no record), or 'blocked' (the
  -- only free candidates are ones it may not use: it waits for another to free up).
  local dispatch
  dispatch = function(job, lane, cand, looked)
    local qkey = queue_of(lane)
    local rec = get_record(job)
    if rec == nil then
      redis.call('ZREM', qkey, job)
      redis.call('ZREM', DEADLINES, job)
      return 'gone'
    end
    if not serves(cand, rec) or excluded(rec, cand.provider) then
      cand = pick(lane, rec)
      if cand == nil and rec.excluded ~= nil and not other_candidate(qkey, rec, now) then
        -- Every provider it may still try is down: the ones that failed it are its only
        -- chance left, rather than a head that waits for nobody.
        rec.excluded = nil
        cand = pick(lane, rec)
      end
      if cand == nil then return 'blocked' end
    end
    local decision, held
    if lane.load_bound > 0 and rec.blocks then
      local chosen, busy
      local patient = not looked and lane.max_wait_ms > 0 and (rec.passed_ms == nil or now - rec.passed_ms < lane.max_wait_ms)
      chosen, decision, held, busy = affine(lane, rec, cand, patient)
      if decision == 'spill' and patient then
        local other = look_ahead(lane, job, cand)
        if other ~= nil or busy then
          if rec.passed_ms == nil then
            rec.passed_ms = now
            put_record(job, rec)
          end
          if other ~= nil then return dispatch(other, lane, cand, true) end
          return 'held'
        end
      end
      cand = chosen
      remember(lane, rec, cand.provider, held)
      redis.call('HINCRBY', KEYS[BASE + PLAN.affinity_stats], lane.model .. '\t' .. decision, 1)
    end
    local pkey, nkey = KEYS[BASE + cand.provider_key], KEYS[BASE + cand.node_key]
    redis.call('ZREM', qkey, job)
    -- Never below ten per millisecond of server time: a failover that loses the last
    -- writes rolls the counter back, and a fence handed out again would let a run the new
    -- primary forgot pass for the one it dispatches now. (14 digits: exact in cjson.)
    local fence = redis.call('INCR', FENCE)
    if fence < now * 10 then
      fence = now * 10
      redis.call('SET', FENCE, fence)
    end
    redis.call('ZREM', DEADLINES, job)
    if rec.submitted_ms < now then note_drain(qkey, now) end
    dispatched(rec, lane)
    redis.call('HINCRBY', pkey, 'in_flight', 1)
    state(pkey).inf = state(pkey).inf + 1
    redis.call('ZADD', LEASES, now + LEASE_MS, job)
    local body = redis.call('HGET', BODIES, job) or ''
    -- The node stream entry (dispatcher/events.py Assignment, by the same names).
    local entry = redis.call('XADD', nkey, '*',
      'job', job, 'fence', fence, 'provider', cand.provider, 'target', cand.served, 'model', lane.model,
      'lane', lane.name, 'replica', rec.replica, 'endpoint', rec.endpoint, 'stream', rec.stream,
      'attempt', rec.attempt, 'submitted_ms', rec.submitted_ms, 'dispatched_ms', now, 'body', body)
    rec.state, rec.provider, rec.node, rec.target, rec.fence = 'd', cand.provider, cand.node, cand.served, fence
    rec.entry_id, rec.dispatched_ms, rec.output_started = entry, now, 0
    put_record(job, rec)
    return 'ok'
  end

  -- heads[i]: lane i's head {lane, job, score, skip}; nil: to be read; false: nothing more
  -- this call (empty, or no free provider may take its jobs).
  local heads, skips = {}, {}
  local count_dispatched = 0
  -- A head held for its busy home (affinity) keeps the slot from lanes of later bands.
  local held_band
  while true do
    local best, best_cand
    for i, lane in ipairs(lanes) do
      local h = heads[i]
      if held_band ~= nil and lane.band > held_band then h = false end
      if h and not may_run(h.job) then h = nil end  -- its tenant reached its cap meanwhile
      if h == nil then
        local job, score = head(lane, skips[i] or 0)
        h = job and {lane = lane, job = job, score = score, i = i} or false
        heads[i] = h
      end
      if h then
        local cand = pick(lane, nil)
        if cand == nil then
          heads[i] = false  -- a dispatch only fills providers: none frees up this call
        elseif best == nil or before(h, best) then
          best, best_cand = h, cand
        end
      end
    end
    if best == nil then break end
    local outcome = 'expired'
    if live(best) then
      outcome = dispatch(best.job, best.lane, best_cand)
    elseif expire_budget == 0 then
      break  -- the rest of the expired heads at the next call
    end
    heads[best.i] = nil
    if outcome == 'ok' then
      count_dispatched = count_dispatched + 1
    elseif outcome == 'held' then
      heads[best.i] = false
      held_band = math.min(held_band or best.lane.band, best.lane.band)
    elseif outcome == 'blocked' then
      -- Only busy or failed providers may run it: it keeps its place, and the jobs behind
      -- it go on (a few per lane and call, which bounds the call's cost).
      skips[best.i] = (skips[best.i] or 0) + 1
      if skips[best.i] > BLOCKED_SKIPS then heads[best.i] = false end
    end
  end
  return count_dispatched
end
