"""Every hard limit in one place. Byte caps are UTF-8 bytes."""

from __future__ import annotations

__all__ = [
    "ACTION_TIMEOUT_MAX_S",
    "CLIENT_TOOLS_MAX",
    "CLIENT_TOOLS_MAX_BYTES",
    "CLIENT_TOOL_DESCRIPTION_MAX_BYTES",
    "HARNESS_SESSION_MAX_META_BYTES",
    "MAX_MODEL_ROUNDS",
    "MODEL_MSG_MAX_BYTES",
    "MODEL_MSG_MAX_ROWS",
    "NOTES_WHITESPACE",
    "PERSONA_SNAPSHOT_MAX_BYTES",
    "STATUS_SLOT_MAX_BYTES",
    "TOOL_RESULT_MAX_BYTES",
    "TURN_MESSAGE_MAX_BYTES",
    "TURN_WALL_CLOCK_MAX_MS",
    "UPDATED_AT_MAX",
    "UPDATED_AT_MAX_AHEAD_MS",
    "WORKING_NOTES_MAX_BYTES",
]

# The agent's working notes: a small block, not a second transcript. Folded into
# every model round's system prompt, so the cap bounds a standing per-round
# token cost (~8-16k tokens at worst), not just storage.
WORKING_NOTES_MAX_BYTES = 32 * 1024

# What trimming the notes (and the other folded blocks) removes at both ends: the
# original design's JavaScript ``String.prototype.trim()`` set, ECMAScript WhiteSpace
# plus LineTerminator. Unlike Python's ``str.strip()`` it takes U+FEFF (a BOM-only note
# clears) and keeps U+0085 and U+001C-U+001F, which are not white space there.
NOTES_WHITESPACE = (
    "\t\n\v\f\r "  # TAB, LF, VT, FF, CR, SPACE
    "\u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u202f\u205f\u3000"  # the rest of Unicode category Zs
    "\u2028\u2029"  # LINE SEPARATOR, PARAGRAPH SEPARATOR
    "\ufeff"  # ZERO WIDTH NO-BREAK SPACE (BOM)
)

# The envelope's LWW clock (``updatedAt``, ms): an integer a JSON client holds exactly
# (2^53 - 1, JavaScript's Number.MAX_SAFE_INTEGER). A host write beyond it is refused.
UPDATED_AT_MAX = 2**53 - 1
# How far ahead of the server's clock (Redis TIME) a host's updatedAt may be. Further is
# refused: a clock pushed far ahead leaves no room for the writes after it.
UPDATED_AT_MAX_AHEAD_MS = 24 * 60 * 60 * 1000

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

# The caller's tools declared with a submit (``clientTools``): they travel with the turn
# record and every model round, so they are bounded like a message.
CLIENT_TOOLS_MAX = 32
CLIENT_TOOL_DESCRIPTION_MAX_BYTES = 4 * 1024
CLIENT_TOOLS_MAX_BYTES = 64 * 1024
# The longest a paused turn waits for its caller (``TURNBUS_ACTION_TIMEOUT_S`` may lower it).
ACTION_TIMEOUT_MAX_S = 7 * 24 * 3600
