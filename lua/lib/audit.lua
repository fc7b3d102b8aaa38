-- One control action appended to the audit stream `key` (dispatcher/wire.py AuditEntry:
-- at, by, action, target, before, after, via -- before and after as JSON), capped at its
-- last `keep` entries (approximately: MAXLEN ~ trims whole macro nodes, cheaply), and
-- counted by action in hash `counts` (/metrics). In the same script as the action itself,
-- so that no action is done without its entry.

local function audit(key, counts, keep, at, by, action, target, before, after, via)
  redis.call('XADD', key, 'MAXLEN', '~', keep, '*', 'at', at, 'by', by, 'action', action, 'target', target,
             'before', before, 'after', after, 'via', via)
  redis.call('HINCRBY', counts, action, 1)
end
