-- refuse_unavailable (lib/refuse_unavailable.lua) over every lane of the plan that holds
-- jobs. Returns the number refused.
--!include lib/lanes_with_jobs.lua
--!include lib/refuse_unavailable.lua

local function refuse_plan(now, refusal)
  local refused = 0
  for _, lane in ipairs(lanes_with_jobs()) do refused = refused + refuse_unavailable(lane, now, refusal) end
  return refused
end
