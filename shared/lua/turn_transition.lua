-- Cancels one turn, refusing any move out of a terminal state, so a turn gets exactly
-- one terminal event however many parties race to end it: a queued turn ends at once;
-- a running one is flagged and announced, and its worker ends it. A turn paused for its
-- caller (requires_action) ends at once too: the rows its pause kept (the paused round,
-- its pending calls closed by a synthetic error result) go into the history, so no
-- tool_use is left there without its result, and the envelope's turnStatus follows. Its
-- record keeps the calls it waited on (pendingCalls). A turn ended here (queued or
-- paused) has its webhook queued in the same call; a paused one with turns queued
-- behind it is announced on the cancel channel, so their workers look at once.
-- KEYS: 1 turn hash, 2 active list, 3 turn events stream, 4 session log,
--       5 the turn's calls hash, 6 history (messages), 7 envelope,
--       8 the slot's webhook outbox
-- ARGV: 1 action: "cancel"
--       2 now ms, 3 turn id, 4 fields JSON (strings) to set,
--       5 terminal event JSON, 6 events MAXLEN, 7 log MAXLEN,
--       8 events TTL s, 9 cancel channel, 10 cancel message,
--       11 meta byte budget, 12 session id, 13 the turn's webhook outbox member
-- Replies: {"ended", eventId} (was queued or paused) | {"requested"} (running)
--          | {"terminal", status} | {"not_found"}
-- include: contracts.lua
-- include: envelope.lua
-- include: webhook.lua
local action = ARGV[1]
if action ~= 'cancel' then return redis.error_reply('unknown action ' .. tostring(action)) end
local stored = redis.call('HMGET', KEYS[1], 'status', 'webhook')
local status = stored[1]
if not status then return {'not_found'} end
if TERMINAL_STATUSES[status] then return {'terminal', status} end

if status == STATUS.requires_action then
  local rows = redis.call('HMGET', KEYS[5], 'close:1', 'close:2')
  if rows[1] and rows[2] and rows[1] ~= '' then
    redis.call('RPUSH', KEYS[6], rows[1], rows[2])
  end
  local env = redis.call('HGETALL', KEYS[7])
  if #env > 0 then
    worker_overlay(KEYS[7], env, {'turnStatus', STATUS.cancelled}, ARGV[2], ARGV[11], KEYS[4],
      ARGV[7], ARGV[12])
  end
end

if status == STATUS.queued or status == STATUS.requires_action then
  local args = {}
  for k, v in pairs(cjson.decode(ARGV[4])) do
    table.insert(args, k)
    table.insert(args, v)
  end
  table.insert(args, 'status')
  table.insert(args, STATUS.cancelled)
  table.insert(args, 'endedAt')
  table.insert(args, ARGV[2])
  redis.call('HSET', KEYS[1], unpack(args))
  redis.call('LREM', KEYS[2], 0, ARGV[3])
  local id = redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'data', ARGV[5])
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'data', ARGV[5])
  -- A finished turn's record and events are kept for the events TTL, then expire.
  redis.call('EXPIRE', KEYS[3], ARGV[8])
  redis.call('EXPIRE', KEYS[1], ARGV[8])
  webhook_queue(KEYS[1], KEYS[8], ARGV[13], ARGV[3], stored[2], ARGV[2])
  -- A turn queued behind a paused one looks at its session only every few seconds:
  -- the cancel message tells the workers to wake it.
  if status == STATUS.requires_action and redis.call('LLEN', KEYS[2]) > 0 then
    redis.call('PUBLISH', ARGV[9], ARGV[10])
  end
  return {'ended', id}
end
redis.call('HSET', KEYS[1], 'cancelRequested', '1')
redis.call('PUBLISH', ARGV[9], ARGV[10])
return {'requested'}
