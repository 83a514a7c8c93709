-- Records one POST of a turn's webhook on its record (the latest ARGV[5] kept) and moves
-- the turn's mark in the webhook outbox: due again at ARGV[4] (a retry), or gone
-- (delivered, or the retry window closed). A webhook another sender already delivered
-- is left as it is.
-- KEYS: 1 the slot's webhook outbox, 2 turn hash
-- ARGV: 1 the turn's outbox member, 2 the attempt (JSON), 3 the state it leaves
--       ("delivered" | "pending" | "failed"), 4 the next attempt's ms ("" = none),
--       5 attempts kept
-- Reply: "recorded" | "delivered" (already) | "gone" (the record expired)
local stored = redis.call('HGET', KEYS[2], 'webhook')
if not stored then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 'gone'
end
local hook = cjson.decode(stored)
if hook.state == 'delivered' then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 'delivered'
end
local attempts = hook.attempts or {}
table.insert(attempts, cjson.decode(ARGV[2]))
while #attempts > tonumber(ARGV[5]) do table.remove(attempts, 1) end
hook.attempts = attempts
hook.state = ARGV[3]
if ARGV[4] ~= '' then
  hook.nextAttemptAt = tonumber(ARGV[4])
  redis.call('ZADD', KEYS[1], ARGV[4], ARGV[1])
else
  hook.nextAttemptAt = nil
  redis.call('ZREM', KEYS[1], ARGV[1])
end
redis.call('HSET', KEYS[2], 'webhook', cjson.encode(hook))
return 'recorded'
