-- note_uptime: the time since a provider's last heartbeat, in its uptime buckets
-- (heartbeat.lua; lib/live_windows.lua's windows). `f`: its hash's fields read with
-- uptime_fields(now) (hb_ms, hb_exp, health, then the current buckets). Each bucket,
-- '<number>|<up ms>|<seen ms>', counts the time seen since the first heartbeat, and of it
-- the time the provider was reported available with a fresh heartbeat: the part of an
-- interval past the previous heartbeat's expiry (its worker silent) is seen, not up.
-- Sets the buckets in `f` (lib/hash_fields.lua), which the caller writes back.
--!include lib/hash_fields.lua
--!include lib/live_windows.lua

local function uptime_fields(now)
  local names, numbers = live_slots(now, 'up:')
  local all = {'hb_ms', 'hb_exp', 'health'}
  for _, name in ipairs(names) do all[#all + 1] = name end
  return all, names, numbers
end

local function note_uptime(f, now, names, numbers)
  local last, expiry = tonumber(f.v.hb_ms), tonumber(f.v.hb_exp)
  if last == nil or expiry == nil or now <= last then return end
  local up = 0
  if f.v.health == 'available' then up = math.max(math.min(now, expiry) - last, 0) end
  for i, name in ipairs(names) do
    local length = LIVE_WINDOWS[i][2] * LIVE_WINDOWS[i][3]
    local at, u, s = string.match(f.v[name] or '', '^(%d+)|(%d+)|(%d+)$')
    if tonumber(at) ~= numbers[i] then u, s = 0, 0 end
    -- A gap longer than the window counts as the window; it is the current bucket's.
    local seen = math.min(now - last, length)
    set_field(f, name, numbers[i] .. '|' .. (tonumber(u) + math.min(up, seen)) .. '|' .. (tonumber(s) + seen))
  end
end
