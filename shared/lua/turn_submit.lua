-- Accepts one turn: the turn record, its indexes, its turn.queued event and its mark
-- in the slot's outbox are written together. The work entry goes on the shard's
-- stream in a second call (that stream is on another slot); the mark stays until a
-- worker starts the turn, so a sweeper enqueues any accepted turn whose entry was lost.
-- The first turn of a session without a title names it (ARGV 14): the host-owned
-- `title` is written as an overlay would write it (the clock bumped, an
-- envelope.patched entry of origin "submit" on the session log), so a host's later
-- replace keeps it, changes it or clears it like any host key.
-- KEYS: 1 envelope, 2 turn hash, 3 turns index, 4 active list, 5 idempotency key,
--       6 idempotency index, 7 turn events stream, 8 the slot's outbox, 9 session log
-- ARGV: 1 turn id, 2 events TTL s, 3 multitask,
--       4 idempotency digest ("" = none), 5 body digest, 6 idempotency TTL s,
--       7 turn.queued event JSON, 8 events MAXLEN, 9 user, 10 session,
--       11 created ms, 12 session key base, 13 session queue max,
--       14 the title the message gives ("" = none), 15 session log MAXLEN,
--       16 whole-meta byte budget, 17 the session lifetime in ms ("" = none),
--       18 .. the record's fields and values, flat
-- With multitask "interrupt" and a running turn (or one paused for its caller: the
-- gateway then ends it at once, as a cancel does), that turn is flagged
-- (cancelRequested, `by` the new turn) and the new turn goes right after it, behind only
-- the turns that interrupted it before: it starts next. The caller announces the cancel.
-- A head that is itself an interrupting turn not started yet (the turn it interrupted
-- just ended) is kept ahead the same way; with no turn running it is an enqueue.
-- Replies: {"ok", eventId [, the interrupted turn's id, its status]} | {"not_found"} | {"busy", turnId}
--          | {"replay", turnId} | {"mismatch", turnId} | {"queue_full", activeCount}
-- include: contracts.lua
-- include: envelope.lua
-- include: lifetime.lua
if redis.call('EXISTS', KEYS[1]) == 0 then return {'not_found'} end

local tid = ARGV[1]
if ARGV[4] ~= '' then
  local prior = redis.call('GET', KEYS[5])
  if prior then
    local sep = string.find(prior, ' ', 1, true)
    local prior_tid = string.sub(prior, 1, sep - 1)
    if string.sub(prior, sep + 1) == ARGV[5] then return {'replay', prior_tid} end
    return {'mismatch', prior_tid}
  end
end

-- Drop heads of the active list that are already over (a finalize that could
-- not run, a deleted record) so a lost turn never blocks its session forever.
local active = 0
local interrupted = nil
local interrupted_status = nil
local ahead = nil -- the turn the interrupting turns queue behind
while true do
  local head = redis.call('LINDEX', KEYS[4], 0)
  if not head then break end
  local status = redis.call('HGET', ARGV[12] .. ':turn:' .. head, 'status')
  if status and not TERMINAL_STATUSES[status] then
    if ARGV[3] ~= 'enqueue' and ARGV[3] ~= 'interrupt' then return {'busy', head} end
    active = redis.call('LLEN', KEYS[4])
    if ARGV[3] == 'interrupt' then
      if status == STATUS.running or status == STATUS.requires_action then
        interrupted = head
        interrupted_status = status
        ahead = head
      elseif redis.call('HGET', ARGV[12] .. ':turn:' .. head, 'multitask') == 'interrupt' then
        ahead = head
      end
    end
    break
  end
  redis.call('LPOP', KEYS[4])
end

-- The session's queue (its accepted turns not yet over, the running one included)
-- is bounded: over it nothing is written, so one session cannot flood the workers.
-- (An empty list, the usual case, needs no count.)
if active >= tonumber(ARGV[13]) then return {'queue_full', active} end

-- Keep the indexes bounded: drop the oldest few entries whose keys have expired
-- (finished turns' records and idempotency keys expire): up to three checked on every
-- submit, which adds one, so an index shrinks back as its entries expire. An entry is
-- scored with its creation ms, and its key lives at least a TTL past that (a record's
-- TTL starts when its turn ends; an idempotency key's when it is written): only the
-- entries older than their TTL are looked at, so a young index costs one read.
for _, index in ipairs({{KEYS[3], ':turn:', ARGV[2]}, {KEYS[6], ':idem:', ARGV[6]}}) do
  local cutoff = tonumber(ARGV[11]) - tonumber(index[3]) * 1000
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', index[1], '-inf', cutoff, 'LIMIT', 0, 3)) do
    if redis.call('EXISTS', ARGV[12] .. index[2] .. member) == 0 then
      redis.call('ZREM', index[1], member)
    end
  end
end

-- The first turn: none in the index yet (a finished turn stays there until its record
-- expires), so a later turn never titles a session whose host cleared its title.
if ARGV[14] ~= '' and redis.call('ZCARD', KEYS[3]) == 0
    and redis.call('HEXISTS', KEYS[1], 'title') == 0 then
  worker_overlay(KEYS[1], redis.call('HGETALL', KEYS[1]), {'title', ARGV[14]}, ARGV[11],
    ARGV[16], KEYS[9], ARGV[15], ARGV[10], 'submit')
end

redis.call('HSET', KEYS[2], unpack(ARGV, 18))
redis.call('ZADD', KEYS[3], ARGV[11], tid)
if ahead then
  local base = ARGV[12] .. ':turn:'
  if interrupted then
    redis.call('HSET', base .. interrupted, 'cancelRequested', '1')
    redis.call('HSETNX', base .. interrupted, 'by', tid)
  end
  local after = ahead
  for _, queued in ipairs(redis.call('LRANGE', KEYS[4], 1, -1)) do
    if redis.call('HGET', base .. queued, 'multitask') ~= 'interrupt' then break end
    after = queued
  end
  redis.call('LINSERT', KEYS[4], 'AFTER', after, tid)
else
  redis.call('RPUSH', KEYS[4], tid)
end
if ARGV[4] ~= '' then
  redis.call('SET', KEYS[5], tid .. ' ' .. ARGV[5], 'EX', ARGV[6])
  redis.call('ZADD', KEYS[6], ARGV[11], ARGV[4])
end
local id = redis.call('XADD', KEYS[7], 'MAXLEN', '~', ARGV[8], '*', 'data', ARGV[7])
redis.call('ZADD', KEYS[8], ARGV[11], ARGV[9] .. ':' .. ARGV[10] .. ':' .. tid)
session_lifetime(ARGV[12], ARGV[17], {KEYS[2], KEYS[7], ARGV[4] ~= '' and KEYS[5] or nil})
if interrupted then return {'ok', id, interrupted, interrupted_status} end
return {'ok', id}
