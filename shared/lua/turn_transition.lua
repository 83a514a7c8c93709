-- Cancels one turn, refusing any move out of a terminal state, so a turn gets exactly
-- one terminal event however many parties race to end it: a queued turn ends at once;
-- a running one is flagged and announced, and its worker ends it.
-- KEYS: 1 turn hash, 2 active list, 3 turn events stream, 4 session log,
--       5 the slot's webhook outbox
-- ARGV: 1 action: "cancel"
--       2 now ms, 3 turn id, 4 fields JSON (strings) to set,
--       5 terminal event JSON, 6 events MAXLEN, 7 log MAXLEN,
--       8 events TTL s, 9 cancel channel, 10 cancel message,
--       11 the turn's webhook outbox member
-- Replies: {"ended", eventId} (was queued) | {"requested"} (running)
--          | {"terminal", status} | {"not_found"}
-- include: statuses.lua
-- include: webhook.lua
local action = ARGV[1]
if action ~= 'cancel' then return redis.error_reply('unknown action ' .. tostring(action)) end
local stored = redis.call('HMGET', KEYS[1], 'status', 'webhook')
local status = stored[1]
if not status then return {'not_found'} end
if TERMINAL_STATUSES[status] then return {'terminal', status} end

if status == 'queued' then
  local args = {}
  for k, v in pairs(cjson.decode(ARGV[4])) do
    table.insert(args, k)
    table.insert(args, v)
  end
  table.insert(args, 'status')
  table.insert(args, 'cancelled')
  table.insert(args, 'endedAt')
  table.insert(args, ARGV[2])
  redis.call('HSET', KEYS[1], unpack(args))
  redis.call('LREM', KEYS[2], 0, ARGV[3])
  local id = redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'data', ARGV[5])
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'data', ARGV[5])
  -- A finished turn's record and events are kept for the events TTL, then expire.
  redis.call('EXPIRE', KEYS[3], ARGV[8])
  redis.call('EXPIRE', KEYS[1], ARGV[8])
  webhook_queue(KEYS[1], KEYS[5], ARGV[11], ARGV[3], stored[2], ARGV[2])
  return {'ended', id}
end
redis.call('HSET', KEYS[1], 'cancelRequested', '1')
redis.call('PUBLISH', ARGV[9], ARGV[10])
return {'requested'}
