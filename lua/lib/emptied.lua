-- A lane found empty leaves the index of lanes that hold jobs (it comes back with its next
-- job: lib/enqueue.lua). A plan of one lane keeps no index.
--!include lib/dispatch_plan.lua

local function emptied(qkey)
  if not PLAN.only then redis.call('SREM', WAITING, qkey) end
end
