-- Can provider hash `pkey` take work now (lib/takes_work.lua)? One read, outside a pump's
-- provider states (lib/provider_state.lua): a job's other candidates (lib/other_candidate.lua).
--!include lib/takes_work.lua

local function provider_ok(pkey, now)
  return takes_work(redis.call('HMGET', pkey, 'health', 'hb_exp', 'capacity', 'drain'), now)
end
