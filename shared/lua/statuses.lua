-- Generated from turnbus.shared.records by `make generate`; do not edit.
-- Included by the scripts that read a turn's status (`-- include: statuses.lua`).
-- The statuses that end a turn: a turn in one of them never changes again.
local TERMINAL_STATUSES = {completed = true, failed = true, cancelled = true, timed_out = true}
