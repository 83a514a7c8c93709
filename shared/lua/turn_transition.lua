-- Moves one turn between states, refusing any move out of a terminal state, so a
-- turn gets exactly one terminal event however many parties race to end it.
-- KEYS: 1 turn hash, 2 active list, 3 turn events stream, 4 session log
-- ARGV: 1 action: "start" | "finalize" | "cancel"
--       2 now ms, 3 turn id, 4 fields JSON (strings) to set,
--       5 terminal event JSON ("" for start), 6 events MAXLEN, 7 log MAXLEN,
--       8 events TTL s, 9 cancel channel, 10 cancel message
-- Replies:
--   start    {"started", flat record} | {"terminal", status} | {"not_found"}
--   finalize {"ended", eventId}        | {"terminal", status} | {"not_found"}
--   cancel   {"ended", eventId} (was queued) | {"requested"} (running)
--            | {"terminal", status} | {"not_found"}
-- include: statuses.lua
local action = ARGV[1]
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {'not_found'} end
if TERMINAL_STATUSES[status] then return {'terminal', status} end

local function set_fields(extra)
  local args = {}
  for k, v in pairs(cjson.decode(ARGV[4])) do
    table.insert(args, k)
    table.insert(args, v)
  end
  for k, v in pairs(extra) do
    table.insert(args, k)
    table.insert(args, v)
  end
  if #args > 0 then redis.call('HSET', KEYS[1], unpack(args)) end
end

local function finish(final_status)
  set_fields({status = final_status, endedAt = ARGV[2]})
  redis.call('LREM', KEYS[2], 0, ARGV[3])
  local id = redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'data', ARGV[5])
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'data', ARGV[5])
  -- A finished turn's record and events are kept for the events TTL, then expire.
  redis.call('EXPIRE', KEYS[3], ARGV[8])
  redis.call('EXPIRE', KEYS[1], ARGV[8])
  return {'ended', id}
end

if action == 'start' then
  redis.call('HINCRBY', KEYS[1], 'attempt', 1)
  -- startedAt is the first attempt's: a redelivery does not restart the turn's clock.
  redis.call('HSETNX', KEYS[1], 'startedAt', ARGV[2])
  set_fields({status = 'running'})
  return {'started', redis.call('HGETALL', KEYS[1])}
elseif action == 'finalize' then
  local final_status = cjson.decode(ARGV[4])['status']
  return finish(final_status)
elseif action == 'cancel' then
  if status == 'queued' then
    return finish('cancelled')
  end
  redis.call('HSET', KEYS[1], 'cancelRequested', '1')
  redis.call('PUBLISH', ARGV[9], ARGV[10])
  return {'requested'}
end
return redis.error_reply('unknown action ' .. tostring(action))
