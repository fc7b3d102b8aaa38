-- May candidate `cand` run the job of record `rec`: does it serve the job's endpoint, and is
-- it the provider the job is pinned to, if any? Checked at dispatch whatever the lane: after
-- a reload a lane's key may stand for other providers than when the job was queued.

local function serves(cand, rec)
  if rec.pin ~= nil and rec.pin ~= cand.provider then return false end
  return string.find(cand.endpoints, ',' .. rec.endpoint .. ',', 1, true) ~= nil
end
