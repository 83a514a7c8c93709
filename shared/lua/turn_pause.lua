-- Pauses a turn for its caller in one call, fenced by the session lease: the round's
-- assistant message and its settled results are kept in the turn's calls hash (the
-- resume carries on with that round, the caller's answers added there), with the rows
-- that close the round if no answer comes; the record takes the status requires_action
-- and the pending calls; turn.requires_action goes on the turn stream and the session
-- log; the envelope's turnStatus follows; the lease is released; the turn's mark in its
-- slot's outbox is set to fall due at the wait's deadline (the sweeper then enqueues the
-- turn, and the worker that starts it ends it action_timeout). A cancel asked for since
-- the round began wins: nothing is written.
-- KEYS: 1 lease, 2 turn hash, 3 turn events, 4 the turn's calls hash, 5 envelope,
--       6 session log, 7 the slot's outbox
-- ARGV: 1 lease token, 2 now ms, 3 round, 4 assistant row, 5 pending calls JSON,
--       6 turn.requires_action JSON, 7 deadline ms, 8 outbox score, 9 outbox member,
--       10 events MAXLEN, 11 log MAXLEN, 12 meta byte budget, 13 session id,
--       14 calls hash expiry ms, 15 16 the closing rows ("" = none),
--       then call id and result (JSON) pairs of the settled calls
-- Replies: "paused" | "cancel" | "fenced"
-- include: envelope.lua
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  -- A resent call whose first try was stored (its reply lost) finds the turn paused.
  if redis.call('HGET', KEYS[2], 'status') == STATUS.requires_action
      and redis.call('HGET', KEYS[4], 'round') == ARGV[3] then
    return 'paused'
  end
  return 'fenced'
end
if redis.call('HGET', KEYS[2], 'cancelRequested') == '1' then return 'cancel' end

if redis.call('HGET', KEYS[4], 'round') ~= ARGV[3] then redis.call('DEL', KEYS[4]) end
local fields = {'round', ARGV[3], 'assistant', ARGV[4], 'paused', '1'}
if ARGV[15] ~= '' then
  fields[#fields + 1] = 'close:1'
  fields[#fields + 1] = ARGV[15]
  fields[#fields + 1] = 'close:2'
  fields[#fields + 1] = ARGV[16]
end
redis.call('HSET', KEYS[4], unpack(fields))
for i = 17, #ARGV, 2 do
  -- A side-effecting call's result may be stored already: it stays as it is.
  redis.call('HSETNX', KEYS[4], 'result:' .. ARGV[i], ARGV[i + 1])
end
redis.call('PEXPIRE', KEYS[4], ARGV[14])

redis.call('HSET', KEYS[2], 'status', STATUS.requires_action, 'pendingCalls', ARGV[5],
  'pausedAt', ARGV[2], 'actionDeadline', ARGV[7])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[10], '*', 'data', ARGV[6])
redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[11], '*', 'data', ARGV[6])
local env = redis.call('HGETALL', KEYS[5])
if #env > 0 then
  worker_overlay(KEYS[5], env, {'turnStatus', STATUS.requires_action}, ARGV[2], ARGV[12],
    KEYS[6], ARGV[11], ARGV[13])
end
redis.call('DEL', KEYS[1])
redis.call('ZADD', KEYS[7], ARGV[8], ARGV[9])
return 'paused'
