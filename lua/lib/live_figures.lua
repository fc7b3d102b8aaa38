-- note_live: one finished call in the live figures of its provider x model (finish.lua),
-- the catalog's providers[].live. `key`: the pair's hash (dispatcher/keys.py live); per
-- window (lib/live_windows.lua) its current bucket, a msgpack map (dispatcher/wire.py
-- LiveBucket): requests, errors by kind, and log-bucketed histograms of TTFT, e2e and output
-- tokens/s of the answered requests. A histogram bin is 5% wide (LIVE_BIN below), so a
-- percentile read from it is within 2.5% of the samples' own (dispatcher/live.py reads
-- them). `ttft` ms (< 0: none, a JSON answer), `e2e` ms, `tokens` completion tokens, `kind`
-- '' answered, else the error's kind. One HMGET, one HSET and a PEXPIRE: a pair no call
-- touched for longer than its longest window (a provider or model a reload removed) goes.
--!include lib/live_windows.lua

local LIVE_LOG_RATIO = math.log(1.05)
-- Bins are offset so that no histogram is ever a Lua sequence 1..n (cmsgpack would pack it
-- as an array): values from 0.001 up all land at 859 and above.
local LIVE_BIN_BASE = 1000
-- The 24h window and one more hour (its current bucket): nothing older is ever read.
local LIVE_KEEP_MS = 25 * 3600 * 1000

local function live_bin(v)
  return LIVE_BIN_BASE + math.floor(math.log(math.max(v, 0.001)) / LIVE_LOG_RATIO)
end

local function bump(t, k)
  t[k] = (t[k] or 0) + 1
  return t
end

local function note_live(key, now, ttft, e2e, tokens, kind)
  local names, numbers = live_slots(now, '')
  local raw = redis.call('HMGET', key, unpack(names))
  local args = {}
  for i = 1, #names do
    local bucket = raw[i] and cmsgpack.unpack(raw[i]) or nil
    if type(bucket) ~= 'table' or bucket.at ~= numbers[i] then bucket = {at = numbers[i], requests = 0} end
    bucket.requests = bucket.requests + 1
    if kind ~= '' then
      bucket.errors = bump(bucket.errors or {}, kind)
    else
      if ttft >= 0 then bucket.ttft = bump(bucket.ttft or {}, live_bin(ttft)) end
      bucket.e2e = bump(bucket.e2e or {}, live_bin(e2e))
      local generating = e2e
      if ttft >= 0 and e2e > ttft then generating = e2e - ttft end
      if tokens > 0 and generating > 0 then
        bucket.tps = bump(bucket.tps or {}, live_bin(tokens * 1000 / generating))
      end
    end
    args[#args + 1], args[#args + 2] = names[i], cmsgpack.pack(bucket)
  end
  redis.call('HSET', key, unpack(args))
  redis.call('PEXPIRE', key, LIVE_KEEP_MS)
end
