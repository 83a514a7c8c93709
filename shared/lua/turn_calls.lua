-- Makes a round's tool calls durable, fenced by the session lease, in one call each:
-- "intent" (before the round's first call to a registered tool starts): the round, its
-- assistant message with its tool_use blocks, the intent of each side-effecting call,
-- and the round's events so far (its last text, its tool.call events);
-- "result" (a side-effecting call's result, as soon as it is known): the result and
-- its tool.result event; "approved" (before calls an approver let run start, in the
-- round a pause kept): the intent of each side-effecting one, and the events so far. A resumed attempt reads the hash (HGETALL) and carries on
-- with that round: a stored result is reused, an intent without a result is not rerun.
-- A resent call whose first try was stored (its reply lost) writes nothing again.
-- KEYS: 1 lease, 2 the turn's calls hash, 3 turn events
-- ARGV: 1 lease token, 2 "intent" | "result", 3 the hash's expiry (ms), 4 events MAXLEN,
--       5 event count N, 6 .. 5+N the events, then
--       intent: the round, the assistant row, then the side-effecting calls' ids;
--       result: the call id, the result (JSON); approved: the side-effecting calls' ids
-- Replies: "ok" | "fenced"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 'fenced' end
local n = tonumber(ARGV[5])
local at = 6 + n
if ARGV[2] == 'intent' then
  if redis.call('HGET', KEYS[2], 'assistant') == ARGV[at + 1] then return 'ok' end
  redis.call('DEL', KEYS[2])
  local fields = {'round', ARGV[at], 'assistant', ARGV[at + 1]}
  for i = at + 2, #ARGV do
    fields[#fields + 1] = 'intent:' .. ARGV[i]
    fields[#fields + 1] = '1'
  end
  redis.call('HSET', KEYS[2], unpack(fields))
elseif ARGV[2] == 'approved' then
  if redis.call('HEXISTS', KEYS[2], 'intent:' .. ARGV[at]) == 1 then return 'ok' end
  for i = at, #ARGV do redis.call('HSET', KEYS[2], 'intent:' .. ARGV[i], '1') end
else
  if redis.call('HSETNX', KEYS[2], 'result:' .. ARGV[at], ARGV[at + 1]) == 0 then
    return 'ok'
  end
end
redis.call('PEXPIRE', KEYS[2], ARGV[3])
for i = 1, n do
  if i == n then
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'data', ARGV[5 + i])
  else
    redis.call('XADD', KEYS[3], '*', 'data', ARGV[5 + i])
  end
end
return 'ok'
