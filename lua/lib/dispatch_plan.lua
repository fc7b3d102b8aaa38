-- The dispatch plan of the call and its keys: read once, at the script's top, by every
-- script that pumps or refuses (lib/pump.lua, lib/refuse_plan.lua, ...); what it sets up is
-- the script's, the same for every pump() it runs. Never run alone.
--
-- A script that includes this file takes, besides KEYS[1..4] of lib/jobs.lua:
--   KEYS[5]   fence counter  one INCR per dispatch (floored at 10 x server ms): the fencing
--             token (lib/assign.lua)
--   ARGV[1]   the plan's id (dispatcher/plans.py: a digest of its content)
--   ARGV[2]   offset of the plan's keys in KEYS: KEYS[offset + 1] the plan hash, + 2 the set
--             of its lane queue keys, + 3 the index of lanes that may hold jobs; then the
--             keys its lanes name by position (queues, providers, nodes, flow control's)
--   ARGV[3]   lease ms given to a fresh dispatch
--
-- The plan lives in Redis, written once by whichever process first needs it
-- (lua/plan.lua), so a call sends its id, not its lanes: a provider in 240 lanes would
-- otherwise send and decode them all on every finish. Its hash holds field '' -> the
-- header (dispatcher/wire.py PlanHeader) and <queue key> -> that lane (wire.LaneSpec).
-- A call whose plan is missing (a new Redis, a failover that lost it, its TTL) changes
-- nothing and fails 'NOPLAN': the caller writes the plan and calls again.
--!include lib/jobs.lua

local PLAN_ID, BASE, LEASE_MS = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local FENCE = KEYS[5]
local PLAN_KEY, PLAN_LANES, WAITING = KEYS[BASE + 1], KEYS[BASE + 2], KEYS[BASE + 3]
local PLAN_RAW = redis.call('HGET', PLAN_KEY, '')
if not PLAN_RAW then
  return redis.error_reply('NOPLAN plan ' .. PLAN_ID .. ' is not in Redis')
end
local PLAN = cjson.decode(PLAN_RAW)
-- Flow control's keys (nil without it: no tenant is looked at).
local FAIR = nil
if PLAN.fair then
  FAIR = {lim = KEYS[BASE + PLAN.limits], v = KEYS[BASE + PLAN.vtime], f = KEYS[BASE + PLAN.ftags],
          park = PLAN.park}
  counts_in(KEYS[BASE + PLAN.tenants])
end
-- The plan's lanes read so far, by queue key (false: the plan has no lane there): filled
-- by lib/lanes_with_jobs.lua and lib/lane_at.lua, so a lane is decoded once per script.
local lane_cache = {}
