-- blame: a 5xx counted against a provider (lib/evidence.lua says when: another provider
-- answered the same request, or no other could try it). Its fields `f` (EVIDENCE_FIELDS of
-- lib/evidence_window.lua) take the count; the caller writes them back. It is ejected
-- (lib/eject.lua) when it is on trial after an ejection, on a streak of rules.consecutive
-- (each on a different request: a request blames a provider once), or when at least
-- rules.rate of its requests over the window, and at least rules.min_requests of them,
-- failed so while the other providers of `lane` together failed under half as often (or
-- had too few requests to tell). `rules`: the plan's ejection (dispatcher/wire.py Ejection).
-- Returns the ejection in words ('' if none).
--!include lib/dispatch_plan.lua
--!include lib/hash_fields.lua
--!include lib/evidence_window.lua
--!include lib/eject.lua

-- The share of 5xx counted against the other providers of `lane` over the window, pooled;
-- nil when they had fewer than rules.min_requests requests together.
local function others_share(lane, pid, now, rules)
  local b = bucket_of(now, rules.window_ms)
  local answered_n, failed_n = 0, 0
  for _, cand in ipairs(lane.candidates) do
    if cand.provider ~= pid then
      local n, x = window_of(read_fields(KEYS[BASE + cand.provider_key], EVIDENCE_FIELDS), b, false)
      answered_n, failed_n = answered_n + n, failed_n + x
    end
  end
  if answered_n + failed_n < rules.min_requests then return nil end
  return failed_n / (answered_n + failed_n)
end

local function blame(f, pid, status, lane, now, rules)
  local answered_n, failed_n = note_in_window(f, 'evf', now, rules.window_ms)
  local streak = (tonumber(f.v.c5xx) or 0) + 1
  local seen = f.v.c5xx_status
  if streak == 1 or seen == nil or seen == '' then
    seen = status
  elseif seen ~= status then
    seen = '5xx'
  end
  set_field(f, 'c5xx', streak)
  set_field(f, 'c5xx_status', seen)
  if f.v.ej_trial == '1' then
    -- Still out (a job it ran from before its ejection): nothing more to say.
    if (tonumber(f.v.ej_until) or 0) > now then return '' end
    return eject(f, pid, lane, 'trial', 'a ' .. status .. ' on its trial after an ejection', now, rules)
  end
  if rules.consecutive > 0 and streak >= rules.consecutive then
    local what = seen == '5xx' and '5xx answers' or (seen .. 's')
    return eject(f, pid, lane, 'consecutive_5xx', streak .. ' consecutive ' .. what .. ' on different requests',
                 now, rules)
  end
  local total = answered_n + failed_n
  if rules.rate > 0 and total >= rules.min_requests and failed_n / total >= rules.rate then
    local others = others_share(lane, pid, now, rules)
    if others == nil or others < failed_n / total / 2 then
      local beside = others and string.format(' (its lane\'s other providers %d%%)', math.floor(others * 100 + 0.5)) or ''
      return eject(f, pid, lane, 'failure_rate',
                   string.format('%d of its last %d requests answered 5xx%s', failed_n, total, beside), now, rules)
    end
  end
  return ''
end
