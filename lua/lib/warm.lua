-- May a request go to candidate `cand` now as far as its model goes: is the model loaded
-- there? Always, for a provider whose models iop does not manage (every model it lists is
-- ready); for one it manages (`cand.managed`), only when its runtime holds the model loaded
-- (lib/model_state.lua): a request never makes a runtime load a model, or evict another
-- that has requests running or waiting; a load is placed for it instead (lib/place.lua).
-- A model whose state is unknown (its worker has not read the runtime, or cannot) is
-- taken as loaded: what iop did before it managed models, rather than hold every request.
-- `ctx`: the pump() call's state (lib/pump.lua).
--!include lib/dispatch_plan.lua
--!include lib/model_state.lua

local function warm(ctx, cand)
  if not cand.managed then return true end
  local state = model_state(ctx, KEYS[BASE + cand.provider_key], cand.served).state
  return state == 'loaded' or state == 'unknown'
end
