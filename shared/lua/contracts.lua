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

-- The fields of each event a script writes, in its struct's order.
local EVENT_FIELDS = {
  ["envelope.patched"] = {"origin", "updatedAt", "sessionId", "keys", "set", "unset", "notes"},
  ["turn.started"] = {"turnId", "attempt", "worker", "at", "after", "redisLostMs"},
  ["round.started"] = {"turnId", "round", "at"},
}

-- The JSON of an event of type `kind`: `values` holds each field's JSON text by
-- name (a field without one is left out); the type comes first, as every writer
-- puts it (a reader may read it off without decoding the event).
local function event_json(kind, values)
  local parts = {'{"type":"' .. kind .. '"'}
  for _, name in ipairs(EVENT_FIELDS[kind]) do
    local value = values[name]
    if value ~= nil then parts[#parts + 1] = '"' .. name .. '":' .. value end
  end
  return table.concat(parts, ',') .. '}'
end
