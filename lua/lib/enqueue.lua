-- Put a job in a lane's queue with its score (its place: submit sequence or fair tag), and
-- the lane in the index of lanes that hold jobs (lib/lanes_with_jobs.lua).
--!include lib/dispatch_plan.lua

local function enqueue(qkey, score, job)
  redis.call('ZADD', qkey, score, job)
  redis.call('SADD', WAITING, qkey)
end
