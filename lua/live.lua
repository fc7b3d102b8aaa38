-- live: a worker's tally of the calls its node finished since its last flush, added to the
-- live figures of each provider x model it names (lib/live_figures.lua). The worker keeps the
-- tally (dispatcher/live.py LiveTally) and flushes it about once a second
-- (workers/worker.py): finish.lua, on every request's path, writes nothing of it, and the
-- figures' cost in Redis is one call per worker per second, whatever the request rate.
--
-- KEYS[1..n] the pairs' live figure hashes (dispatcher/keys.py live)
-- ARGV[1..n] each pair's tally, msgpack (dispatcher/wire.py LiveTally)
-- Returns the number of pairs written.
--!include lib/now_ms.lua
--!include lib/live_figures.lua

local now = now_ms()
for i, key in ipairs(KEYS) do
  add_live(key, now, cmsgpack.unpack(ARGV[i]))
end
return #KEYS
