-- The live figures' windows (dispatcher/live.py WINDOWS, held to this by its test): name,
-- bucket length ms, buckets kept. A window is its last `count` buckets, the current one
-- included, so it covers between (count - 1) and count bucket lengths. Each bucket lives in
-- the field '<name>:<number mod count>', and carries its number: a field whose number is
-- not the current one is an older bucket's, overwritten when its turn comes again.

local LIVE_WINDOWS = {{'5m', 30000, 10}, {'1h', 300000, 12}, {'24h', 3600000, 24}}

-- The current bucket of each window at `now`: its field name and its number, in window order.
local function live_slots(now, prefix)
  local names, numbers = {}, {}
  for i, w in ipairs(LIVE_WINDOWS) do
    numbers[i] = math.floor(now / w[2])
    names[i] = prefix .. w[1] .. ':' .. (numbers[i] % w[3])
  end
  return names, numbers
end
