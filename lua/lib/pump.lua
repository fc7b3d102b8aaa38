-- The dispatch step, shared by every script that may hand out slots (included after
-- lib/jobs.lua by scripts.py, never run alone).
--
-- A script that includes this file takes, besides KEYS[1..4] of lib/jobs.lua:
--   KEYS[5] fence counter  one INCR per dispatch (floored at 10 x server ms): the fencing token
--   ARGV[1] plan: JSON list of lanes {"m": model, "l": lane, "q": qkey, "c": [[provider, served, pkey, nkey, node,
--           endpoints], ...], "h": hold_when_unavailable_ms of the model}, endpoints: ',a,b,' the ones it serves
--           where qkey/pkey/nkey are key positions relative to ARGV[2]; or, with flow control
--           (tenants, bands), {"g": [lane, ...], "t": tkey, "lim": lkey, "v": vkey, "f": fkey, "cap": bool}
--           where each lane also has "b", its band's rank (0 first), and
--             tkey  tenants hash: q:<tenant>[:<model>] waiting, r:<tenant>[:<model>] running
--             lkey  tenant limits hash: <tenant> -> max_in_flight
--             vkey  virtual time hash: 'band:<rank>' -> the tag of the band's last dispatch
--             fkey  finish tag hash: tenant -> where its next job's tag starts
--             cap   some tenant has a max_in_flight (else no job's tenant is looked at)
--             pk    the prefix of a tenant's parked-jobs key (park_job)
--   ARGV[2] offset of the plan's keys in KEYS
--   ARGV[3] lease ms given to a fresh dispatch
--
-- Flow control is start-time fair queuing per band: a job's score is its tag,
-- max(V, F[tenant]), and F[tenant] moves on by 1/weight; V is the tag of the band's last
-- dispatch, one clock for every lane of the band, so heads of different lanes (models,
-- endpoints) compare by their tags and weights hold across them. Backlogged tenants get
-- slots in proportion to their weights, a tenant's own jobs stay FIFO, and a newcomer's tag
-- is V: it waits behind at most one round, not behind a flood. Without flow control the
-- score is the global submit sequence (plain FIFO).

local FENCE = KEYS[5]
local PLAN = cjson.decode(ARGV[1])
local GROUPS = PLAN
local FAIR = nil
if PLAN.g ~= nil then
  local b = tonumber(ARGV[2])
  GROUPS = PLAN.g
  FAIR = {lim = KEYS[b + PLAN.lim], v = KEYS[b + PLAN.v], f = KEYS[b + PLAN.f], park = PLAN.pk}
  TENANTS = KEYS[b + PLAN.t]
end
-- Jobs one call parks at most (the rest at the next call): bounds a call's length when a
-- capped tenant's flood reaches the head of a lane.
local PARK_BUDGET = 256
-- Jobs of a lane one call passes over because only busy providers may run them.
local BLOCKED_SKIPS = 16

-- A number as Redis should store it: every digit a double has.
local function num(x)
  return string.format('%.17g', x)
end

-- The tenant of a flow-controlled job id ('<tenant>~<id>').
local function tenant_of(job)
  return string.match(job, '^(.-)~') or 'default'
end
-- Can this provider take work now (healthy, heard from, a capacity, not drained by an
-- operator: lua/drain.lua)?
local function provider_ok(pkey, now)
  local v = redis.call('HMGET', pkey, 'health', 'hb_exp', 'capacity', 'drain')
  return v[1] == 'available' and (tonumber(v[2]) or 0) >= now and (tonumber(v[3]) or 0) > 0
    and (v[4] or '') == ''
end

-- Parking (flow control): a tenant at its max_in_flight cannot run the jobs it has waiting,
-- so they leave their lane for the tenant's parked set of that lane (key FAIR.park ..
-- tenant .. '|' .. lane key, score their tag; the tenant's index FAIR.park .. tenant lists
-- the lanes it has parked jobs in; every key in the {iop} slot). Jobs behind them run: no
-- look-ahead limit leaves capacity idle. When the tenant's running jobs drop below its
-- limit (finish, reap_lease: unpark), the earliest parked job of each of those lanes goes
-- back with its tag, ahead of what came since, so whichever lane has a free provider runs
-- it; the others are parked again when they reach a head while it is capped. A parked job
-- keeps its record, deadline and counters; one cancelled or expired meanwhile is dropped
-- when it comes back.
local function park_job(qkey, job, tag)
  local t = tenant_of(job)
  redis.call('ZREM', qkey, job)
  redis.call('ZADD', FAIR.park .. t .. '|' .. qkey, string.format('%.17g', tag), job)
  redis.call('SADD', FAIR.park .. t, qkey)
