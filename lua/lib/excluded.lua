-- Is provider `pid` one the job of record `rec` must not go to again (it failed the job
-- before: finish.lua's 'retry')?

local function excluded(rec, pid)
  if rec == nil or rec.excluded == nil then return false end
  for _, p in ipairs(rec.excluded) do
    if p == pid then return true end
  end
  return false
end
