-- load_done: a worker reports the end of a load iop ordered on one of its providers
-- (lib/place.lua; workers/model_lifecycle.py carried it out through the runtime's API), then
-- pumps the provider's lanes: the jobs that waited for the model start there, or, when the
-- load failed, a lane that still waits may place it elsewhere.
-- Loaded: the model 'loaded', its load time (`ml:`, the mean of the last and the one before:
-- what lib/place.lua expects next time), its failures forgotten, the load counted
-- (`mn:<served>\tdemand`). Failed: 'unloaded', and no load of it ordered there again for
-- FAIL_BASE_MS, doubling with each failure in a row up to FAIL_MAX_MS (`mf:` until,
-- `mfn:` in a row, `mfr:` the runtime's words, `mfc:` counted). The model unloaded to make
-- room: 'unloaded' and counted (`mx:<served>\tevict`) if its unload was done, else 'loaded'
-- again (the runtime still holds it). A report of an order no longer in force (its time
-- ran out and another took its place) changes nothing but the pump.
--
-- KEYS[1..5] jobs, bodies, leases, deadlines, fence (see lib/jobs.lua, lib/dispatch_plan.lua)
-- KEYS[6]    provider hash   KEYS[..] plan keys of the provider's lanes
-- ARGV[1..3] plan id, plan key offset, lease ms (see lib/dispatch_plan.lua)
-- ARGV[4]    the outcome, JSON (dispatcher/wire.py LoadOutcome)
-- Returns the number of jobs dispatched.
--!include lib/jobs.lua
--!include lib/pump.lua
--!include lib/copies.lua

local FAIL_BASE_MS, FAIL_MAX_MS = 10000, 600000

local PROVIDER = KEYS[6]
local o = cjson.decode(ARGV[4])
local now = now_ms()
if redis.call('HGET', PROVIDER, 'load') == o.served then
  redis.call('HDEL', PROVIDER, 'load', 'load_evict', 'load_at', 'load_until', 'load_by')
  local s = o.served
  if o.evict ~= '' then
    if o.evicted then
      redis.call('HSET', PROVIDER, 'ms:' .. o.evict, 'unloaded', 'mt:' .. o.evict, now)
      redis.call('HINCRBY', PROVIDER, 'mx:' .. o.evict .. '\tevict', 1)
    else
      redis.call('HSET', PROVIDER, 'ms:' .. o.evict, 'loaded', 'mt:' .. o.evict, now)
      note_copies(redis.call('HGET', PROVIDER, 'mm:' .. o.evict), o.provider, true)
    end
  end
  if o.ok then
    local before = tonumber(redis.call('HGET', PROVIDER, 'ml:' .. s))
    local took = before and math.floor((before + o.load_ms) / 2) or o.load_ms
    redis.call('HSET', PROVIDER, 'ms:' .. s, 'loaded', 'mt:' .. s, now, 'ml:' .. s, took,
               'mfn:' .. s, 0, 'mf:' .. s, 0, 'mfr:' .. s, '')
    redis.call('HINCRBY', PROVIDER, 'mn:' .. s .. '\tdemand', 1)
    note_copies(redis.call('HGET', PROVIDER, 'mm:' .. s), o.provider, true)
  else
    local n = redis.call('HINCRBY', PROVIDER, 'mfn:' .. s, 1)
    local back = math.min(FAIL_BASE_MS * 2 ^ math.min(n - 1, 20), FAIL_MAX_MS)
    redis.call('HSET', PROVIDER, 'ms:' .. s, 'unloaded', 'mt:' .. s, now, 'mf:' .. s, now + back,
               'mfr:' .. s, o.reason)
    redis.call('HINCRBY', PROVIDER, 'mfc:' .. s, 1)
  end
end
return pump(now)
