-- The one writer of a session envelope. Validates, applies, bumps updatedAt and
-- appends exactly one envelope.patched entry to the session log, atomically.
--
-- KEYS[1] envelope hash, KEYS[2] session log stream, KEYS[3] (optional, "worker" only)
--   the session lease: the write applies only while it holds ARGV[7]
-- ARGV[1] mode: "create" | "host" | "worker"
-- ARGV[2] updatedAt the host asserts ("host"); the worker's wall ms ("worker"; "0" = the
--   server's TIME); ignored for "create"
-- ARGV[3] whole-meta byte budget
-- ARGV[4] log MAXLEN (approximate trim)
-- ARGV[5] JSON: {"set": {k: v}, "clear": [k], "replace": [k]}
--   set      values to write
--   clear    keys to remove (a present empty string)
--   replace  host keys owned by this write: any not in `set` is removed
--   notes    {"bytes", "sha256"} of set.workingNotes: what the log entry carries
--            for the notes instead of their text
--   maxAheadMs  ("host" only) how far ahead of the server's clock updatedAt may be
-- ARGV[6] session id (for the log entry)
-- ARGV[7] the lease token that KEYS[3] must hold (with KEYS[3] only; else "")
-- ARGV[8], ARGV[9] ("worker" only, optional) an entry to append to the session log after
--   the write's own: ARGV[8] .. updatedAt .. ARGV[9] (the notes tools' working_notes
--   event, which carries the write's updatedAt: one call fewer per notes write)
-- ARGV[10] ("create" and "host" only, optional; ARGV[7] to ARGV[9] then "") the session
--   lifetime in ms ("" = none): the session's keys live that long from this write
--
-- Replies: {"ok", updatedAt, logId[, flat hash after the write (create, host)]} | {"conflict", flat hash} | {"not_found"}
--          | {"exists"} | {"too_large", size} | {"fenced"} | {"clock_ahead", server ms}

-- include: envelope.lua
-- include: lifetime.lua

local mode = ARGV[1]
local budget = tonumber(ARGV[3])
local payload = cjson.decode(ARGV[5])

if mode == 'worker' and KEYS[3] and redis.call('GET', KEYS[3]) ~= ARGV[7] then
  return {'fenced'}
end

local flat = redis.call('HGETALL', KEYS[1])
local exists = #flat > 0
if mode == 'create' then
  if exists then return {'exists'} end
elseif not exists then
  return {'not_found'}
end

local current, stored = envelope_fields(flat)

-- The wall clock: the worker's own for its overlay (as its turn scripts take it), else
-- the server's.
local now = mode == 'worker' and clock_of(ARGV[2]) or '0'
if now == '0' then
  local t = redis.call('TIME')
  now = clock_of(t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000)))
end

local updated
if mode == 'host' then
  updated = clock_of(ARGV[2])
  -- A host clock far ahead of the server's would leave no room for later writes: refused.
  -- Both terms are far below 2^53, so the double sum is exact.
  local ahead = string.format('%d', tonumber(now) + tonumber(payload['maxAheadMs']))
  if clock_cmp(updated, ahead) > 0 then
    return {'clock_ahead', now}
  end
  -- A stored clock beyond that window can only be a relic of an unchecked host clock:
  -- a write within the window replaces it, so the host is never locked out.
  if clock_cmp(updated, stored) <= 0 and clock_cmp(stored, ahead) <= 0 then
    return {'conflict', flat}
  end
else
  updated = worker_clock(stored, now)
end

local nextmeta = {}
for k, v in pairs(current) do nextmeta[k] = v end
for _, k in ipairs(payload['replace'] or {}) do nextmeta[k] = nil end
for _, k in ipairs(payload['clear'] or {}) do nextmeta[k] = nil end
for k, v in pairs(payload['set'] or {}) do nextmeta[k] = v end

local size = 0
for k, v in pairs(nextmeta) do size = size + #k + #v end
if size > budget then
  return {'too_large', size}
end

local setargs, unset, changed = {}, {}, {}
local setjson = {}
local notes = nil
for k, v in pairs(nextmeta) do
  if current[k] ~= v then
    table.insert(setargs, k)
    table.insert(setargs, v)
    -- The notes' text never enters the log: their size and digest do.
    if k == 'workingNotes' then notes = payload['notes'] else setjson[k] = v end
    table.insert(changed, k)
  end
end
for k, _ in pairs(current) do
  if nextmeta[k] == nil then
    table.insert(unset, k)
    table.insert(changed, k)
  end
end
table.sort(changed)
table.sort(unset)

if #unset > 0 then redis.call('HDEL', KEYS[1], unpack(unset)) end
if mode == 'create' then
  table.insert(setargs, 'createdAt')
  table.insert(setargs, updated)
end
table.insert(setargs, 'updatedAt')
table.insert(setargs, updated)
redis.call('HSET', KEYS[1], unpack(setargs))

-- cjson encodes an empty table as {}; lists are written by hand so [] stays [].
local function list_json(list)
  if #list == 0 then return '[]' end
  return cjson.encode(list)
end
local entry = event_json('envelope.patched', {
  origin = cjson.encode(mode), updatedAt = updated, sessionId = cjson.encode(ARGV[6]),
  keys = list_json(changed), set = cjson.encode(setjson), unset = list_json(unset),
  notes = notes and cjson.encode(notes) or nil})
local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'data', entry)
if mode == 'worker' then
  if ARGV[8] then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'data', ARGV[8] .. updated .. ARGV[9])
  end
  return {'ok', updated, id}
end
session_lifetime(string.sub(KEYS[1], 1, -5), ARGV[10], {})
return {'ok', updated, id, redis.call('HGETALL', KEYS[1])}
