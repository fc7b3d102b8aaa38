-- The tenant of a flow-controlled job id ('<tenant>~<id>'; dispatcher/tenants.py makes them).
local function tenant_of(job)
  return string.match(job, '^(.-)~') or 'default'
end
