-- nil when some provider of `lane` can take work (or may be about to:
-- lib/unavailable_reason.lua); otherwise each one's reason, in words.
--!include lib/dispatch_plan.lua
--!include lib/unavailable_reason.lua

local function unavailable_lane(lane, now, silent_is_down)
  local why = {}
  for _, cand in ipairs(lane.candidates) do
    local r = unavailable_reason(KEYS[BASE + cand.provider_key], now, silent_is_down)
    if r == nil or r == '' then return nil end
    why[#why + 1] = cand.provider .. ': ' .. r
  end
  if #why == 0 then return 'none of its providers is in the config' end
  return table.concat(why, '; ')
end
