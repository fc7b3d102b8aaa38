-- A provider's recent answers, for the 5xx rate that may eject it (lib/blame.lua): requests it
-- answered (evn) and 5xx counted against it (evf) in the current bucket of half the window
-- (ev_b, its number: server ms / half), and in the one before (evn0, evf0). A bucket two
-- back is forgotten when a newer one opens, so the window covers between a half and a whole
-- of EJECTION.window_ms.
--!include lib/hash_fields.lua

-- The fields the window, the streak and the ejection state live in (every reader asks them all).
local EVIDENCE_FIELDS = {'ev_b', 'evn', 'evf', 'evn0', 'evf0', 'c5xx', 'c5xx_status', 'ej_until', 'ej_trial',
                         'ej_count'}

local function bucket_of(now, window_ms)
  return math.floor(now / math.max(math.floor(window_ms / 2), 1))
end

-- The window of provider fields `f` (read with EVIDENCE_FIELDS) as of bucket `b`: answered,
-- failed (both buckets together). `roll`: write the rolled buckets back into `f`.
local function window_of(f, b, roll)
  local vb = tonumber(f.v.ev_b)
  local n, x, n0, x0 = tonumber(f.v.evn) or 0, tonumber(f.v.evf) or 0, tonumber(f.v.evn0) or 0, tonumber(f.v.evf0) or 0
  if vb ~= b then
    if vb == b - 1 then
      n0, x0 = n, x
    else
      -- Older than the bucket before, or ahead (a new primary's clock behind): start afresh.
      n0, x0 = 0, 0
    end
    n, x = 0, 0
    if roll then
      set_field(f, 'ev_b', b)
      set_field(f, 'evn', 0)
      set_field(f, 'evf', 0)
      set_field(f, 'evn0', n0)
      set_field(f, 'evf0', x0)
    end
  end
  return n + n0, x + x0
end

-- Count one request of provider fields `f` in its window: `field` 'evn' answered, 'evf' a 5xx
-- counted against it. Returns the window's answered and failed after it.
local function note_in_window(f, field, now, window_ms)
  local answered, failed = window_of(f, bucket_of(now, window_ms), true)
  set_field(f, field, (tonumber(f.v[field]) or 0) + 1)
  if field == 'evn' then return answered + 1, failed end
  return answered, failed + 1
end
