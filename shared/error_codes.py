"""The API's error codes: every ``error.code`` the gateway answers, its HTTP status and
what it means, in one table.

The gateway answers with these (``turnbus.gateway.errors.CODES``), the OpenAPI document
lists them, and the Python client raises an exception class per code. Nothing here
imports more than the standard library, so the client can read it.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["ERROR_CODES", "ErrorCode"]


class ErrorCode(NamedTuple):
    status: int
    meaning: str


ERROR_CODES: dict[str, ErrorCode] = {
    "bad_request": ErrorCode(400, "a malformed body, header, cursor or limit (`field` names it)"),
    "cursor_ahead": ErrorCode(400, "an SSE cursor past the stream's last event"),
    "unauthorized": ErrorCode(401, "no token, a bad signature, or an expired token"),
    "not_found": ErrorCode(404, "no such session or turn for this user, or no such route"),
    "method_not_allowed": ErrorCode(405, "the path exists, not with this method"),
    "request_timeout": ErrorCode(408, "the request's headers or body did not arrive in time"),
    "conflict": ErrorCode(409, "a stale updatedAt, or an Idempotency-Key reused with another body"),
    "session_busy": ErrorCode(409, "the session has an active turn (`activeTurnId`)"),
    "turn_not_waiting": ErrorCode(409, "an answer to a turn that is not waiting for one"),
    "payload_too_large": ErrorCode(413, "the body or a value is over its cap"),
    "unprocessable": ErrorCode(422, "the body does not match the schema (`field` names what)"),
    "clock_ahead": ErrorCode(422, "updatedAt is more than 24 h ahead of the server's clock"),
    "unknown_provider": ErrorCode(
        422, "meta.selectedModel names a provider that is not configured"
    ),
    "unknown_tool": ErrorCode(422, "meta.allowedTools names a tool no worker registered"),
    "webhook_not_allowed": ErrorCode(
        422, "the submit's webhook.url is not allowed, or no webhook secret is set"
    ),
    "confirmation_required": ErrorCode(
        422, "an erasure whose body does not confirm the caller's user id"
    ),
    "unknown_call": ErrorCode(422, "an answer names a call the turn does not wait on"),
    "missing_call": ErrorCode(422, "an answer leaves a pending call unanswered"),
    "duplicate_call": ErrorCode(422, "an answer answers a call twice"),
    "wrong_answer": ErrorCode(422, "a call answered in the other list"),
    "session_queue_full": ErrorCode(
        429, "the session holds its maximum of unfinished turns (Retry-After)"
    ),
    "quota_exceeded": ErrorCode(
        429, "over one of the user's quotas, named by `field` (Retry-After)"
    ),
    "internal": ErrorCode(500, "a bug; the message says nothing more"),
    "unavailable": ErrorCode(503, "Redis is unreachable or loading its data (Retry-After)"),
    "not_replicated": ErrorCode(
        503, "no replica confirmed the write in time (TURNBUS_WAIT_REPLICAS)"
    ),
}
