-- How long a place in a lane's queue takes: the mean interval between dispatches from it
-- while it had a backlog. Written at each dispatch of a job that waited (note_drain,
-- lib/assign.lua), read by submit's deadline check (drain_interval). A group of three,
-- not three files: they are the one reader and the one writer of one field's format,
-- '<block start ms>|<dispatches since>|<interval ms>' in the plan's rates hash
-- (PlanHeader.rates), and drain_state is theirs alone.
--!include lib/dispatch_plan.lua

-- Dispatches per measured block (see note_drain).
local DRAIN_BLOCK = 8

-- The field of queue `qkey`: block start ms, dispatches since, interval ms (nil: none yet).
local function drain_state(qkey)
  local raw = redis.call('HGET', KEYS[BASE + PLAN.rates], qkey) or ''
  local t0, n, interval = string.match(raw, '^(%d*)|(%d*)|([%d%.]*)$')
  return tonumber(t0), tonumber(n) or 0, tonumber(interval)
end

-- The drain interval of queue `qkey`, ms (nil: not measured yet).
local function drain_interval(qkey)
  local _, _, interval = drain_state(qkey)
  return interval
end

-- A job that waited left `qkey` at `now`. Dispatches come in bursts (a server's step ends
-- several requests at once), so the interval is measured over blocks of DRAIN_BLOCK
-- dispatches made while the queue had a backlog all along: each block's mean interval
-- moves the estimate halfway. A queue that empties ends the block unmeasured.
local function note_drain(qkey, now)
  local t0, n, interval = drain_state(qkey)
  if t0 == nil then
    t0, n = now, 0
  else
    n = n + 1
    if n >= DRAIN_BLOCK then
      local sample = (now - t0) / n
      interval = interval and (interval + sample) / 2 or sample
      t0, n = now, 0
    end
  end
  if redis.call('ZCARD', qkey) == 0 then t0, n = nil, 0 end
  redis.call('HSET', KEYS[BASE + PLAN.rates], qkey,
             (t0 or '') .. '|' .. n .. '|' .. (interval and string.format('%.1f', interval) or ''))
end
