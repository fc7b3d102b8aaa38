-- audit: a control action taken outside the scripts that act -- a reload, a qualification
-- run -- appended to the audit stream (lib/audit.lua). Every process reloads the same file
-- on its own: with a `once` key, the entry is written only by the first to bring `digest`
-- (the file's content), so a reload of the fleet is one entry, not one per process.
--
-- KEYS[1] audit stream   KEYS[2] audit counts   KEYS[3] once key (optional)
-- ARGV[1] entries kept   ARGV[2] by   ARGV[3] action   ARGV[4] target
-- ARGV[5] before (JSON)  ARGV[6] after (JSON)   ARGV[7] via   ARGV[8] digest (with KEYS[3])
-- Returns 1 when the entry was written, 0 when another process wrote it for this digest.
--!include lib/now_ms.lua
--!include lib/audit.lua

if KEYS[3] then
  if redis.call('GET', KEYS[3]) == ARGV[8] then return 0 end
  redis.call('SET', KEYS[3], ARGV[8], 'PX', 86400000)
end
audit(KEYS[1], KEYS[2], ARGV[1], now_ms(), ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7])
return 1
