-- A hash's fields read in one HMGET and what changed written back in one HSET, so that the
-- several bookkeepers of one script (a provider's token window, its totals, its 5xx
-- evidence) cost two commands together. A missing field reads nil.

local function read_fields(key, names)
  local values = redis.call('HMGET', key, unpack(names))
  local fields = {key = key, v = {}, changed = {}}
  for i, name in ipairs(names) do
    fields.v[name] = values[i] or nil
  end
  return fields
end

local function set_field(fields, name, value)
  fields.v[name] = value
  fields.changed[name] = true
end

local function flush_fields(fields)
  local names = {}
  for name in pairs(fields.changed) do names[#names + 1] = name end
  if #names == 0 then return end
  table.sort(names)  -- the same command for the same changes
  local args = {}
  for _, name in ipairs(names) do
    args[#args + 1], args[#args + 2] = name, fields.v[name]
  end
  redis.call('HSET', fields.key, unpack(args))
  fields.changed = {}
end
