-- replica: an API process says it is alive. Its reply stream and job set live as long
-- as it keeps saying so; the reaper cancels the jobs of a replica that stopped.
--
-- KEYS[1] replicas zset (replica id -> expiry ms)
-- KEYS[2] the replica's reply stream     KEYS[3] the replica's job set
-- ARGV[1] replica id     ARGV[2] liveness TTL ms     ARGV[3] TTL ms of its stream and set
-- Returns the server time in ms
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[3]))
redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[3]))
return now
