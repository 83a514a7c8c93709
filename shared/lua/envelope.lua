-- Included by the scripts that read or overlay a session envelope
-- (`-- include: envelope.lua`); not a script of its own.
-- include: clock.lua
-- include: contracts.lua

-- An envelope's flat HGETALL reply as its fields (all but createdAt and updatedAt) and
-- its clock.
local function envelope_fields(flat)
  local current, stored = {}, '0'
  for i = 1, #flat, 2 do
    local k, v = flat[i], flat[i + 1]
    if k == 'updatedAt' then
      stored = clock_of(v)
    elseif k ~= 'createdAt' then
      current[k] = v
    end
  end
  return current, stored
end

-- The worker overlay, as lua/envelope_write.lua writes it ("worker" mode), of the flat
-- fields and values `set` on the envelope at `key`, whose flat HGETALL reply the caller
-- has read (`env`, not empty): a field changes when its stored value differs; the meta
-- byte `budget` counts every field but createdAt and updatedAt, after the write. A write
-- that changes nothing, or would pass the budget, writes nothing. Else the changed
-- fields and updatedAt (the worker's clock from its wall ms `now`) are set and one
-- envelope.patched entry, its keys sorted, goes on the session log `log` (trimmed to
-- about `log_maxlen`), its origin `origin` (default "worker"). Returns the fields and
-- values written, updatedAt last, or nil.
local function worker_overlay(key, env, set, now, budget, log, log_maxlen, session_id, origin)
  -- One pass over the envelope: its size, its clock and the stored values of the fields
  -- `set` names (`values`, false: none); a table of every field would cost more here
  -- than the rest of the call.
  local values = {}
  for i = 1, #set, 2 do values[set[i]] = false end
  local size, stored = 0, '0'
  for i = 1, #env, 2 do
    local k, v = env[i], env[i + 1]
    if k == 'updatedAt' then
      stored = clock_of(v)
    elseif k ~= 'createdAt' then
      size = size + #k + #v
      if values[k] == false then values[k] = v end
    end
  end
  local changed, setargs, c = {}, {}, 0
  for i = 1, #set, 2 do
    local k, v = set[i], set[i + 1]
    local was = values[k]
    if was ~= v then
      c = c + 1
      changed[c], setargs[2 * c - 1], setargs[2 * c] = k, k, v
    end
    if was then size = size - #k - #was end
    size = size + #k + #v
    values[k] = v
  end
  if c == 0 then return nil end
  if size > tonumber(budget) then return nil end
  if c > 1 then table.sort(changed) end
  -- The keys array and the set object are written by hand, in the keys' order (cjson's
  -- order is its table's), each key encoded once for both.
  local key_json = cjson.encode(changed[1])
  local keys_json, set_json = key_json, key_json .. ':' .. cjson.encode(values[changed[1]])
  for i = 2, c do
    key_json = cjson.encode(changed[i])
    keys_json = keys_json .. ',' .. key_json
    set_json = set_json .. ',' .. key_json .. ':' .. cjson.encode(values[changed[i]])
  end
  local updated = worker_clock(stored, clock_of(now))
  setargs[2 * c + 1], setargs[2 * c + 2] = 'updatedAt', updated
  redis.call('HSET', key, unpack(setargs))
  redis.call('XADD', log, 'MAXLEN', '~', log_maxlen, '*', 'data', event_json('envelope.patched', {
    origin = origin and cjson.encode(origin) or '"worker"', updatedAt = updated,
    sessionId = cjson.encode(session_id), keys = '[' .. keys_json .. ']',
    set = '{' .. set_json .. '}', unset = '[]'}))
  return setargs
end
