-- remember_response: a provider made a stored Response; later calls on it (previous_response_id,
-- GET/DELETE /v1/responses/{id}) must go to that provider. Also forgets, a bounded number per
-- call, the ids whose time is up and the oldest beyond the cap, so memory stays bounded.
-- Run for a create only (workers/stored_responses.py): the calls on a stored Response must
-- neither pin again an id they deleted nor extend its time; a DELETE forgets its id.
--
-- KEYS[1] responses hash   response id -> "provider\tmodel\texpiry ms"
-- KEYS[2] expiry zset      response id -> expiry ms
-- ARGV[1] response id   ARGV[2] provider id   ARGV[3] model id
-- ARGV[4] ttl ms        ARGV[5] max ids remembered
-- Returns the number of ids forgotten.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expiry = now + tonumber(ARGV[4])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. '\t' .. ARGV[3] .. '\t' .. expiry)
redis.call('ZADD', KEYS[2], expiry, ARGV[1])

local forgotten = 0
local function forget(ids)
  for _, id in ipairs(ids) do
    redis.call('HDEL', KEYS[1], id)
    redis.call('ZREM', KEYS[2], id)
    forgotten = forgotten + 1
  end
end
forget(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 100))
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[5])
if over > 0 then
  forget(redis.call('ZRANGE', KEYS[2], 0, math.min(over, 100) - 1))
end
return forgotten
