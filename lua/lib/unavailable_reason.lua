-- Why a provider cannot take work now, in words ('' when it can; nil when it cannot but may
-- be about to: see below). dispatcher/wire.py ProviderHealth is this rule in Python (the
-- catalog's health), held to it by tests/dispatcher/test_wire.py. A provider whose worker is
-- silent (never heard of, or a heartbeat past its TTL) counts as down only when
-- `silent_is_down`: a reaper round says so, which knows whether Redis itself was away (no
-- heartbeat could land then), and only within an observation gap of its opening
-- (dispatcher/wire.py Refusal); a submit or a heartbeat does not. A provider whose worker is
-- leaving (SIGTERM: workers/worker.py marks it `leaving`) is treated as that worker's silence
-- until its heartbeat's TTL: another worker of the node (a rolling restart) takes it over with
-- its next heartbeat, and nobody is refused in between.

local function unavailable_reason(pkey, now, silent_is_down)
  local v = redis.call('HMGET', pkey, 'health', 'hb_exp', 'capacity', 'drain', 'hb_ms', 'reason', 'removed', 'leaving', 'off')
  -- A reload removed it: processes not yet reloaded may still name it as a lane's only
  -- provider, while in the new config other providers serve that key (or reaper rounds
  -- move its jobs there). Not a reason to refuse.
  if (v[7] or '') ~= '' then return nil end
  if not v[5] then
    return silent_is_down and 'never seen: no heartbeat from its worker yet' or nil
  end
  if (v[8] or '') ~= '' then
    if (tonumber(v[2]) or 0) >= now or not silent_is_down then return nil end
    return string.format('its worker left %.1fs ago and no other worker of its node took it over',
      (now - (tonumber(v[5]) or 0)) / 1000)
  end
  if (tonumber(v[2]) or 0) < now then
    if not silent_is_down then return nil end
    return string.format('stale heartbeat: last one %.1fs ago', (now - (tonumber(v[5]) or 0)) / 1000)
  end
  if v[1] ~= 'available' then return (v[6] and v[6] ~= '') and v[6] or 'reported unavailable' end
  if (v[4] or '') ~= '' then return 'drained by an operator' end
  if (v[9] or '') ~= '' then return 'disabled by an operator' end
  if (tonumber(v[3]) or 0) <= 0 then return 'capacity 0' end
  return ''
end
