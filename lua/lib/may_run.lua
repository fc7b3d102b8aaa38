-- May waiting job `job` run now, as far as its tenant goes: without flow control, or with
-- no tenant capped (PlanHeader.capped), always; else while its tenant is under its
-- max_in_flight (lib/tenant_state.lua). Asked again of a head read earlier in the pump()
-- call `ctx`, whose tenant may have reached its cap since.
--!include lib/dispatch_plan.lua
--!include lib/tenant_of.lua
--!include lib/tenant_state.lua

local function may_run(ctx, job)
  if FAIR == nil or not PLAN.capped then return true end
  local t = tenant_state(ctx, tenant_of(job))
  return t.lim == nil or t.run < t.lim
end
