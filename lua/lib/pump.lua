-- The dispatch step, shared by every script that may hand out slots (included after
-- lib/jobs.lua by scripts.py, never run alone).
--
-- A script that includes this file takes, besides KEYS[1..4] of lib/jobs.lua:
--   KEYS[5] fence counter  one INCR per dispatch (floored at 10 x server ms): the fencing token
--   ARGV[1] plan: JSON list of lanes {"m": model, "l": lane, "q": qkey, "c": [[provider, served, pkey, nkey, node], ...]}
--           where qkey/pkey/nkey are key positions relative to ARGV[2]; or, with flow control
--           (tenants, bands), {"g": [lane, ...], "t": tkey, "lim": lkey, "v": vkey, "f": fkey, "cap": bool}
--           where each lane also has "b", its band's rank (0 first), and
--             tkey  tenants hash: q:<tenant>[:<model>] waiting, r:<tenant>[:<model>] running
--             lkey  tenant limits hash: <tenant> -> max_in_flight
--             vkey  virtual time hash: lane queue key -> the tag of its last dispatch
--             fkey  finish tag hash: lane queue key \t tenant -> where its next job's tag starts
--             cap   some tenant has a max_in_flight (else no job's tenant is looked at)
--   ARGV[2] offset of the plan's keys in KEYS
--   ARGV[3] lease ms given to a fresh dispatch
--
-- Flow control is start-time fair queuing per lane queue: a job's score is its tag,
-- max(V, F[tenant]), and F[tenant] moves on by 1/weight; V is the tag of the lane's last
-- dispatch. Backlogged tenants get slots in proportion to their weights, a tenant's own
-- jobs stay FIFO, and a newcomer's tag is V: it waits behind at most one round, not behind
-- a flood. Without flow control the score is the global submit sequence (plain FIFO).

local FENCE = KEYS[5]
local PLAN = cjson.decode(ARGV[1])
local GROUPS = PLAN
local FAIR = nil
if PLAN.g ~= nil then
  local b = tonumber(ARGV[2])
  GROUPS = PLAN.g
  FAIR = {lim = KEYS[b + PLAN.lim], v = KEYS[b + PLAN.v], f = KEYS[b + PLAN.f]}
  TENANTS = KEYS[b + PLAN.t]
end
-- Waiting jobs of a lane looked at for one whose tenant is under its max_in_flight.
local SCAN = 64

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
        if not excluded(rec, c[1]) and provider_ok(KEYS[base + c[3]], now) then return true end
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
  -- `rec`: only when the job excludes providers (a retry after a provider failed it).
  local function pick(g, rec)
    local best, bs
    for _, c in ipairs(g.c) do
      local s = state(KEYS[base + c[3]])
      if s.ok and s.inf < s.cap and not excluded(rec, c[1]) then
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

  local function head(g)
    local qkey = KEYS[base + g.q]
    while true do
      local h = redis.call('ZRANGE', qkey, 0, 0, 'WITHSCORES')
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
  local function vt(qkey)
    if vtime[qkey] == nil then vtime[qkey] = tonumber(redis.call('HGET', FAIR.v, qkey) or '0') or 0 end
    return vtime[qkey]
  end

  local function may_run(job)
    if not PLAN.cap then return true end  -- no tenant has a max_in_flight
    local t = tenant(tenant_of(job))
    return t.lim == nil or t.run < t.lim
  end

  -- The first waiting job of a lane (by tag) whose tenant may run one more, dropping
  -- expired ones on the way. Only when the head's tenant is at its max_in_flight does it
  -- look further (the lane's first SCAN jobs).
  local function fair_head(g)
    local qkey = KEYS[base + g.q]
    local job, tag = head(g)
    if job == nil or may_run(job) then return job, tag end
    local h = redis.call('ZRANGE', qkey, 1, SCAN - 1, 'WITHSCORES')
    for i = 1, #h, 2 do
      local dl = tonumber(redis.call('ZSCORE', DEADLINES, h[i]))
      if dl ~= nil and dl <= now then
        expire(qkey, h[i])
      elseif may_run(h[i]) then
        return h[i], tonumber(h[i + 1])
      end
    end
    return nil
  end

  local function dispatch(job, g, c)
    local qkey = KEYS[base + g.q]
    local rec = get_record(job)
    if rec == nil then
      redis.call('ZREM', qkey, job)
      redis.call('ZREM', DEADLINES, job)
      return 'gone'
    end
    if rec.x ~= nil and excluded(rec, c[1]) then
      c = pick(g, rec)
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
      if rec.sc and rec.sc > vt(qkey) then
        vtime[qkey] = rec.sc
        redis.call('HSET', FAIR.v, qkey, num(rec.sc))
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
  -- Which of two lane heads goes first: the higher band, then the one least ahead of its
  -- lane's virtual time (weighted fairness across the lanes a provider serves), then the
  -- lower tag, then the job id. Without flow control: the lower submit sequence.
  local function before(g, job, score, bg, bjob, bscore)
    if FAIR == nil then return score < bscore end
    if g.b ~= bg.b then return g.b < bg.b end
    local lag, blag = score - vt(KEYS[base + g.q]), bscore - vt(KEYS[base + bg.q])
    if lag ~= blag then return lag < blag end
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
      live[bi] = false
    end
  end
  return dispatched
end
