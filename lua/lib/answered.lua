-- answered: a provider answered a request (any status under 500: a 4xx is the caller's
-- business). Its fields `f` (EVIDENCE_FIELDS of lib/evidence_window.lua): the request
-- counts in its window, its streak of 5xx ends, and a trial after an ejection ends with
-- it (lib/eject.lua): the provider is back in full. The caller writes `f` back.
--!include lib/hash_fields.lua
--!include lib/evidence_window.lua

local function answered(f, now, rules)
  note_in_window(f, 'evn', now, rules.window_ms)
  if (tonumber(f.v.c5xx) or 0) ~= 0 then
    set_field(f, 'c5xx', 0)
    set_field(f, 'c5xx_status', '')
  end
  if f.v.ej_trial == '1' and (tonumber(f.v.ej_until) or 0) <= now then set_field(f, 'ej_trial', '') end
end
