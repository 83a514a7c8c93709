-- Commits one finished round of a running turn and announces it, in one call: the
-- round's history rows and the round's last events (its last text, its tool results,
-- the turn's usage so far, the next round's start); returns the envelope as it is now,
-- for the next round's system prompt. Fenced by the session lease. (The turn's usage
-- so far is the last usage event: a resumed attempt reads it from there.)
-- KEYS: 1 history (messages), 2 lease, 3 turn hash (unused), 4 turn events, 5 envelope
-- ARGV: 1 lease token, 2 mode ("append" | "replace"), 3 rows to drop from the head
--       ("append" only), 4 unused, 5 events MAXLEN, 6 event count N,
--       7 .. 6+N events, then the rows to push
-- Replies: {"ok", flat envelope} | {"fenced"}
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {'fenced'} end
if ARGV[2] == 'replace' then
  redis.call('DEL', KEYS[1])
elseif tonumber(ARGV[3]) > 0 then
  redis.call('LTRIM', KEYS[1], tonumber(ARGV[3]), -1)
end
local n = tonumber(ARGV[6])
if #ARGV > 6 + n then
  redis.call('RPUSH', KEYS[1], unpack(ARGV, 7 + n))
end
for i = 7, 6 + n do
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[5], '*', 'data', ARGV[i])
end
return {'ok', redis.call('HGETALL', KEYS[5])}
