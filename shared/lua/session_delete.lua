-- Deletes every key of one session in one step, and its turns' marks in the slot's
-- outbox.
-- KEYS: env, log, messages, lease, turns index, active list, idempotency index,
--       8 the slot's outbox (shared with other sessions: not deleted)
-- ARGV[1]: the session's key base "<prefix>:{<user>:<session>}",
-- ARGV[2]: its outbox members' start "<user>:<session>:"
-- Turn and idempotency keys are named from their indexes; they share the hash
-- tag of KEYS, so the script still touches a single cluster slot.
local base = ARGV[1]
for _, tid in ipairs(redis.call('ZRANGE', KEYS[5], 0, -1)) do
  redis.call('DEL', base .. ':turn:' .. tid, base .. ':turn:' .. tid .. ':events',
    base .. ':turn:' .. tid .. ':calls')
  redis.call('ZREM', KEYS[8], ARGV[2] .. tid)
end
for _, digest in ipairs(redis.call('ZRANGE', KEYS[7], 0, -1)) do
  redis.call('DEL', base .. ':idem:' .. digest)
end
local existed = redis.call('EXISTS', KEYS[1])
redis.call('DEL', unpack(KEYS, 1, 7))
return existed
