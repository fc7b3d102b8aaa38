-- Could a provider of the lane queued at `qkey` other than those `rec` excludes take the
-- job (is one healthy)? Busy is fine: the job waits for it.
--!include lib/dispatch_plan.lua
--!include lib/lane_at.lua
--!include lib/serves.lua
--!include lib/excluded.lua
--!include lib/provider_ok.lua

local function other_candidate(qkey, rec, now)
  local lane = lane_at(qkey)
  if lane == nil then return false end
  for _, cand in ipairs(lane.candidates) do
    if not excluded(rec, cand.provider) and serves(cand, rec) and provider_ok(KEYS[BASE + cand.provider_key], now) then
      return true
    end
  end
  return false
end
