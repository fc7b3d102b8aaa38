-- Is provider `pid` one the job of record `rec` must not go to: it failed the job before
-- (finish.lua's 'retry': `excluded`, which lib/route.lua drops when they are the job's only
-- chance left), or it never may (`never`: a continuation's providers that cannot continue,
-- lua/submit.lua)? No table is made: this runs for every candidate a pump looks at.

local function excluded(rec, pid)
  if rec == nil then return false end
  if rec.excluded ~= nil then
    for _, p in ipairs(rec.excluded) do
      if p == pid then return true end
    end
  end
  if rec.never ~= nil then
    for _, p in ipairs(rec.never) do
      if p == pid then return true end
    end
  end
  return false
end
