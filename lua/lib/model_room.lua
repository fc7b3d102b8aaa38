-- Has provider `provider` (hash `pkey`) room to load model `served` (lib/place.lua), and
-- what must go first: true and nil when it holds fewer than its max_loaded models (counting
-- one being loaded); true and the model to unload when one it holds may go -- loaded,
-- nothing of iop's running on it there, and either
--   idle:  unused (nor loaded) there for at least its unload_idle_ms, and no job waiting for
--          it anywhere (a lane of one of the model ids it serves as, lua/models.lua `mq:`, is
--          in the index of lanes that may hold jobs), or
--   spare: loaded there for at least unload_idle_ms, and held loaded by another provider
--          too (lib/copies.lua): its requests go on there, and a copy that warm-first
--          routing keeps busy with a share of them never turns idle;
-- the idle ones before the spares, the least recently used first (ties: the lowest name).
-- False when none may. `order`: the provider's lib/load_order.lua. Reads the whole provider
-- hash: run only once a load is worth placing.
--!include lib/dispatch_plan.lua
--!include lib/copies.lua

local function waiting_for(ctx, prefixes)
  if prefixes == nil or prefixes == '' then return false end
  if ctx.waiting_lanes == nil then ctx.waiting_lanes = redis.call('SMEMBERS', WAITING) end
  for prefix in string.gmatch(prefixes, '[^\n]+') do
    local n = #prefix
    for _, q in ipairs(ctx.waiting_lanes) do
      if string.sub(q, 1, n) == prefix then
        local next_char = string.sub(q, n + 1, n + 1)
        if next_char == '' or next_char == '|' or next_char == '#' then return true end
      end
    end
  end
  return false
end

local function model_room(ctx, provider, pkey, served, order)
  local flat = redis.call('HGETALL', pkey)
  local f = {}
  for i = 1, #flat, 2 do f[flat[i]] = flat[i + 1] end
  local held, victim, victim_rank = 0, nil, nil
  for field, state in pairs(f) do
    if string.sub(field, 1, 3) == 'ms:' then
      local name = string.sub(field, 4)
      if name ~= served and (state == 'loaded' or state == 'loading' or state == 'unloading') then
        held = held + 1
        local since = tonumber(f['mt:' .. name]) or 0
        local used = math.max(tonumber(f['mu:' .. name]) or 0, since)
        if state == 'loaded' and (tonumber(f['mr:' .. name]) or 0) <= 0 then
          local rank = nil
          if ctx.now - used >= order.idle_ms and not waiting_for(ctx, f['mq:' .. name]) then
            rank = used
          elseif ctx.now - since >= order.idle_ms and spare_copy(f['mm:' .. name], provider) then
            rank = ctx.now + used  -- after every idle one
          end
          if rank ~= nil and (victim == nil or rank < victim_rank or (rank == victim_rank and name < victim)) then
            victim, victim_rank = name, rank
          end
        end
      end
    end
  end
  if held < order.max_loaded then return true, nil end
  if victim ~= nil then return true, victim end
  return false, nil
end
