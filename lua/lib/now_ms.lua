-- now_ms: the server's clock in ms. Every script's time comes from here, never from a
-- client's clock: API replicas and workers on several hosts agree on Redis's.

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
