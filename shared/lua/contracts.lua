-- Generated from turnbus.shared.contracts by `make generate`; do not edit.
-- Included by the scripts that read or write a turn's status or an event
-- (`-- include: contracts.lua`); not a script of its own.

-- A turn's statuses (STATUS.queued is 'queued'), and those that end a turn: a
-- turn in one of them never changes again.
local STATUS = {queued = "queued", running = "running", requires_action = "requires_action", completed = "completed", failed = "failed", cancelled = "cancelled", timed_out = "timed_out"}
local TERMINAL_STATUSES = {completed = true, failed = true, cancelled = true, timed_out = true}
-- The reasons a turn ends with (the record's and the terminal event's).
local REASON = {max_rounds = "max_rounds", worker_lost = "worker_lost", rate_limited = "rate_limited", overloaded = "overloaded", provider_error = "provider_error", bad_request = "bad_request", auth = "auth", connection = "connection", internal = "internal", wall_clock = "wall_clock", action_timeout = "action_timeout", cancelled = "cancelled", interrupted = "interrupted"}
-- The fixed keys of a session, after its base (`<prefix>:{<user>:<session>}`),
-- that its lifetime sets to expire (turnbus.shared.keys; the lease keeps its own).
local SESSION_LIFETIME_SUFFIXES = {":env", ":log", ":messages", ":turns", ":active", ":idem"}

-- The JSON of an event of type `kind`, one of those a script writes: `v` holds
-- each field's JSON text by name (a field without one is left out); the fields go
-- in the struct's order, the type first, as every writer puts it (a reader may
-- read it off without decoding the event). One concatenation of strings already
-- made (a table grown piece by piece, or a string per field, costs several times
-- more in Redis's Lua); one function, not a table of them (a script builds its
-- definitions anew at every call).
local function event_json(kind, v)
  if kind == "envelope.patched" then
    return '{"type":"envelope.patched"'
      .. (v.origin and ',"origin":' or '') .. (v.origin or '')
      .. (v.updatedAt and ',"updatedAt":' or '') .. (v.updatedAt or '')
      .. (v.sessionId and ',"sessionId":' or '') .. (v.sessionId or '')
      .. (v.keys and ',"keys":' or '') .. (v.keys or '')
      .. (v.set and ',"set":' or '') .. (v.set or '')
      .. (v.unset and ',"unset":' or '') .. (v.unset or '')
      .. (v.notes and ',"notes":' or '') .. (v.notes or '')
      .. '}'
  end
  if kind == "turn.started" then
    return '{"type":"turn.started"'
      .. (v.turnId and ',"turnId":' or '') .. (v.turnId or '')
      .. (v.attempt and ',"attempt":' or '') .. (v.attempt or '')
      .. (v.worker and ',"worker":' or '') .. (v.worker or '')
      .. (v.at and ',"at":' or '') .. (v.at or '')
      .. (v.after and ',"after":' or '') .. (v.after or '')
      .. (v.redisLostMs and ',"redisLostMs":' or '') .. (v.redisLostMs or '')
      .. '}'
  end
  if kind == "round.started" then
    return '{"type":"round.started"'
      .. (v.turnId and ',"turnId":' or '') .. (v.turnId or '')
      .. (v.round and ',"round":' or '') .. (v.round or '')
      .. (v.at and ',"at":' or '') .. (v.at or '')
      .. '}'
  end
  error('no writer for the event ' .. tostring(kind))
end
