-- Ends a turn in one call: the last history rows and events of the attempt, the final
-- status and the one terminal event (turn stream and session log), the envelope's
-- turnStatus and usage, the lease released. A turn that already ended is not ended
-- again. The rows, the events before the terminal one and the envelope are written only
-- while the lease holds the token. The work entry is acked by the caller afterwards:
-- the work stream is on another cluster slot.
-- KEYS: 1 turn hash, 2 active list, 3 turn events, 4 session log, 5 lease, 6 envelope,
--       7 history (messages), 8 the slot's webhook outbox
-- ARGV: 1 turn id, 2 lease token ("" = none), 3 now ms, 4 record field count F,
--       5 terminal event JSON, 6 events MAXLEN, 7 log MAXLEN, 8 events TTL s,
--       9 the session lifetime in ms ("" = none), 10 the turn's webhook outbox member,
--       11 session id,
--       12 meta byte budget, 13 envelope patch field count P, 14 history mode ("" |
--       "append" | "replace"), 15 rows to drop, 16 event count N,
--       17 the record's webhook ("" = none), 18 .. 17+N events,
--       then F record fields and values (status…), P envelope fields and values, the rows
-- (Flat fields, not JSON: a decode in Lua costs more than the few fields it yields.)
-- Replies: {"ended", event id} | {"terminal", status} | {"not_found"}
-- include: contracts.lua
-- include: envelope.lua
-- include: lifetime.lua
-- include: webhook.lua
local held = ARGV[2] ~= '' and redis.call('GET', KEYS[5]) == ARGV[2]
if not held then
  -- Only the lease holder ends a running turn; without the lease, look first.
  local status = redis.call('HGET', KEYS[1], 'status')
  if not status then
    return {'not_found'}
  end
  if TERMINAL_STATUSES[status] then
    return {'terminal', status}
  end
end

local n = tonumber(ARGV[16])
local rec_at = 18 + n
local patch_at = rec_at + 2 * tonumber(ARGV[4])
local rows_at = patch_at + 2 * tonumber(ARGV[13])
if held then
  if ARGV[14] == 'replace' then
    redis.call('DEL', KEYS[7])
  elseif ARGV[14] == 'append' and tonumber(ARGV[15]) > 0 then
    redis.call('LTRIM', KEYS[7], tonumber(ARGV[15]), -1)
  end
  if ARGV[14] ~= '' and #ARGV >= rows_at then
    redis.call('RPUSH', KEYS[7], unpack(ARGV, rows_at))
  end
  -- The stream is trimmed by the terminal event, appended next.
  for i = 18, 17 + n do
    redis.call('XADD', KEYS[3], '*', 'data', ARGV[i])
  end
end

redis.call('HSET', KEYS[1], 'endedAt', ARGV[3], unpack(ARGV, rec_at, patch_at - 1))
redis.call('LREM', KEYS[2], 0, ARGV[1])
local id = redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'data', ARGV[5])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'data', ARGV[5])
-- A finished turn's record and events are kept for the events TTL, then expire.
redis.call('EXPIRE', KEYS[3], ARGV[8])
redis.call('EXPIRE', KEYS[1], ARGV[8])
-- The session's keys (the envelope's name less ":env") live on from this end.
session_lifetime(string.sub(KEYS[6], 1, -5), ARGV[9], {KEYS[1], KEYS[3]})
webhook_queue(KEYS[1], KEYS[8], ARGV[10], ARGV[1], ARGV[17], ARGV[3])

if held then
  local env = redis.call('HGETALL', KEYS[6])
  if #env > 0 then
    worker_overlay(KEYS[6], env, {unpack(ARGV, patch_at, rows_at - 1)}, ARGV[3], ARGV[12],
      KEYS[4], ARGV[7], ARGV[11])
  end
  redis.call('DEL', KEYS[5])
end
return {'ended', id}
