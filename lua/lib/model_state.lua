-- One served model on one provider whose models iop manages (a candidate with `managed`:
-- docs/DESIGN.md "Models that load and unload"), as one pump() call sees it, read from the
-- provider hash `pkey` once per call (`ctx`, lib/pump.lua) and kept up to date by the call's
-- dispatches (lib/assign.lua):
--   state      'loaded' | 'loading' | 'unloading' | 'unloaded' | 'unknown' (ms:<served>:
--              what its runtime said, lua/models.lua; or what a load iop ordered makes of it,
--              lib/place.lua, lua/load_done.lua)
--   since      ms it entered that state (mt:)
--   used       ms of its last dispatch (mu:)
--   running    iop's jobs running there (mr:: moved by lib/assign.lua and lib/jobs.lua
--              release_slot, rebuilt by lua/reconcile.lua)
--   fail_until no load is ordered there before this ms: its last one failed (mf:)
--   load_ms    how long its last loads there took (ml:; nil: none timed yet)
-- dispatcher/wire.py ModelState reads the same fields for the catalog.

local function model_state(ctx, pkey, served)
  ctx.models = ctx.models or {}
  local k = pkey .. '\t' .. served
  local m = ctx.models[k]
  if m == nil then
    local v = redis.call('HMGET', pkey, 'ms:' .. served, 'mt:' .. served, 'mu:' .. served, 'mr:' .. served,
                         'mf:' .. served, 'ml:' .. served)
    m = {state = v[1] or 'unknown', since = tonumber(v[2]) or 0, used = tonumber(v[3]) or 0,
         running = tonumber(v[4]) or 0, fail_until = tonumber(v[5]) or 0, load_ms = tonumber(v[6])}
    ctx.models[k] = m
  end
  return m
end
