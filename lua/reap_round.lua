-- reap_round: open a reaper round, and say whether expiries can be trusted.
--
-- Liveness is judged by expiries that live processes keep pushing forward (leases,
-- replica registrations). Across a gap in which nobody reached Redis -- it was down,
-- restarted from its AOF, failed over, or was restored from a snapshot -- nobody could
-- push them, so an expiry that passed during the gap says nothing about its owner. After
-- a gap, or on a server that is not the one the last round saw (a restart or a failover),
-- every lease and replica expiry is moved to a full period from now: live processes renew
-- within it, dead ones are reaped after it. A missing marker (first round ever, or a
-- restored dataset) counts as a gap: the cost is one period of delay, once.
-- Heartbeats could not land across the gap either: until a heartbeat TTL after it (`judge`,
-- in the marker, so that the rounds other processes run next wait too) no round takes a
-- silent worker for a dead one. Nor after that until some worker has been heard since the
-- gap (`quiet`: the gap's round, until a provider's heartbeat is newer): a fleet none of
-- whose workers has reached Redis again may be cut off from it as a whole (a restarted
-- server whose name its clients cannot resolve yet), and its waiting jobs wait, up to their
-- deadlines, rather than be refused for want of workers that are alive. (A first round,
-- with no marker at all, sets no `quiet`: a fleet starting up is judged as before.)
--
-- KEYS[1] leases zset     KEYS[2] replicas zset
-- KEYS[3] last-round marker hash: ms (server time of the last round), run (server run id),
--         judge (server ms from which heartbeats may be judged), quiet (see above)
-- KEYS[4..] every provider's hash (its hb_ms: the server ms of its last heartbeat)
-- ARGV[1] gap ms: a longer time since the last round means nobody was watching
-- ARGV[2] lease ms        ARGV[3] replica TTL ms      ARGV[4] this server's run id
-- ARGV[5] heartbeat TTL ms
-- Returns {now ms, gap ms (0: no gap; -1: no marker), 1 if the server changed else 0,
--          judge ms, quiet ms (0: a worker has been heard since the last gap)}
local LEASES, REPLICAS, SEEN = KEYS[1], KEYS[2], KEYS[3]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local v = redis.call('HMGET', SEEN, 'ms', 'run', 'judge', 'quiet')
local last = tonumber(v[1] or '')
local changed = (v[2] and v[2] ~= ARGV[4]) and 1 or 0
redis.call('HSET', SEEN, 'ms', now, 'run', ARGV[4])
local gap = 0
if last == nil then
  gap = -1
elseif now - last > tonumber(ARGV[1]) then
  gap = now - last
end
if gap ~= 0 or changed == 1 then
  local function extend(zset, until_ms)
    for _, member in ipairs(redis.call('ZRANGEBYSCORE', zset, '-inf', '(' .. until_ms)) do
      redis.call('ZADD', zset, 'XX', until_ms, member)
    end
  end
  extend(LEASES, now + tonumber(ARGV[2]))
  extend(REPLICAS, now + tonumber(ARGV[3]))
  local judge = now + tonumber(ARGV[5])
  if gap == -1 then
    redis.call('HSET', SEEN, 'judge', judge)
    redis.call('HDEL', SEEN, 'quiet')
    return {now, gap, changed, judge, 0}
  end
  redis.call('HSET', SEEN, 'judge', judge, 'quiet', now)
  return {now, gap, changed, judge, now}
end
local quiet = tonumber(v[4] or '') or 0
if quiet > 0 then
  for i = 4, #KEYS do
    if (tonumber(redis.call('HGET', KEYS[i], 'hb_ms') or '') or 0) >= quiet then
      redis.call('HDEL', SEEN, 'quiet')
      quiet = 0
      break
    end
  end
end
return {now, gap, changed, tonumber(v[3] or '') or 0, quiet}
