-- override: an operator sets, clears, or lets lapse one override of the config, fleet-wide
-- (dispatcher/overrides.py): a provider disabled (`enabled`), its capacity fixed
-- (`capacity`) or its learned capacity bounded (`capacity_bounds`), a model's `fallbacks`
-- or `preference`. The override is kept in the overrides hash, field '<field>|<id>' -> its
-- record (dispatcher/wire.py Override, JSON built here); the version key counts changes,
-- which every API and worker process watches to rebuild what it derives from the config
-- (fallbacks, preference, the bounds a worker learns within). What dispatch reads itself
-- is written into the provider hash here, so it holds everywhere at once:
--   enabled          `off` (server ms): no new dispatch (lib/takes_work.lua); running
--                    jobs finish. Lanes left with no provider answer their waiting jobs,
--                    as a drain does (lib/refuse_unavailable.lua).
--   capacity         `cap_o`, the capacity in force whatever the worker proposes
--   capacity_bounds  `cap_lo`, `cap_hi`: the learned limit kept within them
--                    (lib/capacity_in_force.lua reapplies the worker's last proposal now)
-- Every change is audited in the same call (lib/audit.lua); a clear of nothing changes
-- nothing and audits nothing. A lapse clears the override only if its time has come by
-- the server's clock (several processes may try; one does it).
--
-- KEYS[1..5] jobs, bodies, leases, deadlines, fence (see lib/jobs.lua, lib/dispatch_plan.lua)
-- KEYS[6]    overrides hash   KEYS[7] overrides version   KEYS[8] audit stream
-- KEYS[9]    audit counts     KEYS[10] provider hash (a provider's field only)
-- KEYS[..]   plan keys: the provider's lanes (a model's field: the empty plan)
-- ARGV[1..3] plan id, plan key offset, lease ms (see lib/dispatch_plan.lua)
-- ARGV[4]    'set' | 'clear' | 'lapse'
-- ARGV[5]    the field, '<field>|<id>'
-- ARGV[6]    set: the value, JSON        ARGV[7] the config's value, JSON
-- ARGV[8]    by (an admin key's name)    ARGV[9] via ('http', 'cli', 'reload', 'expiry')
-- ARGV[10]   set: ms until it lapses (0: never)
-- ARGV[11]   the audit's action          ARGV[12] the audit's target
-- ARGV[13]   audit entries kept          ARGV[14] refusal options, JSON (dispatcher/wire.py Refusal)
-- Returns {changed (0/1), the record in force ('' none), jobs dispatched or refused}
--!include lib/jobs.lua
--!include lib/refuse_plan.lua
--!include lib/pump.lua
--!include lib/capacity_in_force.lua
--!include lib/audit.lua

local OVR, VERSION, AUDIT, COUNTS, PROVIDER = KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local op, field = ARGV[4], ARGV[5]
local kind = string.match(field, '^([^|]+)|')
local now = now_ms()
local old = redis.call('HGET', OVR, field)

-- The value of a record this script wrote: the JSON between its first two members (a value
-- is ids, numbers or {"min","max"}: no '"config":' can sit inside it unescaped).
local function value_of(record)
  local stop = string.find(record, ',"config":', 10, true)
  return string.sub(record, 10, stop - 1)
end

local function in_force_again()
  local v = redis.call('HMGET', PROVIDER, 'cap_c', 'capacity')
  capacity_in_force(PROVIDER, v[1] or v[2] or 0)
end

if op == 'lapse' then
  if not old then return {0, '', 0} end
  local rec = cjson.decode(old)
  if (tonumber(rec['until']) or 0) <= 0 or tonumber(rec['until']) > now then return {0, old, 0} end
end
if op ~= 'set' and not old then return {0, '', 0} end

local before = old and value_of(old) or ARGV[7]
local after, record = ARGV[7], ''
if op == 'set' then
  local for_ms = tonumber(ARGV[10]) or 0
  record = '{"value":' .. ARGV[6] .. ',"config":' .. ARGV[7] .. ',"by":' .. cjson.encode(ARGV[8]) .. ',"at":' .. now
    .. ',"until":' .. (for_ms > 0 and tostring(now + for_ms) or 'null') .. ',"via":' .. cjson.encode(ARGV[9]) .. '}'
  redis.call('HSET', OVR, field, record)
  after = ARGV[6]
else
  redis.call('HDEL', OVR, field)
end
redis.call('INCR', VERSION)
audit(AUDIT, COUNTS, ARGV[13], now, ARGV[8], ARGV[11], ARGV[12], before, after, ARGV[9])

local moved = 0
if kind == 'enabled' then
  if op == 'set' then
    redis.call('HSET', PROVIDER, 'off', now)
    moved = refuse_plan(now, cjson.decode(ARGV[14]))
  else
    redis.call('HDEL', PROVIDER, 'off')
    moved = pump(now)
  end
elseif kind == 'capacity' then
  if op == 'set' then
    redis.call('HSET', PROVIDER, 'cap_o', tonumber(ARGV[6]))
  else
    redis.call('HDEL', PROVIDER, 'cap_o')
  end
  in_force_again()
  moved = pump(now)
elseif kind == 'capacity_bounds' then
  if op == 'set' then
    local b = cjson.decode(ARGV[6])
    redis.call('HSET', PROVIDER, 'cap_lo', b.min, 'cap_hi', b.max)
  else
    redis.call('HDEL', PROVIDER, 'cap_lo', 'cap_hi')
  end
  in_force_again()
  moved = pump(now)
end
return {1, record, moved}
