// Generated from turnbus.shared.contracts by `make generate`; do not edit.
// A turn's statuses, those of a turn not yet over and those that end one
// (console.js reads them).
"use strict";
const STATUS = Object.freeze({queued: "queued", running: "running", requires_action: "requires_action", completed: "completed", failed: "failed", cancelled: "cancelled", timed_out: "timed_out"});
const ACTIVE_STATUSES = Object.freeze(["queued", "running", "requires_action"]);
const TERMINAL_STATUSES = Object.freeze(["completed", "failed", "cancelled", "timed_out"]);
// The reasons a turn ends with (the record's and the terminal event's).
const REASON = Object.freeze({max_rounds: "max_rounds", worker_lost: "worker_lost", rate_limited: "rate_limited", overloaded: "overloaded", provider_error: "provider_error", bad_request: "bad_request", auth: "auth", connection: "connection", internal: "internal", wall_clock: "wall_clock", action_timeout: "action_timeout", cancelled: "cancelled", interrupted: "interrupted"});
