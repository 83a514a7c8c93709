-- Commits one finished round of a running turn and announces it, in one call: the
-- round's notes write (the notes tools' update or clear, held by the worker until this
-- commit), the round's history rows and the round's last events (its last text, its
-- tool results, the turn's usage so far, the next round's start); answers the envelope
-- for the next round's system prompt when another writer changed it since the worker's
-- copy, else only its clock. Fenced by the session lease. (The turn's usage so far is
-- the last usage event: a resumed attempt reads it from there.)
-- The notes write is the worker overlay of lua/envelope_write.lua ("worker" mode) for
-- the one key workingNotes: refused whole (nothing written) past the meta budget (the
-- worker checked it against its copy of the envelope: checked here again only when
-- another writer changed the envelope since, i.e. its updatedAt is not ARGV[4]); one
-- envelope.patched on the session log, with the notes' size and digest, never their
-- text; the round's working_notes events follow it there, each completed with the
-- write's updatedAt (their `"updatedAt":0`).
-- KEYS: 1 history (messages), 2 lease, 3 turn hash (unused), 4 turn events, 5 envelope,
--       6 session log
-- ARGV: 1 lease token, 2 mode ("append" | "replace"), 3 rows to drop from the head
--       ("append" only), 4 the envelope's updatedAt the worker holds ("" = answer the
--       envelope whole), 5 events MAXLEN, 6 event count N,
--       7 "1" when the round wrote the notes, else "", 8 the notes ("" = cleared),
--       9 their size, 10 their sha256, 11 session id, 12 log MAXLEN, 13 meta byte budget,
--       14 now ms (the worker's wall clock), 15 count W of working_notes events,
--       16 .. 15+W their places (1..N) among the events, then the N events, then the
--       rows to push
-- Replies: {"ok", flat envelope} | {"same", updatedAt of the notes write or ""}
--          | {"fenced"} | {"too_large", size}
-- include: clock.lua
-- include: contracts.lua
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {'fenced'} end
-- A stream is trimmed (MAXLEN ~) by the last entry this call appends to it: the same
-- bound once the call is over, without the trim's arguments on every entry.
local function xadd(key, last, maxlen, event)
  if last then
    redis.call('XADD', key, 'MAXLEN', '~', maxlen, '*', 'data', event)
  else
    redis.call('XADD', key, '*', 'data', event)
  end
end
local n, w = tonumber(ARGV[6]), tonumber(ARGV[15])
local events_at = 16 + w
local held, updated = ARGV[4], nil
if ARGV[7] == '1' then
  local now = redis.call('HMGET', KEYS[5], 'updatedAt', 'workingNotes')
  if now[1] then
    local stored, old, notes = clock_of(now[1]), now[2], ARGV[8]
    if held ~= stored then
      -- Another writer since the worker's copy, against which the worker checked the
      -- budget: checked again here.
      held = ''
      local env, size = redis.call('HGETALL', KEYS[5]), 0
      for i = 1, #env, 2 do
        local k = env[i]
        if k ~= 'updatedAt' and k ~= 'createdAt' and k ~= 'workingNotes' then
          size = size + #k + #env[i + 1]
        end
      end
      if notes ~= '' and size + 12 + #notes > tonumber(ARGV[13]) then
        return {'too_large', size + 12 + #notes}
      end
    end
    updated = worker_clock(stored, clock_of(ARGV[14]))
    local changed, unset, digest = '[]', '[]', nil
    if notes ~= '' then
      redis.call('HSET', KEYS[5], 'workingNotes', notes, 'updatedAt', updated)
      if old ~= notes then
        changed = '["workingNotes"]'
        digest = '{"bytes":' .. ARGV[9] .. ',"sha256":"' .. ARGV[10] .. '"}'
      end
    else
      if old then
        redis.call('HDEL', KEYS[5], 'workingNotes')
        changed, unset = '["workingNotes"]', '["workingNotes"]'
      end
      redis.call('HSET', KEYS[5], 'updatedAt', updated)
    end
    xadd(KEYS[6], w == 0, ARGV[12], event_json('envelope.patched', {
      origin = '"worker"', updatedAt = updated, sessionId = cjson.encode(ARGV[11]),
      keys = changed, set = '{}', unset = unset, notes = digest}))
  end
end
if ARGV[2] == 'replace' then
  redis.call('DEL', KEYS[1])
elseif tonumber(ARGV[3]) > 0 then
  redis.call('LTRIM', KEYS[1], tonumber(ARGV[3]), -1)
end
if #ARGV >= events_at + n then
  redis.call('RPUSH', KEYS[1], unpack(ARGV, events_at + n))
end
local logged, last_logged = {}, 0
for i = 16, 15 + w do
  local at = tonumber(ARGV[i])
  logged[at] = true
  if at > last_logged then last_logged = at end
end
for i = 1, n do
  local event = ARGV[events_at + i - 1]
  if logged[i] then
    if updated then
      local _, j = string.find(event, '"updatedAt":0', 1, true)
      if j then event = string.sub(event, 1, j - 1) .. updated .. string.sub(event, j + 1) end
    end
    xadd(KEYS[6], i == last_logged, ARGV[12], event)
  end
  xadd(KEYS[4], i == n, ARGV[5], event)
end
if held ~= '' then
  if updated then return {'same', updated} end
  local clock = redis.call('HGET', KEYS[5], 'updatedAt')
  if clock and clock_of(clock) == held then return {'same', ''} end
end
return {'ok', redis.call('HGETALL', KEYS[5])}
