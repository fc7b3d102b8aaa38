-- models: a worker publishes which models one provider's runtime holds (a provider whose
-- models iop manages: workers/model_lifecycle.py reads the runtime's own API), with the
-- provider's lifecycle settings, then pumps the provider's lanes: a model that became
-- loaded takes its waiting jobs at once, and a lane that still waits may place a load
-- (lib/place.lua).
-- A model a load iop ordered is loading, or unloading for one (lib/load_order.lua), is
-- left as the order made it until lua/load_done.lua reports the order's end: the runtime may
-- not show a load yet. An order whose time ran out is forgotten here. A model the runtime
-- no longer reports is 'unloaded'. A change the runtime made by itself (another client's
-- request loaded a model, its keep_alive unloaded one) is counted as the runtime's
-- (`mn:<served>\truntime`, `mx:<served>\truntime`); a model's first report is no change.
-- The fleet's copies (lib/copies.lua) follow every reading.
--
-- KEYS[1..5] jobs, bodies, leases, deadlines, fence (see lib/jobs.lua, lib/dispatch_plan.lua)
-- KEYS[6]    provider hash   KEYS[..] plan keys of the provider's lanes
-- ARGV[1..3] plan id, plan key offset, lease ms (see lib/dispatch_plan.lua)
-- ARGV[4]    the report, JSON (dispatcher/wire.py ModelsReport)
-- Returns the number of jobs dispatched.
--!include lib/jobs.lua
--!include lib/pump.lua
--!include lib/copies.lua

local PROVIDER = KEYS[6]
local r = cjson.decode(ARGV[4])
local now = now_ms()
redis.call('HSET', PROVIDER, 'max_loaded', r.max_loaded, 'load_ms0', r.load_ms, 'unload_idle_ms', r.idle_ms,
           'load_timeout_ms', r.timeout_ms)
local flat = redis.call('HGETALL', PROVIDER)
local have = {}
for i = 1, #flat, 2 do have[flat[i]] = flat[i + 1] end
local loading, evicting = have['load'] or '', have['load_evict'] or ''
if loading ~= '' and (tonumber(have['load_until']) or 0) <= now then
  redis.call('HDEL', PROVIDER, 'load', 'load_evict', 'load_at', 'load_until', 'load_by')
  loading, evicting = '', ''
end
-- An operator's unload (lua/model_order.lua) holds its model 'unloading' the same way.
local unloading = have['unload'] or ''
if unloading ~= '' and (tonumber(have['unload_until']) or 0) <= now then
  redis.call('HDEL', PROVIDER, 'unload', 'unload_until', 'unload_by')
  unloading = ''
end

local states = {}
for name, state in pairs(r.states) do states[name] = state end
for field in pairs(have) do
  if string.sub(field, 1, 3) == 'ms:' and states[string.sub(field, 4)] == nil then
    states[string.sub(field, 4)] = 'unloaded'
  end
end
for served, prefixes in pairs(r.queues) do
  if have['mq:' .. served] ~= prefixes then redis.call('HSET', PROVIDER, 'mq:' .. served, prefixes) end
  if states[served] == nil then states[served] = 'unloaded' end
end
for served, ids in pairs(r.models) do
  if have['mm:' .. served] ~= ids then
    redis.call('HSET', PROVIDER, 'mm:' .. served, ids)
    have['mm:' .. served] = ids
  end
end
for name, state in pairs(states) do
  local old = have['ms:' .. name]
  if name ~= loading and name ~= evicting and name ~= unloading then
    -- Every reading, not only a change: the index is whole again after a loss of it.
    note_copies(have['mm:' .. name], r.provider, state == 'loaded')
  end
  if name ~= loading and name ~= evicting and name ~= unloading and old ~= state then
    redis.call('HSET', PROVIDER, 'ms:' .. name, state, 'mt:' .. name, now)
    if old ~= nil and old ~= 'unknown' then
      if state == 'loaded' then
        redis.call('HINCRBY', PROVIDER, 'mn:' .. name .. '\truntime', 1)
      elseif old == 'loaded' then
        redis.call('HINCRBY', PROVIDER, 'mx:' .. name .. '\truntime', 1)
      end
    end
  end
end
return pump(now)
