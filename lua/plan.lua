-- plan: write a dispatch plan into Redis (dispatcher/plans.py), for the scripts that pump
-- its lanes (lib/dispatch_plan.lua reads it by the key they are given). A plan's key is
-- named after a digest of its content, so plans of different configs (replicas not yet
-- reloaded) live side by side, and writing one again changes nothing.
--
-- KEYS[1] the plan hash: '' -> header, <queue key> -> lane (dispatcher/wire.py)
-- KEYS[2] the set of its lanes' queue keys
-- ARGV[1] TTL ms of the hash (a plan nobody wrote for that long goes; one still in use is
--         written again by its next caller, whose call failed NOPLAN and changed nothing);
--         the set outlives it by a minute, so no call finds the header without its lanes
-- ARGV[2] header JSON     ARGV[3..] queue key, lane JSON, ...
-- Returns the number of lanes
redis.call('DEL', KEYS[1], KEYS[2])
for i = 3, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  redis.call('SADD', KEYS[2], ARGV[i])
end
-- Last, and in the same script: a caller never finds a header without its lanes.
redis.call('HSET', KEYS[1], '', ARGV[2])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]))
if #ARGV > 2 then redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[1]) + 60000) end
return (#ARGV - 2) / 2
