-- Stores a caller's answer to a paused turn in one call: each call's result (or, for a
-- call approved to run, its approval) goes into the turn's calls hash (where the resumed
-- round finds it), each result's tool.result event on the turn stream; the turn moves back to queued (the time it waited added to waitedMs,
-- which its wall clock leaves out) and its mark in the slot's outbox is renewed, so the
-- sweeper enqueues it if the caller's second call, the work entry, is lost. An
-- Idempotency-Key remembers the answer: a repeat of it is a replay.
-- KEYS: 1 turn hash, 2 the turn's calls hash, 3 turn events, 4 the slot's outbox,
--       5 idempotency key ("" digest = none), 6 the session's active list
-- ARGV: 1 turn id, 2 now ms, 3 the pending calls as the caller checked them (JSON;
--       "": not read by the caller, see below),
--       4 idempotency digest ("" = none), 5 body digest, 6 idempotency TTL s,
--       7 outbox member, 8 events MAXLEN, 9 event count N, 10 the cancel channel,
--       11 the message for it when turns queue behind the answered one (their workers
--       look at a session behind a paused turn only every few seconds: it wakes them),
--       12 .. 11+N the events, then field ("result:<call id>" | "approval:<call id>") and value (JSON) pairs
-- An answer of results only may come unchecked (ARGV[3] ""): the script checks that
-- the results answer every pending call, each a client call, once. Each event then
-- comes in three pieces (12 .. 11+3N): its JSON before the round, between the round
-- and the tool's name, after the name; the round is the calls hash's, the name the
-- pending call's, each in the order of the pairs.
-- Replies: {"ok", the turn's flat record as the answer left it (a field may come twice:
--            its last value is the one that holds)} | {"replay"}
--          | {"mismatch"} | {"not_waiting", status}
--          | {"changed"} (the pending calls are not those checked) | {"not_found"}
--          | {"check", pending calls, round} (unchecked, and not a plain answer: the
--            caller checks it against these, and sends it checked; nothing written)
-- include: contracts.lua
if ARGV[4] ~= '' then
  local prior = redis.call('GET', KEYS[5])
  if prior then
    if prior == ARGV[1] .. ' ' .. ARGV[5] then return {'replay'} end
    return {'mismatch'}
  end
end
local rec = redis.call('HGETALL', KEYS[1])
if #rec == 0 then return {'not_found'} end
-- The fields read are picked off the flat reply in one pass (a table of every field
-- costs more than the rest of the scan). The same pass closes up the reply over the
-- fields an answer deletes (the reply needs it only when the answer goes through).
local status, pending_calls, paused_at, waited_ms, resumes
local kept = 0
for i = 1, #rec, 2 do
  local k, v = rec[i], rec[i + 1]
  if k == 'pendingCalls' then pending_calls = v
  elseif k == 'pausedAt' then paused_at = v
  elseif k == 'actionDeadline' then  -- deleted by the answer: not kept
  else
    if k == 'status' then status = v
    elseif k == 'waitedMs' then waited_ms = v
    elseif k == 'resumes' then resumes = v
    end
    if kept ~= i - 1 then rec[kept + 1], rec[kept + 2] = k, v end
    kept = kept + 2
  end
end
if status ~= STATUS.requires_action or (pending_calls or '') == '' then
  return {'not_waiting', status}
end
local n = tonumber(ARGV[9])
local events = {}
local first = 12 + n
if ARGV[3] == '' then
  first = 12 + 3 * n
  local rnd = redis.call('HGET', KEYS[2], 'round') or '0'
  local ok, calls = pcall(cjson.decode, pending_calls)
  local check = {'check', pending_calls, rnd}
  if not ok or type(calls) ~= 'table' then return check end
  local pending = {}
  local left = 0
  for _, call in ipairs(calls) do
    if (call.kind or 'client') ~= 'client' then return check end
    pending[call.callId] = call.name
    left = left + 1
  end
  if left == 0 then return check end
  local k = 0
  for i = first, #ARGV, 2 do
    local id = string.sub(ARGV[i], 8)  -- after "result:"
    if string.sub(ARGV[i], 1, 7) ~= 'result:' or not pending[id] then return check end
    k = k + 1
    local at = 9 + 3 * k
    events[k] = ARGV[at] .. string.format('%d', tonumber(rnd) or 0) .. ARGV[at + 1]
      .. cjson.encode(pending[id]) .. ARGV[at + 2]
    pending[id] = nil
    left = left - 1
  end
  if left ~= 0 or k ~= n then return check end
else
  if pending_calls ~= ARGV[3] then return {'changed'} end
  for i = 12, 11 + n do events[#events + 1] = ARGV[i] end
end

for i = first, #ARGV, 2 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
end
local waited = tonumber(waited_ms or '0') or 0
waited = waited + math.max(tonumber(ARGV[2]) - (tonumber(paused_at or ARGV[2]) or 0), 0)
local set = {'status', STATUS.queued, 'waitedMs', string.format('%d', waited),
  'resumes', string.format('%d', (tonumber(resumes or '0') or 0) + 1)}
redis.call('HSET', KEYS[1], unpack(set))
redis.call('HDEL', KEYS[1], 'pendingCalls', 'pausedAt', 'actionDeadline')
for _, event in ipairs(events) do
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[8], '*', 'data', event)
end
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[7])
if ARGV[4] ~= '' then
  redis.call('SET', KEYS[5], ARGV[1] .. ' ' .. ARGV[5], 'EX', ARGV[6])
end
-- The record goes back with the reply (the caller's 202 needs no read of its own): the
-- one read above, less the fields the answer deleted (closed up in place above), with
-- the values it set after them (in a flat reply the last value of a field is its value,
-- as the caller reads it); written over the read's own slots, no table grown.
local len = #rec
for i = 1, #set do rec[kept + i] = set[i] end
for i = kept + #set + 1, len do rec[i] = nil end
if redis.call('LLEN', KEYS[6]) > 1 then redis.call('PUBLISH', ARGV[10], ARGV[11]) end
return {'ok', rec}
