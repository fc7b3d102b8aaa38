-- May provider state `s` (lib/provider_state.lua), a home of a job's prompt in `lane`, take
-- that job (lib/affine.lua): a free slot, or a place in its home queue -- in_flight under
-- capacity x (1 + lane.home_queue), where the job waits in the engine's queue with its
-- prefix cached rather than run uncached elsewhere. A firm provider (on trial, held by a
-- rate limit) has no home queue. Work that is no one's hit never goes past capacity.

local function home_room(lane, s)
  if s.inf < s.cap then return true end
  if s.firm or lane.home_queue <= 0 then return false end
  return s.inf < s.cap + math.floor(lane.home_queue * s.cap + 1e-9)
end
