-- The webhook sender's claim on one slot's webhook outbox: up to ARGV[4] deliveries due
-- by now, each pushed a lease ahead (no other sender takes it meanwhile; one that dies
-- mid-POST leaves it due again when the lease ends, so a webhook may be sent twice and
-- is never lost), each with its turn's record. A mark whose record is gone (expired,
-- deleted) or whose webhook is no longer pending is dropped.
-- KEYS: 1 a slot's webhook outbox
-- ARGV: 1 key prefix, 2 now ms, 3 lease ms, 4 most deliveries to claim
-- Reply: {member, flat record, member, flat record, ...}
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[2], 'LIMIT', 0,
  tonumber(ARGV[4]))
local until_ms = tonumber(ARGV[2]) + tonumber(ARGV[3])
local out = {}
for _, member in ipairs(due) do
  local user, session, tid = string.match(member, '^([^:]+):([^:]+):([^:]+)$')
  local rec = {}
  if tid then
    rec = redis.call('HGETALL', ARGV[1] .. ':{' .. user .. ':' .. session .. '}:turn:' .. tid)
  end
  local pending = false
  for i = 1, #rec, 2 do
    if rec[i] == 'webhook' then
      pending = string.find(rec[i + 1], '"state":"pending"', 1, true) ~= nil
    end
  end
  if pending then
    redis.call('ZADD', KEYS[1], until_ms, member)
    table.insert(out, member)
    table.insert(out, rec)
  else
    redis.call('ZREM', KEYS[1], member)
  end
end
return out
