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
  local current, stored = envelope_fields(env)
  local changed, values, setargs, c = {}, {}, {}, 0
  for i = 1, #set, 2 do
    local k, v = set[i], set[i + 1]
    if current[k] ~= v then
      c = c + 1
      changed[c], values[k], setargs[2 * c - 1], setargs[2 * c] = k, v, k, v
    end
    current[k] = v
  end
  if c == 0 then return nil end
  local size = 0
  for k, v in pairs(current) do size = size + #k + #v end
  if size > tonumber(budget) then return nil end
  table.sort(changed)
  -- The set object is written by hand, in the keys' order (cjson's order is its table's).
  local set_json = {}
  for i, k in ipairs(changed) do set_json[i] = cjson.encode(k) .. ':' .. cjson.encode(values[k]) end
  local updated = worker_clock(stored, clock_of(now))
  setargs[2 * c + 1], setargs[2 * c + 2] = 'updatedAt', updated
  redis.call('HSET', key, unpack(setargs))
  redis.call('XADD', log, 'MAXLEN', '~', log_maxlen, '*', 'data', event_json('envelope.patched', {
    origin = cjson.encode(origin or 'worker'), updatedAt = updated,
    sessionId = cjson.encode(session_id), keys = cjson.encode(changed),
    set = '{' .. table.concat(set_json, ',') .. '}', unset = '[]'}))
  return setargs
end
