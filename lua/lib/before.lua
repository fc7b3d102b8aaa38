-- The ordering of lane heads {lane, job, score} (lib/next_head.lua): does `a` go before `b`?
-- Without flow control, by submit sequence (the score: plain FIFO); with it, by band, then
-- fair tag (the score), then job id.
--!include lib/dispatch_plan.lua

local function before(a, b)
  if FAIR == nil then return a.score < b.score end
  if a.lane.band ~= b.lane.band then return a.lane.band < b.lane.band end
  if a.score ~= b.score then return a.score < b.score end
  return a.job < b.job
end
