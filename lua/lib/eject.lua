-- eject: take a provider out of rotation for its 5xx answers, for a while (lib/blame.lua
-- decides when). Its fields `f` (EVIDENCE_FIELDS of lib/evidence_window.lua) take the
-- ejection; the caller writes them back.
--
-- An ejection lasts EJECTION.base_ms, twice as long at each repeat, at most max_ms; the
-- repeat count falls by one for every max_ms the provider stayed in since its last
-- ejection ended. Until ej_until the provider takes nothing (lib/pump.lua) unless a lane
-- has no other provider that can take work; after it, it is on trial (ej_trial '1'): one
-- request at a time until one is answered (lib/answered.lua).
--
-- Refused, so that a 5xx alone never leaves a request with no provider, when `lane` (the
-- lane of the job that gave the evidence) would then have more than max_percent of its
-- providers ejected (one of two or more always may be), or no other provider that can
-- take work now. The provider's ej_n:<kind> counts its ejections (the catalog, /metrics).
-- Returns the ejection in words ('' when refused).
--!include lib/dispatch_plan.lua
--!include lib/takes_work.lua
--!include lib/hash_fields.lua
--!include lib/evidence_window.lua

local function eject(f, pid, lane, kind, reason, now, rules)
  if lane == nil then return '' end
  local ejected, others_take_work = 0, false
  for _, cand in ipairs(lane.candidates) do
    if cand.provider ~= pid then
      local v = redis.call('HMGET', KEYS[BASE + cand.provider_key], 'health', 'hb_exp', 'capacity', 'drain',
                           'off', 'ej_until', 'ej_trial')
      if v[7] == '1' and (tonumber(v[6]) or 0) > now then
        ejected = ejected + 1
      elseif takes_work(v, now) then
        others_take_work = true
      end
    end
  end
  local n = #lane.candidates
  local allowed = 0
  if rules.max_percent > 0 and n >= 2 then allowed = math.max(math.floor(n * rules.max_percent / 100), 1) end
  if not others_take_work or ejected + 1 > allowed then return '' end
  local count = tonumber(f.v.ej_count) or 0
  local last_until = tonumber(f.v.ej_until)
  if last_until ~= nil and now > last_until then
    count = math.max(count - math.floor((now - last_until) / rules.max_ms), 0)
  end
  count = count + 1
  local ms = math.min(rules.base_ms * 2 ^ (count - 1), rules.max_ms)
  set_field(f, 'ej_until', now + ms)
  set_field(f, 'ej_trial', '1')
  set_field(f, 'ej_count', count)
  set_field(f, 'c5xx', 0)
  set_field(f, 'c5xx_status', '')
  redis.call('HSET', f.key, 'ej_reason', reason, 'ej_kind', kind)
  redis.call('HINCRBY', f.key, 'ej_n:' .. kind, 1)
  return string.format('%s ejected for %gs: %s', pid, ms / 1000, reason)
end
