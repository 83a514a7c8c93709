-- A user's quota counters: one hash per user (KEYS[1], Keys.user_quota), apart from any
-- session's slot, so it is run as a call of its own before a session's submit script
-- and after a turn's end (docs/operations.md, "Quotas"). The clock is Redis's, so every
-- gateway and worker counts the same minute and day.
-- Fields: minute, turns (turns admitted in that minute); day, tokens (tokens that UTC
-- day); running (sessions with an unfinished turn), queued (the turns behind them);
-- s:<session> (that session's unfinished turns); checkedAt (the last recount, ms).
-- ARGV 1: the action, then per action:
--   admit    2 session, 3 multitask, 4 running limit, 5 queued limit, 6 turns per
--            minute limit, 7 tokens per day limit ("" = off), 8 key TTL ms,
--            9 recount interval ms
--            -> {"ok", minute counted ("" = none), counted as ("running" | "queued" | "")}
--             | {"refused", limit, retry after s, recount due ("1" | "0")}
--   release  2 session, 3 the minute to give back ("" = none), 4 key TTL ms -> 1
--   tokens   2 tokens, 3 key TTL ms -> the day's total
--   recount  2 key TTL ms, 3.. session, count seen, unfinished turns found (triples)
--            -> 1
-- include: contracts.lua
-- The user's unfinished turns are counted under the status each counts as: the
-- session's head as STATUS.running, a turn behind it as STATUS.queued.
local key, action = KEYS[1], ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local minute, day = math.floor(now / 60000), math.floor(now / 86400000)

local function num(v) return tonumber(v) or 0 end

-- One turn of `session` is over (or was never written): its count and the totals drop,
-- none below zero (a count lost to a recount or an expiry is not owed back).
local function drop(session, n)
  local c = num(redis.call('HGET', key, 's:' .. session))
  if c <= 0 then return end
  n = math.min(n, c)
  local queued = math.min(n, c - 1)
  if queued > 0 then
    local left = math.max(num(redis.call('HGET', key, STATUS.queued)) - queued, 0)
    redis.call('HSET', key, STATUS.queued, left)
  end
  if c - n == 0 then
    redis.call('HDEL', key, 's:' .. session)
    local left = math.max(num(redis.call('HGET', key, STATUS.running)) - 1, 0)
    redis.call('HSET', key, STATUS.running, left)
  else
    redis.call('HSET', key, 's:' .. session, c - n)
  end
end

if action == 'admit' then
  local session = ARGV[2]
  local h = redis.call('HMGET', key, 'minute', 'turns', 'day', 'tokens', STATUS.running,
    STATUS.queued, 'checkedAt', 's:' .. session)
  local tokens_limit, rate_limit = ARGV[7], ARGV[6]
  if tokens_limit ~= '' and num(h[3]) == day and num(h[4]) >= tonumber(tokens_limit) then
    return {'refused', 'tokensPerDay', math.ceil(((day + 1) * 86400000 - now) / 1000), '0'}
  end
  if rate_limit ~= '' and num(h[1]) == minute and num(h[2]) >= tonumber(rate_limit) then
    return {'refused', 'turnsPerMinute', math.ceil(((minute + 1) * 60000 - now) / 1000), '0'}
  end
  local counted = ''
  if ARGV[4] ~= '' or ARGV[5] ~= '' then
    local c = num(h[8])
    -- A turn of an idle session runs next (a running turn); one behind a session's
    -- unfinished turn waits (queued; an interrupt too, until the cut turn ends). A
    -- reject-mode submit to a busy session is the
    -- session's 409, not a quota's.
    local limit, used, name
    if c == 0 then
      counted, limit, used, name = STATUS.running, ARGV[4], num(h[5]), 'runningTurns'
    else
      counted, limit, used, name = STATUS.queued, ARGV[5], num(h[6]), 'queuedTurns'
      if ARGV[3] == 'reject' then limit = '' end
    end
    if limit ~= '' and used >= tonumber(limit) then
      local due = now - num(h[7]) >= tonumber(ARGV[9])
      if due then redis.call('HSET', key, 'checkedAt', now) end
      return {'refused', name, 2, due and '1' or '0'}
    end
    redis.call('HSET', key, 's:' .. session, c + 1)
    redis.call('HINCRBY', key, counted, 1)
  end
  local counted_minute = ''
  if rate_limit ~= '' then
    counted_minute = tostring(minute)
    if num(h[1]) == minute then
      redis.call('HINCRBY', key, 'turns', 1)
    else
      redis.call('HSET', key, 'minute', minute, 'turns', 1)
    end
  end
  redis.call('PEXPIRE', key, ARGV[8])
  return {'ok', counted_minute, counted}
end

if action == 'release' then
  drop(ARGV[2], 1)
  if ARGV[3] ~= '' and redis.call('HGET', key, 'minute') == ARGV[3] then
    redis.call('HSET', key, 'turns', math.max(num(redis.call('HGET', key, 'turns')) - 1, 0))
  end
  if redis.call('EXISTS', key) == 1 then redis.call('PEXPIRE', key, ARGV[4]) end
  return 1
end

if action == 'tokens' then
  local total
  if num(redis.call('HGET', key, 'day')) == day then
    total = redis.call('HINCRBY', key, 'tokens', ARGV[2])
  else
    redis.call('HSET', key, 'day', day, 'tokens', ARGV[2])
    total = tonumber(ARGV[2])
  end
  redis.call('PEXPIRE', key, ARGV[3])
  return total
end

if action == 'recount' then
  -- Only ever lowers a count, by what it was seen above the session's unfinished turns:
  -- turns admitted or ended since it was read keep their own increments.
  for i = 3, #ARGV, 3 do
    local over = tonumber(ARGV[i + 1]) - tonumber(ARGV[i + 2])
    if over > 0 then drop(ARGV[i], over) end
  end
  redis.call('HSET', key, 'checkedAt', now)
  redis.call('PEXPIRE', key, ARGV[2])
  return 1
end

return redis.error_reply('unknown action ' .. tostring(action))
