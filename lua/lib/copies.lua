-- The fleet's copies of models that load and unload: `{iop}:copies` (the plan header's
-- `copies`), model id -> ',<provider>,...,' the managed providers whose runtime holds it
-- loaded. Written wherever a model on a managed provider becomes loaded or stops being so
-- (lua/models.lua, lua/load_done.lua, lib/place.lua), for every model id served as it there
-- (`mm:<served>`, lua/models.lua); read by lib/model_room.lua: a copy with another copy
-- elsewhere is a spare, which may make room for a model loaded nowhere.
--!include lib/dispatch_plan.lua

-- ',a,b,' without the ',<provider>,' of `mark` (found plainly: ids may hold pattern characters).
local function without(list, mark)
  local i = string.find(list, mark, 1, true)
  if i == nil then return list end
  return string.sub(list, 1, i) .. string.sub(list, i + #mark)
end

local function copies_key()
  if PLAN.copies == nil or PLAN.copies == 0 then return nil end
  return KEYS[BASE + PLAN.copies]
end

-- Provider `provider` holds the models of `ids` (comma-separated model ids) loaded, or not.
local function note_copies(ids, provider, held)
  local key = copies_key()
  if key == nil or ids == nil or ids == '' then return end
  local mark = ',' .. provider .. ','
  for id in string.gmatch(ids, '[^,]+') do
    local now = redis.call('HGET', key, id) or ','
    local has = string.find(now, mark, 1, true) ~= nil
    if held and not has then
      redis.call('HSET', key, id, now .. provider .. ',')
    elseif not held and has then
      local rest = without(now, mark)
      if rest == ',' then redis.call('HDEL', key, id) else redis.call('HSET', key, id, rest) end
    end
  end
end

-- Do other providers than `provider` hold every model of `ids` loaded?
local function spare_copy(ids, provider)
  local key = copies_key()
  if key == nil or ids == nil or ids == '' then return false end
  local mark = ',' .. provider .. ','
  for id in string.gmatch(ids, '[^,]+') do
    local now = redis.call('HGET', key, id) or ','
    if without(now, mark) == ',' then return false end
  end
  return true
end
