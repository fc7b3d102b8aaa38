-- reconcile: make each provider's in_flight equal the number of live leases it holds (and,
-- where iop manages its models, each model's running count `mr:<served>`), drop
-- leases that no job record backs, and rebuild flow control's tenant counters from the job
-- records. A safety net run at worker start-up and now and then by the reaper: every script
-- keeps them in step, but an operator's manual edit, a restore from an old snapshot, or a
-- release by a process whose plans have no tenants hash (a reload took the provider, or flow
-- control, away) may not.
--
-- KEYS[1..4] jobs, bodies, leases, deadlines (see lib/jobs.lua)
-- KEYS[5]    the tenants hash: q:<tenant>[:<model>] waiting, r:<tenant>[:<model>] running
-- KEYS[6..]  provider hashes, in the order of ARGV
-- ARGV[1..]  provider ids
-- Returns {in_flight fixes, counter fixes}, each a flat list name, old, new of every
-- correction: a provider id, or a field of the tenants hash.
--!include lib/jobs.lua

counts_in(KEYS[5])

-- What the counters should say: a waiting job (state 'q') counts in q:, one that holds a
-- lease in r: -- exactly when lib/jobs.lua's count() moves them, for jobs that name a tenant.
local want = {}
local function expect(kind, rec)
  for _, field in ipairs({kind .. ':' .. rec.tenant, kind .. ':' .. rec.tenant .. ':' .. rec.model}) do
    want[field] = (want[field] or 0) + 1
  end
end

local held, running = {}, {}
for _, job in ipairs(redis.call('ZRANGE', LEASES, 0, -1)) do
  local rec = get_record(job)
  if rec == nil or rec.provider == nil then
    redis.call('ZREM', LEASES, job)
  else
    held[rec.provider] = (held[rec.provider] or 0) + 1
    if rec.managed and rec.target then
      local field = rec.provider .. '\tmr:' .. rec.target
      running[field] = (running[field] or 0) + 1
    end
    if rec.tenant ~= nil then expect('r', rec) end
  end
end
local jobs = redis.call('HGETALL', JOBS)
for i = 2, #jobs, 2 do
  -- Only waiting flow-controlled jobs' records are decoded: a quote inside a JSON string is
  -- escaped, so these can only be their fields, and without flow control this is a scan.
  local raw = jobs[i]
  if string.find(raw, '"tenant":', 1, true) and string.find(raw, '"state":"q"', 1, true) then
    local rec = cjson.decode(raw)
    if rec.state == 'q' and rec.tenant ~= nil then expect('q', rec) end
  end
end

local fixed = {}
for i, provider in ipairs(ARGV) do
  local key = KEYS[5 + i]
  if redis.call('EXISTS', key) == 1 then
    local old = tonumber(redis.call('HGET', key, 'in_flight') or '0') or 0
    local new = held[provider] or 0
    if old ~= new then
      redis.call('HSET', key, 'in_flight', new)
      fixed[#fixed + 1] = provider
      fixed[#fixed + 1] = old
      fixed[#fixed + 1] = new
    end
    -- Models' running counts: every one the hash has, and every one a lease says; only for a
    -- provider whose models iop manages (its worker writes max_loaded: lua/models.lua).
    local flat = redis.call('HEXISTS', key, 'max_loaded') == 1 and redis.call('HGETALL', key) or {}
    local want_mr = {}
    for field, n in pairs(running) do
      if string.sub(field, 1, #provider + 1) == provider .. '\t' then want_mr[string.sub(field, #provider + 2)] = n end
    end
    for j = 1, #flat, 2 do
      if string.sub(flat[j], 1, 3) == 'mr:' and want_mr[flat[j]] == nil then want_mr[flat[j]] = 0 end
    end
    local have_mr = {}
    for j = 1, #flat, 2 do have_mr[flat[j]] = flat[j + 1] end
    for field, n in pairs(want_mr) do
      if tonumber(have_mr[field] or '0') ~= n then redis.call('HSET', key, field, n) end
    end
  end
end

-- Counters no job backs go (an absent field reads as 0 everywhere); a counter already right
-- is not written. Fields in order, so that the corrections come out the same every time.
local counted = {}
local have = redis.call('HGETALL', TENANTS)
local fields = {}
local current = {}
for i = 1, #have, 2 do
  fields[#fields + 1] = have[i]
  current[have[i]] = have[i + 1]
end
for field in pairs(want) do
  if current[field] == nil then fields[#fields + 1] = field end
end
table.sort(fields)
for _, field in ipairs(fields) do
  local old = tonumber(current[field] or '0') or -1  -- -1: not a number
  local new = want[field] or 0
  if old ~= new then
    if new == 0 then redis.call('HDEL', TENANTS, field) else redis.call('HSET', TENANTS, field, new) end
    counted[#counted + 1] = field
    counted[#counted + 1] = old
    counted[#counted + 1] = new
  end
end
return {fixed, counted}
