"""Every hard limit in one place. Byte caps are UTF-8 bytes."""

from __future__ import annotations

__all__ = [
    "HARNESS_SESSION_MAX_META_BYTES",
    "MAX_MODEL_ROUNDS",
    "MODEL_MSG_MAX_BYTES",
    "MODEL_MSG_MAX_ROWS",
    "PERSONA_SNAPSHOT_MAX_BYTES",
    "STATUS_SLOT_MAX_BYTES",
    "TOOL_RESULT_MAX_BYTES",
    "TURN_MESSAGE_MAX_BYTES",
    "TURN_WALL_CLOCK_MAX_MS",
    "WORKING_NOTES_MAX_BYTES",
]

# The agent's working notes: a small block, not a second transcript. Folded into
# every model round's system prompt, so the cap bounds a standing per-round
# token cost (~8-16k tokens at worst), not just storage.
WORKING_NOTES_MAX_BYTES = 32 * 1024

# The whole envelope meta (every field name and value, summed).
HARNESS_SESSION_MAX_META_BYTES = 1024 * 1024
PERSONA_SNAPSHOT_MAX_BYTES = 512 * 1024
STATUS_SLOT_MAX_BYTES = 96

# One user message submitted as a turn.
TURN_MESSAGE_MAX_BYTES = 128 * 1024

# The ceiling for a turn's wall clock; settings may lower it, never raise it.
TURN_WALL_CLOCK_MAX_MS = 10 * 60 * 1000
MAX_MODEL_ROUNDS = 24

# The model-facing history of a session.
MODEL_MSG_MAX_ROWS = 400
MODEL_MSG_MAX_BYTES = 3_500_000
TOOL_RESULT_MAX_BYTES = 16 * 1024