end

-- Bring back the earliest parked job of each lane tenant `t` has parked jobs in (see
-- park_job); returns the queue keys they went back to.
local function unpark(t)
  local index = FAIR.park .. t
  local lanes = {}
  for _, qkey in ipairs(redis.call('SMEMBERS', index)) do
    local key = index .. '|' .. qkey
    while true do
      local h = redis.call('ZPOPMIN', key)
      if #h == 0 then
        redis.call('SREM', index, qkey)
        break
      end
      local rec = get_record(h[1])
      if rec and rec.st == 'q' then
        redis.call('ZADD', qkey, h[2], h[1])
        lanes[#lanes + 1] = qkey
        if redis.call('EXISTS', key) == 0 then redis.call('SREM', index, qkey) end
        break
      end
    end
  end
  return lanes
end

-- A job of record `rec` gave its slot back: if that takes its tenant under its
-- max_in_flight, its parked jobs come back (before the pump that follows). Returns the
-- queue keys they went back to: the caller has those of them its plan lacks pumped
-- (lua/wake.lua), since the provider that freed may not serve them.
local function released(rec)
  if FAIR == nil or not PLAN.cap or rec.tn == nil then return {} end
  local lim = tonumber(redis.call('HGET', FAIR.lim, rec.tn) or '')
  if lim == nil then return {} end
  local run = tonumber(redis.call('HGET', TENANTS, 'r:' .. rec.tn) or '0') or 0
  if run < lim then return unpark(rec.tn) end
  return {}
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

-- nil when some provider of lane `g` can take work (or may be about to: unavailable_reason);
-- otherwise each one's reason, in words.
local function unavailable_lane(g, now, silent_is_down)
  local base = tonumber(ARGV[2])
  local why = {}
  for _, c in ipairs(g.c) do
    local r = unavailable_reason(KEYS[base + c[3]], now, silent_is_down)
    if r == nil or r == '' then return nil end
    why[#why + 1] = c[1] .. ': ' .. r
  end
  if #why == 0 then return 'none of its providers is in the config' end
  return table.concat(why, '; ')
end

-- Answer at once, 503, the jobs waiting in lane `g` when none of its providers can take
-- work (down, drained, unheard-of), rather than at their queue deadline: a caller learns
-- that the server is down in one round trip. A lane that holds jobs through a provider
-- restart (g.h, the model's hold_when_unavailable_ms) refuses a job only g.h ms after it
-- was first seen with no provider (rec.hu). `refusal`: {reply, replica_jobs}
-- key prefixes (the job's replica completes them: every key shares the {iop} slot),
-- ttl_ms of a reply stream, limit of jobs refused per call, silent_is_down (see
-- unavailable_reason). Returns the number refused.
local function refuse_unavailable(g, now, refusal)
  local qkey = KEYS[tonumber(ARGV[2]) + g.q]
  if redis.call('ZCARD', qkey) == 0 then return 0 end
  local why = unavailable_lane(g, now, refusal.silent_is_down)
  if why == nil then return 0 end
  local refused = 0
  for _, job in ipairs(redis.call('ZRANGE', qkey, 0, refusal.limit - 1)) do
    local rec = get_record(job)
    if rec == nil then
      redis.call('ZREM', qkey, job)
    elseif rec.hu == nil and g.h > 0 then
      -- Its hold starts when it is first seen with no provider.
      rec.hu = now + g.h
      put_record(job, rec)
    elseif (rec.hu or 0) <= now then
      redis.call('ZREM', qkey, job)
      count(rec, 'q', -1)
      local event
      if rec.pin then
        event = cmsgpack.pack({'failed', 503, 'response_provider_unavailable',
          'The provider holding this response is unavailable (' .. why .. '); retry later'})
      else
        event = cmsgpack.pack({'failed', 503, 'no_provider_available',
          "No provider of '" .. rec.m .. "' is available (" .. why .. '); retry later'})
      end
      local reply = refusal.reply .. rec.rep
      redis.call('XADD', reply, '*', 'j', job, 'e', event)
      redis.call('PEXPIRE', reply, refusal.ttl_ms)
      drop_job(job, refusal.replica_jobs .. rec.rep)
      refused = refused + 1
    end
  end
  return refused
end

-- refuse_unavailable over every lane of the plan.
local function refuse_plan(now, refusal)
  local refused = 0
  for _, g in ipairs(GROUPS) do refused = refused + refuse_unavailable(g, now, refusal) end
  return refused
end

-- May candidate `c` run the job of record `rec`: does it serve the job's endpoint, and is it
-- the provider the job is pinned to, if any? Checked at dispatch whatever the lane: after a
-- reload a lane's key may stand for other providers than when the job was queued.
local function serves(c, rec)
  if rec.pin ~= nil and rec.pin ~= c[1] then return false end
  return c[6] == nil or string.find(c[6], ',' .. rec.ep .. ',', 1, true) ~= nil
end

-- Is provider `pid` one the job must not go to again (it failed the job before)?
local function excluded(rec, pid)
  if rec == nil or rec.x == nil then return false end
  for _, p in ipairs(rec.x) do
    if p == pid then return true end
  end
  return false
end

-- Could a provider of the lane queued at `qkey` other than those `rec` excludes take the
-- job (is one healthy)? Busy is fine: the job waits for it.
local function other_candidate(qkey, rec, now)
  local base = tonumber(ARGV[2])
  for _, g in ipairs(GROUPS) do
    if KEYS[base + g.q] == qkey then
      for _, c in ipairs(g.c) do
        if not excluded(rec, c[1]) and serves(c, rec) and provider_ok(KEYS[base + c[3]], now) then return true end
      end
    end
  end
  return false
end

-- Hand out free slots to waiting jobs: oldest head first across the plan's groups, each
-- to the candidate with the lowest in_flight/capacity. Returns the number dispatched.
local function pump(now)
  local groups = GROUPS
  local base = tonumber(ARGV[2])
  local lease_ms = tonumber(ARGV[3])
  local pstate = {}
  local expire_budget = 64

  local function state(pkey)
    local s = pstate[pkey]
    if s == nil then
      local v = redis.call('HMGET', pkey, 'health', 'hb_exp', 'capacity', 'in_flight', 'drain')
      local cap = tonumber(v[3]) or 0
      s = {
        ok = v[1] == 'available' and (tonumber(v[2]) or 0) >= now and cap > 0 and (v[5] or '') == '',
        cap = cap,
        inf = tonumber(v[4]) or 0,
      }
      pstate[pkey] = s
    end
    return s
  end

  -- Lowest in_flight/capacity, compared exactly as a*d < c*b; ties: lower in_flight, then provider id.
  -- `rec`: the job's record, when known: only candidates that may run it (serves, excluded).
  local function pick(g, rec)
    local best, bs
    for _, c in ipairs(g.c) do
      local s = state(KEYS[base + c[3]])
      if s.ok and s.inf < s.cap and (rec == nil or (serves(c, rec) and not excluded(rec, c[1]))) then
        if best == nil then
          best, bs = c, s
        else
          local l, r = s.inf * bs.cap, bs.inf * s.cap
          if l < r or (l == r and (s.inf < bs.inf or (s.inf == bs.inf and c[1] < best[1]))) then
            best, bs = c, s
          end
        end
      end
    end
    return best
  end

  -- The oldest waiting job of a group, dropping heads whose deadline passed. An expired job
  -- keeps its record (state 'x') and its deadline entry until its API collects it.
  -- Take a job whose deadline passed out of its queue (false once the call's budget is spent).
  local function expire(qkey, job)
    if expire_budget == 0 then return false end
    expire_budget = expire_budget - 1
    redis.call('ZREM', qkey, job)
    local rec = get_record(job)
    if rec then
      count(rec, 'q', -1)
      rec.st = 'x'
      put_record(job, rec)
    end
    redis.call('HDEL', BODIES, job)
    return true
  end

  -- The lane's first waiting job past the `g.skip` ones this call found blocked.
  local function head(g)
    local qkey = KEYS[base + g.q]
    local skip = g.skip or 0
    while true do
      local h = redis.call('ZRANGE', qkey, skip, skip, 'WITHSCORES')
      if #h == 0 then return nil end
      local dl = tonumber(redis.call('ZSCORE', DEADLINES, h[1]))
      if dl == nil or dl > now then return h[1], tonumber(h[2]) end
      if not expire(qkey, h[1]) then return nil end
    end
  end

  -- Returns 'ok', 'gone' (no record), or 'blocked' (the only free candidates are ones the
  -- job excludes: the lane waits for another to free up).
  -- Flow control: the tenant's running jobs and its limit, read once per call.
  local tstate = {}
  local function tenant(t)
    local s = tstate[t]
    if s == nil then
      s = {
        lim = tonumber(redis.call('HGET', FAIR.lim, t) or ''),
        run = tonumber(redis.call('HGET', TENANTS, 'r:' .. t) or '0') or 0,
      }
      tstate[t] = s
    end
    return s
  end
  local vtime = {}
  local function vt(g)
    local band = 'band:' .. g.b
    if vtime[band] == nil then vtime[band] = tonumber(redis.call('HGET', FAIR.v, band) or '0') or 0 end
    return vtime[band], band
  end

  local function may_run(job)
    if not PLAN.cap then return true end  -- no tenant has a max_in_flight
    local t = tenant(tenant_of(job))
    return t.lim == nil or t.run < t.lim
  end

  -- The first waiting job of a lane (by tag) whose tenant may run one more, dropping
  -- expired ones on the way. A head whose tenant is at its max_in_flight is parked
  -- (park_job): the jobs behind it surface, however many of them are capped.
  local park_budget = PARK_BUDGET
  local function fair_head(g)
    local qkey = KEYS[base + g.q]
    while true do
      local job, tag = head(g)
      if job == nil or may_run(job) then return job, tag end
      if park_budget == 0 then return nil end
      park_budget = park_budget - 1
      park_job(qkey, job, tag)
    end
  end

  local function dispatch(job, g, c)
    local qkey = KEYS[base + g.q]
    local rec = get_record(job)
    if rec == nil then
      redis.call('ZREM', qkey, job)
      redis.call('ZREM', DEADLINES, job)
      return 'gone'
    end
    if not serves(c, rec) or excluded(rec, c[1]) then
      c = pick(g, rec)
      if c == nil and rec.x ~= nil and not other_candidate(qkey, rec, now) then
        -- Every provider it may still try is down: the ones that failed it are its only
        -- chance left, rather than a head that waits for nobody.
        rec.x = nil
        c = pick(g, rec)
      end
      if c == nil then return 'blocked' end
    end
    local pkey, nkey = KEYS[base + c[3]], KEYS[base + c[4]]
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
    if FAIR ~= nil then
      count(rec, 'q', -1)
      count(rec, 'r', 1)
      if rec.tn then tenant(rec.tn).run = tenant(rec.tn).run + 1 end
      local v, band = vt(g)
      if rec.sc and rec.sc > v then
        vtime[band] = rec.sc
        redis.call('HSET', FAIR.v, band, num(rec.sc))
      end
    end
    redis.call('HINCRBY', pkey, 'in_flight', 1)
    state(pkey).inf = state(pkey).inf + 1
    redis.call('ZADD', LEASES, now + lease_ms, job)
    local body = redis.call('HGET', BODIES, job) or ''
    local entry = redis.call('XADD', nkey, '*',
      'j', job, 'f', fence, 'p', c[1], 't', c[2], 'm', g.m, 'l', g.l, 'rep', rec.rep, 'ep', rec.ep,
      's', rec.s, 'a', rec.a, 't0', rec.t0, 't1', now, 'b', body)
    rec.st, rec.p, rec.n, rec.t, rec.f, rec.ne, rec.t1, rec.o = 'd', c[1], c[5], c[2], fence, entry, now, 0
    put_record(job, rec)
    return 'ok'
  end

  local live = {}
  for i = 1, #groups do live[i] = true end
  local dispatched = 0
  -- Which of two lane heads goes first: the higher band, then the lower tag (one virtual
  -- clock per band: weights hold across lanes), then the job id. Without flow control:
  -- the lower submit sequence.
  local function before(g, job, score, bg, bjob, bscore)
    if FAIR == nil then return score < bscore end
    if g.b ~= bg.b then return g.b < bg.b end
    if score ~= bscore then return score < bscore end
    return job < bjob
  end

  while true do
    local bi, bg, bjob, bseq, bc
    for i, g in ipairs(groups) do
      if live[i] then
        local job, seq
        if FAIR ~= nil then job, seq = fair_head(g) else job, seq = head(g) end
        local c = job and pick(g, nil)
        if not c then
          live[i] = false
        elseif bseq == nil or before(g, job, seq, bg, bjob, bseq) then
          bi, bg, bjob, bseq, bc = i, g, job, seq, c
        end
      end
    end
    if bg == nil then break end
    local outcome = dispatch(bjob, bg, bc)
    if outcome == 'ok' then
      dispatched = dispatched + 1
    elseif outcome == 'blocked' then
      -- Only busy or failed providers may run it: it keeps its place, and the jobs behind
      -- it go on (a few per lane and call, which bounds the call's cost).
      bg.skip = (bg.skip or 0) + 1
      if bg.skip > BLOCKED_SKIPS then live[bi] = false end
    end
  end
  return dispatched
end
