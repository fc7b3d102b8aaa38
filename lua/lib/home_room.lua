-- May provider state `s` (lib/provider_state.lua), a home of a job's prompt in `lane`, take
-- that job (lib/affine.lua): a free slot, or a place in its home queue -- in_flight under
-- capacity x (1 + lane.home_queue), where the job waits in the engine's queue with its
-- prefix cached rather than run uncached elsewhere. A firm provider (on trial, held by a
-- rate limit) has no home queue. Work that is no one's hit never goes past capacity.
-- `rec` (nil: any job; lib/any_home_room.lua asks for the lane): a job goes to a home's
-- queue only if it starts there within its deadline and the wait it was admitted for
-- (rec.predict_ms: the caller's deadline, or the model's refuse_predicted_over_ms), a slot
-- freeing there every svc / cap on average: what would wait longer waits in iop, where
-- deadlines and load shedding see it. `now`: the pump() call's time.

local function home_room(lane, s, rec, now)
  if s.inf < s.cap then return true end
  if s.firm or lane.home_queue <= 0 then return false end
  if s.inf >= s.cap + math.floor(lane.home_queue * s.cap + 1e-9) then return false end
  if rec == nil or s.svc <= 0 or s.cap <= 0 then return true end
  local ends = rec.deadline_ms or 0
  if rec.predict_ms then ends = math.min(ends, (rec.submitted_ms or now) + rec.predict_ms) end
  return now + (s.inf - s.cap + 1) * s.svc / s.cap <= ends
end
