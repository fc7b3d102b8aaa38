-- model_order: an operator asks a provider whose models iop manages (lifecycle: managed) to
-- load or unload one model now (dispatcher/control.py); the provider's worker carries it out
-- through the runtime's own API (workers/model_lifecycle.py).
--   load    the same order iop's placement gives (lib/load_order.lua: `load`, `load_at`,
--           `load_until`; no model evicted first: a runtime at its max_loaded makes room
--           its own way), reported by lua/load_done.lua, which pumps the jobs that waited.
--   unload  `unload` (served name) until `unload_until`: the model is 'unloading' at once, so
--           no new job goes there (lib/warm.lua), and lua/models.lua leaves it so while the
--           order holds; the worker waits for iop's jobs running on it to end, unloads it,
--           clears the order and publishes what the runtime then holds.
-- One order at a time per provider, as for placement: a second answers 'busy'.
--
-- KEYS[1] provider hash   KEYS[2] audit stream   KEYS[3] audit counts
-- ARGV[1] 'load' | 'unload'   ARGV[2] served name   ARGV[3] by   ARGV[4] via
-- ARGV[5] audit entries kept   ARGV[6] the audit's target   ARGV[7] the order's time, ms
-- Returns {outcome, what}: 'loading' | 'unloading' (ordered now, or already under way),
-- 'loaded' | 'unloaded' (already so: nothing ordered), 'busy' (what: the order in force).
--!include lib/now_ms.lua
--!include lib/audit.lua

local PROVIDER = KEYS[1]
local op, served = ARGV[1], ARGV[2]
local now = now_ms()
local v = redis.call('HMGET', PROVIDER, 'load', 'load_until', 'unload', 'unload_until', 'ms:' .. served)
local loading = ((v[1] or '') ~= '' and (tonumber(v[2]) or 0) > now) and v[1] or ''
local unloading = ((v[3] or '') ~= '' and (tonumber(v[4]) or 0) > now) and v[3] or ''
local state = v[5] or 'unknown'
if op == 'load' then
  if loading == served then return {'loading', served} end
  if loading ~= '' then return {'busy', 'loading ' .. loading} end
  if unloading ~= '' then return {'busy', 'unloading ' .. unloading} end
  if state == 'loaded' then return {'loaded', served} end
  redis.call('HSET', PROVIDER, 'load', served, 'load_evict', '', 'load_at', now, 'load_until', now + tonumber(ARGV[7]),
             'ms:' .. served, 'loading', 'mt:' .. served, now)
  redis.call('HDEL', PROVIDER, 'load_by')
  audit(KEYS[2], KEYS[3], ARGV[5], now, ARGV[3], 'load', ARGV[6], cjson.encode(state), '"loading"', ARGV[4])
  return {'loading', served}
end
if unloading == served then return {'unloading', served} end
if unloading ~= '' then return {'busy', 'unloading ' .. unloading} end
if loading ~= '' then return {'busy', 'loading ' .. loading} end
if state == 'unloaded' then return {'unloaded', served} end
redis.call('HSET', PROVIDER, 'unload', served, 'unload_until', now + tonumber(ARGV[7]), 'ms:' .. served, 'unloading',
           'mt:' .. served, now)
redis.call('HDEL', PROVIDER, 'unload_by')
audit(KEYS[2], KEYS[3], ARGV[5], now, ARGV[3], 'unload', ARGV[6], cjson.encode(state), '"unloading"', ARGV[4])
return {'unloading', served}
