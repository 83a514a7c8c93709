// Generated from turnbus.shared.records by `make generate`; do not edit.
// The statuses that end a turn (console.js reads them).
"use strict";
const TERMINAL_STATUSES = Object.freeze(["completed", "failed", "cancelled", "timed_out"]);
