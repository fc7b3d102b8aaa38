-- add_live: a worker's tally of finished calls added to the live figures of one provider x
-- model (live.lua), the catalog's providers[].live. `key`: the pair's hash
-- (dispatcher/keys.py live); per window (lib/live_windows.lua) its current bucket, a msgpack
-- map (dispatcher/wire.py LiveBucket): requests, errors by kind, and log-bucketed histograms
-- of TTFT, e2e and output tokens/s of the answered requests. `tally`: the calls since the
-- worker's last flush (dispatcher/wire.py LiveTally), already binned by the worker
-- (dispatcher/live.py bin_of): a bucket is a sum of counts, so adding a second's calls at once
-- gives what adding them one by one gave. One HMGET, one HSET and a PEXPIRE: a pair no call
-- touched for longer than its longest window (a provider or model a reload removed) goes.
--!include lib/live_windows.lua

-- The 24h window and one more hour (its current bucket): nothing older is ever read.
local LIVE_KEEP_MS = 25 * 3600 * 1000

-- Counts added into a table; an empty one is never made (cmsgpack would pack it as an array).
local function add_counts(into, more)
  if type(more) ~= 'table' or next(more) == nil then return into end
  into = into or {}
  for k, n in pairs(more) do into[k] = (into[k] or 0) + n end
  return into
end

local function add_live(key, now, tally)
  local names, numbers = live_slots(now, '')
  local raw = redis.call('HMGET', key, unpack(names))
  local args = {}
  for i = 1, #names do
    local bucket = raw[i] and cmsgpack.unpack(raw[i]) or nil
    if type(bucket) ~= 'table' or bucket.at ~= numbers[i] then bucket = {at = numbers[i], requests = 0} end
    bucket.requests = bucket.requests + (tonumber(tally.requests) or 0)
    bucket.errors = add_counts(bucket.errors, tally.errors)
    bucket.ttft = add_counts(bucket.ttft, tally.ttft)
    bucket.e2e = add_counts(bucket.e2e, tally.e2e)
    bucket.tps = add_counts(bucket.tps, tally.tps)
    args[#args + 1], args[#args + 2] = names[i], cmsgpack.pack(bucket)
  end
  redis.call('HSET', key, unpack(args))
  redis.call('PEXPIRE', key, LIVE_KEEP_MS)
end
