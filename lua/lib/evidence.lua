-- settle_evidence: what a finished call says of its provider, and of the providers the same
-- job met before (finish.lua). `verdict`: 'ok' the provider answered (any status under
-- 500), '<status>' it answered a 5xx (a call that failed otherwise took the provider out
-- at once, in its worker, and brings no verdict here). `f`: the provider's fields
-- (EVIDENCE_FIELDS), written back by the caller; `rec`: the job's record, whose failed_5xx
-- lists the '<provider>|<status>' of its earlier 5xx (the caller appended this call's
-- before settle_lost, which keeps them with a requeued job); `outcome`: the finish's.
--
-- A 5xx is the provider's fault when another provider answered the same request: then
-- each one listed is blamed (lib/blame.lua). It is the request's when another provider
-- answered it 5xx too: nobody is blamed, and this provider counts it as excused_5xx. A
-- job that ends at its only 5xx (no other provider could try it) blames its provider:
-- the evidence of several such requests still takes a streak, and a lane never loses its
-- last provider to 5xx (lib/eject.lua). A job that ends otherwise (its client left, its
-- deadline passed while it waited for a retry) blames nobody.
-- `lane`: the job's lane (nil if the plan lacks it: nothing is ejected then). Returns the
-- ejections decided, in words, '; '-joined.
--!include lib/dispatch_plan.lua
--!include lib/hash_fields.lua
--!include lib/blame.lua
--!include lib/answered.lua

local function settle_evidence(f, pid, verdict, rec, outcome, lane, now, rules)
  local said = {}
  local function note(words)
    if words ~= '' then said[#said + 1] = words end
  end
  local failed = rec.failed_5xx or {}
  if verdict == 'ok' then
    answered(f, now, rules)
    for _, entry in ipairs(failed) do
      local other, status = string.match(entry, '^(.*)|(%d+)$')
      for _, cand in ipairs(lane and lane.candidates or {}) do
        if other ~= pid and cand.provider == other then
          local of = read_fields(KEYS[BASE + cand.provider_key], EVIDENCE_FIELDS)
          note(blame(of, other, status, lane, now, rules))
          flush_fields(of)
        end
      end
    end
  elseif outcome ~= 'requeued' and outcome ~= 'dropped' then
    if #failed <= 1 then
      note(blame(f, pid, verdict, lane, now, rules))
    else
      redis.call('HINCRBY', f.key, 'excused_5xx', 1)
    end
  end
  return table.concat(said, '; ')
end
