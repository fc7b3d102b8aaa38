-- The lane's first waiting job past the `skip` ones the pump found blocked, and its score
-- (nil: none; a lane found empty leaves the index, lib/emptied.lua). Its deadline is looked
-- at only when it is the one to run (lib/live.lua): one read per lane.
--!include lib/queue_of.lua
--!include lib/emptied.lua

local function first_waiting(lane, skip)
  local h = redis.call('ZRANGE', queue_of(lane), skip, skip, 'WITHSCORES')
  if #h == 0 then
    if skip == 0 then emptied(queue_of(lane)) end
    return nil
  end
  return h[1], tonumber(h[2])
end
