-- The dispatch step, shared by every script that may hand out slots (included after
-- lib/jobs.lua by scripts.py, never run alone).
--
-- A script that includes this file takes, besides KEYS[1..4] of lib/jobs.lua:
--   KEYS[5] fence counter  one INCR per dispatch (floored at 10 x server ms): the fencing token
--   ARGV[1] plan: JSON list of groups {"m": model, "q": qkey, "c": [[provider, served, pkey, nkey, node], ...]}
--           where qkey/pkey/nkey are key positions relative to ARGV[2]
--   ARGV[2] offset of the plan's keys in KEYS
--   ARGV[3] lease ms given to a fresh dispatch

local FENCE = KEYS[5]

-- Hand out free slots to waiting jobs: oldest head first across the plan's groups, each
-- to the candidate with the lowest in_flight/capacity. Returns the number dispatched.
local function pump(now)
  local groups = cjson.decode(ARGV[1])
  local base = tonumber(ARGV[2])
  local lease_ms = tonumber(ARGV[3])
  local pstate = {}
  local expire_budget = 64

  local function state(pkey)
    local s = pstate[pkey]
    if s == nil then
      local v = redis.call('HMGET', pkey, 'health', 'hb_exp', 'capacity', 'in_flight')
      local cap = tonumber(v[3]) or 0
      s = {
        ok = v[1] == 'available' and (tonumber(v[2]) or 0) >= now and cap > 0,
        cap = cap,
        inf = tonumber(v[4]) or 0,
      }
      pstate[pkey] = s
    end
    return s
  end

  -- Lowest in_flight/capacity, compared exactly as a*d < c*b; ties: lower in_flight, then provider id.
  local function pick(g)
    local best, bs
    for _, c in ipairs(g.c) do
      local s = state(KEYS[base + c[3]])
      if s.ok and s.inf < s.cap then
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
  local function head(g)
    local qkey = KEYS[base + g.q]
    while true do
      local h = redis.call('ZRANGE', qkey, 0, 0, 'WITHSCORES')
      if #h == 0 then return nil end
      local dl = tonumber(redis.call('ZSCORE', DEADLINES, h[1]))
      if dl == nil or dl > now then return h[1], tonumber(h[2]) end
      if expire_budget == 0 then return nil end
      expire_budget = expire_budget - 1
      redis.call('ZREM', qkey, h[1])
      local rec = get_record(h[1])
      if rec then
        rec.st = 'x'
        put_record(h[1], rec)
      end
      redis.call('HDEL', BODIES, h[1])
    end
  end

  local function dispatch(job, g, c)
    local qkey, pkey, nkey = KEYS[base + g.q], KEYS[base + c[3]], KEYS[base + c[4]]
    redis.call('ZREM', qkey, job)
    local rec = get_record(job)
    if rec == nil then
      redis.call('ZREM', DEADLINES, job)
      return false
    end
    -- Never below ten per millisecond of server time: a failover that loses the last
    -- writes rolls the counter back, and a fence handed out again would let a run the new
    -- primary forgot pass for the one it dispatches now. (14 digits: exact in cjson.)
    local fence = redis.call('INCR', FENCE)
    if fence < now * 10 then
      fence = now * 10
      redis.call('SET', FENCE, fence)
    end
    redis.call('ZREM', DEADLINES, job)
    redis.call('HINCRBY', pkey, 'in_flight', 1)
    state(pkey).inf = state(pkey).inf + 1
    redis.call('ZADD', LEASES, now + lease_ms, job)
    local body = redis.call('HGET', BODIES, job) or ''
    local entry = redis.call('XADD', nkey, '*',
      'j', job, 'f', fence, 'p', c[1], 't', c[2], 'm', g.m, 'rep', rec.rep, 'ep', rec.ep,
      's', rec.s, 'a', rec.a, 't0', rec.t0, 't1', now, 'b', body)
    rec.st, rec.p, rec.n, rec.t, rec.f, rec.ne, rec.t1, rec.o = 'd', c[1], c[5], c[2], fence, entry, now, 0
    put_record(job, rec)
    return true
  end

  local live = {}
  for i = 1, #groups do live[i] = true end
  local dispatched = 0
  while true do
    local bg, bjob, bseq, bc
    for i, g in ipairs(groups) do
      if live[i] then
        local job, seq = head(g)
        local c = job and pick(g)
        if not c then
          live[i] = false
        elseif bseq == nil or seq < bseq then
          bg, bjob, bseq, bc = g, job, seq, c
        end
      end
    end
    if bg == nil then break end
    if dispatch(bjob, bg, bc) then dispatched = dispatched + 1 end
  end
  return dispatched
end
