-- Rate limits and budgets of tenants (api.keys[].limits; dispatcher/wire.py Limits), checked
-- and reserved by submit, settled by finish, all in one hash so that every API replica
-- enforces one limit:
--   r:<tenant>   requests: '<GCRA theoretical arrival time, ms (server clock)>|<the limit
--                per minute it was computed under>' (a reload that changes the limit
--                rescales what is ahead of now: the units in the window stay the same)
--   t:<tenant>   tokens: the same, for prompt + completion tokens
--   d:<tenant>   the day's budget: '<day>:<tokens used>' (day: UTC days since the epoch,
--                on the submitting API's clock; a day never goes back)
--   x:<tenant>:<limit>   refusals, per limit (requests | tokens | budget)
--
-- GCRA (the generic cell rate algorithm) over a one-minute window: a limit of N per minute
-- spaces units 60000 / N ms apart, and admits a request while the theoretical arrival time
-- it would leave is at most a minute ahead: a sliding window, a minute's worth at most at
-- once, never the 2x of fixed buckets at their boundary.
--
-- A group, not a file per function: admit_limits and settle_limits read and write one
-- hash's fields through the same four helpers, which nothing else uses.
--!include lib/jobs.lua

local WINDOW_MS = 60000

-- A window's arrival time under the limit `per_minute` now in force.
local function read_tat(raw, now, per_minute)
  local tat, pm = string.match(raw or '', '^([%d%.%-]+)|?(%d*)$')
  tat, pm = tonumber(tat), tonumber(pm)
  if tat == nil then return nil end
  if pm and pm ~= per_minute and tat > now then tat = now + (tat - now) * pm / per_minute end
  return tat
end

local function write_tat(tat, per_minute)
  return string.format('%.3f|%d', tat, per_minute)
end

-- The new arrival time for `cost` units of a limit of `per_minute` (nil if refused), and
-- for a refusal the ms until it would be admitted.
local function gcra(tat, now, cost, per_minute)
  local new = math.max(tat or now, now) + cost * WINDOW_MS / per_minute
  if new - now > WINDOW_MS then return nil, math.ceil(new - now - WINDOW_MS) end
  return new, 0
end

-- What a window's headers say: {limit, remaining, ms until it is back to the full limit}.
local function window_state(tat, now, per_minute)
  local ahead = math.max((tat or now) - now, 0)
  return {per_minute, math.max(math.floor((WINDOW_MS - ahead) * per_minute / WINDOW_MS + 1e-9), 0), math.ceil(ahead)}
end

local function budget_used(raw, day)
  local d, used = string.match(raw or '', '^(%d+):(%-?%d+)$')
  d, used = tonumber(d), tonumber(used)
  if d == nil or day > d then return day, 0 end
  return d, used
end

-- Admit a submit under its tenant's limits `L`, or refuse it. Returns (status or nil,
-- state, undo): status 'rate_limited' | 'budget_exhausted' when refused; state, for the
-- answer's headers (JSON: requests / tokens = {limit, remaining, reset_ms}, budget =
-- {limit, remaining}, retry_after_ms and limit when refused); undo() gives the
-- reservation back (the submit was refused later for another reason).
local function admit_limits(LIMITS, L, now)
  local t = L.tenant
  local raw = redis.call('HMGET', LIMITS, 'r:' .. t, 't:' .. t, 'd:' .. t)
  local rtat = read_tat(raw[1], now, L.requests_per_minute)
  local ttat = read_tat(raw[2], now, L.tokens_per_minute)
  local state, refused, wait = {}, nil, 0
  local new_r, new_t, day, used
  if L.requests_per_minute > 0 then
    new_r, wait = gcra(rtat, now, 1, L.requests_per_minute)
    if new_r == nil then refused = 'requests' end
  end
  if refused == nil and L.tokens_per_minute > 0 then
    if L.tokens > L.tokens_per_minute then
      refused, wait = 'tokens', -1  -- larger than a whole minute's worth: never admitted
    else
      new_t, wait = gcra(ttat, now, L.tokens, L.tokens_per_minute)
      if new_t == nil then refused = 'tokens' end
    end
  end
  if refused == nil and L.tokens_per_day > 0 then
    day, used = budget_used(raw[3], L.day)
    if used + L.tokens > L.tokens_per_day then refused, wait = 'budget', L.next_day_ms end
  end
  if L.requests_per_minute > 0 then state.requests = window_state(new_r or rtat, now, L.requests_per_minute) end
  if L.tokens_per_minute > 0 then state.tokens = window_state(new_t or ttat, now, L.tokens_per_minute) end
  if refused ~= nil then
    if L.tokens_per_day > 0 then
      local _, u = budget_used(raw[3], L.day)
      state.budget = {L.tokens_per_day, math.max(L.tokens_per_day - u, 0)}
    end
    state.limit, state.retry_after_ms = refused, wait
    redis.call('HINCRBY', LIMITS, 'x:' .. t .. ':' .. refused, 1)
    return refused == 'budget' and 'budget_exhausted' or 'rate_limited', cjson.encode(state), nil
  end
  local writes = {}
  if new_r then writes[#writes + 1], writes[#writes + 2] = 'r:' .. t, write_tat(new_r, L.requests_per_minute) end
  if new_t then writes[#writes + 1], writes[#writes + 2] = 't:' .. t, write_tat(new_t, L.tokens_per_minute) end
  if day then
    writes[#writes + 1], writes[#writes + 2] = 'd:' .. t, day .. ':' .. (used + L.tokens)
    state.budget = {L.tokens_per_day, math.max(L.tokens_per_day - used - L.tokens, 0)}
  end
  if #writes > 0 then redis.call('HSET', LIMITS, unpack(writes)) end
  local function undo()
    local back, gone = {}, {}
    for i, field in ipairs({'r:' .. t, 't:' .. t, 'd:' .. t}) do
      if raw[i] then back[#back + 1], back[#back + 2] = field, raw[i] else gone[#gone + 1] = field end
    end
    if #back > 0 then redis.call('HSET', LIMITS, unpack(back)) end
    if #gone > 0 then redis.call('HDEL', LIMITS, unpack(gone)) end
  end
  return nil, cjson.encode(state), undo
end

-- A job of a limited tenant ended with `actual` prompt + completion tokens reported (0:
-- none: its estimate stands): its tokens window and its day's budget move by the
-- difference from the estimate it reserved (rec.limits: {tenant, tokens_per_minute,
-- tokens_per_day, tokens, day}).
local function settle_limits(LIMITS, lim, actual)
  if actual <= 0 or actual == lim.tokens then return end
  local t, delta = lim.tenant, actual - lim.tokens
  if lim.tokens_per_minute > 0 then
    local tat = read_tat(redis.call('HGET', LIMITS, 't:' .. t), now_ms(), lim.tokens_per_minute)
    if tat then
      redis.call('HSET', LIMITS, 't:' .. t, write_tat(tat + delta * WINDOW_MS / lim.tokens_per_minute,
                                                      lim.tokens_per_minute))
    end
  end
  if lim.tokens_per_day > 0 then
    local day, used = budget_used(redis.call('HGET', LIMITS, 'd:' .. t), lim.day)
    if day == lim.day then redis.call('HSET', LIMITS, 'd:' .. t, day .. ':' .. math.max(used + delta, 0)) end
  end
end
