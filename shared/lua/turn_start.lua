-- Starts one attempt at a turn in one call: takes the session lease (only for the
-- session's oldest active turn), marks the turn running and counts the attempt,
-- announces it, overlays the envelope (turnRunId, turnStatus=running) and returns what
-- the first round needs: the record, the envelope and the history.
-- Any call proves a worker holds the turn's work entry: the turn's mark in the slot's
-- outbox goes first, whatever the reply (the sweeper then leaves the turn alone).
-- KEYS: 1 turn hash, 2 active list, 3 lease, 4 turn events, 5 envelope, 6 session log,
--       7 history (messages), 8 the slot's outbox, 9 the turn's calls hash
-- ARGV: 1 turn id, 2 lease token, 3 lease ms, 4 worker name, 5 now ms,
--       6 started attempts allowed, 7 events MAXLEN, 8 log MAXLEN, 9 meta byte budget,
--       10 session id, 11 the turn's outbox member, 12 how many history rows the worker
--       holds ("0": none), 13 the last of them, 14 how long the worker lost Redis just
--       before, in ms ("" = it did not): a later attempt's turn.started names it
--       (unless the attempt resumes an answered pause: its turn.started says "answered"),
--       15 the turn's last model round (no round.started past it)
-- When the list's row at that place is still the worker's last one, only the rows after
-- it are answered (rows are only appended or trimmed from the head; each names its turn
-- and round, so a trimmed list has another row there).
-- Replies (in the flat record and envelope a field may come twice: its last value is
-- the one that holds):
--          {"started", flat record, flat envelope, history rows, again ("1" when this
--            attempt had already started: a resent call), announced ("1" when a
--            round.started follows turn.started: round 1's on the turn's first attempt;
--            on the first attempt after an answer that left no call to run, that of
--            the round after the paused one),
--            "after" (the rows are those after the ones held) | "all",
--            and for a later attempt (a resume) what it reads first: the flat calls
--            hash and the turn's last usage event among its last 100 events: {id, data},
--            {} (none: the turn has fewer events) or {id of the oldest of the 100}}
--          {"exhausted", flat record, history rows} (the turn must end worker_lost; the
--            lease is taken, so that end can also rewrite the history without thinking)
--          {"action_timeout", flat record, history rows} (the turn waited for its
--            caller past its deadline: it must end timed_out; the lease is taken)
--          {"waiting"} (the turn waits for its caller, within its deadline: nothing
--            written, its outbox mark, which holds the deadline, kept)
--          {"not_head", head or ""} | {"busy", holder} | {"terminal", status} | {"not_found"}
-- A resumed turn's attempts count past those its caller's answers started
-- (``resumes``): a pause is not a lost worker.
-- include: contracts.lua
-- include: envelope.lua

-- A resumed attempt's usage so far is the turn's last usage event: of its last 100 events
-- only that one goes to the worker, found here a page at a time (it is most often among
-- the last few; a usage event is the worker's, so its JSON starts with its type).
-- The first page is short: after an answered pause the usage event is the 4th from the
-- end (turn.started, the call's tool.result, turn.requires_action, usage) when one call
-- was answered, and every entry read costs its conversion to Lua.
-- `newest`: the id of the stream's newest entry when this call wrote it (its turn.started,
-- no usage event): the first page is read from below it, one entry fewer (the 100 count
-- it all the same).
-- Returns {id, data}, {} (none: the turn has no more events) or {the oldest id read}.
local USAGE_PAGES = {4, 16, 20, 20, 20, 20}  -- 100 events in all
local function last_usage(key, newest)
  local from, skip = '+', 0
  if newest then from, skip = '(' .. newest, 1 end
  for _, count in ipairs(USAGE_PAGES) do
    count = count - skip
    skip = 0
    local page = redis.call('XREVRANGE', key, from, '-', 'COUNT', count)
    for i = 1, #page do
      local fields = page[i][2]
      for j = 1, #fields - 1, 2 do
        if fields[j] == 'data' and string.sub(fields[j + 1], 1, 16) == '{"type":"usage",' then
          return {page[i][1], fields[j + 1]}
        end
      end
    end
    if #page < count then return {} end
    from = '(' .. page[count][1]
  end
  return {string.sub(from, 2)}
end

local rec = redis.call('HGETALL', KEYS[1])
-- The fields read are picked off the flat reply in one pass (a table of every field
-- costs more than the rest of the scan).
local status, deadline, attempt_was, resumes, started_at, cancel_asked
for i = 1, #rec, 2 do
  local k = rec[i]
  if k == 'status' then status = rec[i + 1]
  elseif k == 'attempt' then attempt_was = rec[i + 1]
  elseif k == 'resumes' then resumes = rec[i + 1]
  elseif k == 'startedAt' then started_at = rec[i + 1]
  elseif k == 'actionDeadline' then deadline = rec[i + 1]
  elseif k == 'cancelRequested' then cancel_asked = rec[i + 1]
  end
end
if status == STATUS.requires_action
    and (tonumber(deadline or '0') or 0) > tonumber(ARGV[5]) then
  return {'waiting'}
end
redis.call('ZREM', KEYS[8], ARGV[11])
if #rec == 0 then return {'not_found'} end
if TERMINAL_STATUSES[status] then return {'terminal', status} end
local head = redis.call('LINDEX', KEYS[2], 0)
if head ~= ARGV[1] then return {'not_head', head or ''} end
local env = redis.call('HGETALL', KEYS[5])
if #env == 0 then return {'not_found'} end

local again = '0'
local started_id = nil
local announced = '0'
local calls = nil
if not redis.call('SET', KEYS[3], ARGV[2], 'NX', 'PX', ARGV[3]) then
  local holder = redis.call('GET', KEYS[3])
  if holder ~= ARGV[2] then return {'busy', holder or ''} end
  again = '1'
end

if status == STATUS.requires_action then
  return {REASON.action_timeout, rec, redis.call('LRANGE', KEYS[7], 0, -1)}
end

if again == '0' then
  local attempt = tonumber(attempt_was or '0') or 0
  if attempt - (tonumber(resumes or '0') or 0) >= tonumber(ARGV[6]) then
    return {'exhausted', rec, redis.call('LRANGE', KEYS[7], 0, -1)}
  end
  attempt = attempt + 1
  attempt_was = string.format('%d', attempt)
  -- The reply's record is the stored one with the new values appended: in a flat reply
  -- the last value of a field is its value (as the caller reads it).
  local set = {'status', STATUS.running, 'worker', ARGV[4], 'attempt', attempt_was}
  if not started_at then
    -- The first attempt's: a later attempt does not restart the turn's clock.
    set[7] = 'startedAt'
    set[8] = ARGV[5]
  end
  redis.call('HSET', KEYS[1], unpack(set))
  local n = #rec
  for i = 1, #set do rec[n + i] = set[i] end
  local tid_json = cjson.encode(ARGV[1])
  -- A later attempt says why it runs: its caller answered a pause (the answer left the
  -- turn queued; an attempt that ran since would have left it running), or its worker
  -- lost Redis for a while. Neither: not known (a worker lost, most likely).
  local started = {turnId = tid_json, attempt = attempt_was, worker = cjson.encode(ARGV[4]),
    at = ARGV[5]}
  if attempt > 1 and status == STATUS.queued then
    started.after = '"answered"'
  elseif attempt > 1 and ARGV[14] and ARGV[14] ~= '' then
    started.after, started.redisLostMs = '"redis_lost"', ARGV[14]
  end
  started_id = redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'data',
    event_json('turn.started', started))
  if attempt == 1 then
    -- Nothing of the turn is committed yet: its first round is round 1.
    redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'data',
      event_json('round.started', {turnId = tid_json, round = '1', at = ARGV[5]}))
    announced = '1'
  elseif status == STATUS.queued and cancel_asked ~= '1' then
    -- The first attempt after the caller's answer. When the answer left no call for the
    -- worker to run (no approval: every call of the paused round has its result), the
    -- resumed round needs nothing more than its results: the next round starts now,
    -- and its round.started goes here, as round 1's does (the worker then keeps the
    -- resumed round's rows for the next round's commit). Not past the last round.
    calls = redis.call('HGETALL', KEYS[9])
    local rnd, paused, approved = nil, false, false
    for i = 1, #calls, 2 do
      local k = calls[i]
      if k == 'round' then rnd = tonumber(calls[i + 1])
      elseif k == 'paused' then paused = true
      elseif string.sub(k, 1, 9) == 'approval:' then approved = true
      end
    end
    if paused and not approved and rnd and rnd < tonumber(ARGV[15]) then
      redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'data',
        event_json('round.started',
          {turnId = tid_json, round = string.format('%d', rnd + 1), at = ARGV[5]}))
      announced = '1'
    end
  end

  -- The worker overlay of turnRunId and turnStatus; as for the record, the values it
  -- writes are appended to the reply's envelope.
  local written = worker_overlay(KEYS[5], env, {'turnRunId', ARGV[1], 'turnStatus', STATUS.running},
    ARGV[5], ARGV[9], KEYS[6], ARGV[8], ARGV[10])
  if written then
    n = #env
    for i = 1, #written do env[n + i] = written[i] end
  end
end
if again == '1' and attempt_was == '1' then announced = '1' end
local rows = nil
local which = 'all'
local held = tonumber(ARGV[12]) or 0
if held > 0 then
  local tail = redis.call('LRANGE', KEYS[7], held - 1, -1)
  if tail[1] == ARGV[13] then
    table.remove(tail, 1)
    rows = tail
    which = 'after'
  end
end
if not rows then rows = redis.call('LRANGE', KEYS[7], 0, -1) end
if (tonumber(attempt_was) or 0) > 1 then
  -- A resumed attempt carries on from the round it left (or its caller answered) and
  -- from the usage its last commit wrote: both go with this reply, not two more calls.
  return {'started', rec, env, rows, again, announced, which,
    calls or redis.call('HGETALL', KEYS[9]), last_usage(KEYS[4], started_id)}
end
return {'started', rec, env, rows, again, announced, which}
