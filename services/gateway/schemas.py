"""The request and response bodies of the v1 API, as msgspec Structs.

Request bodies forbid unknown fields (a typo is a 422, not a silent no-op); the
OpenAPI document is generated from these same types.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from turnbus.shared.envelope import Envelope
from turnbus.shared.meta import Meta, UpdatedAt
from turnbus.shared.records import ClientTool
from turnbus.shared.tool_specs import PublishedTool
from turnbus.shared.turns import ActionAnswer, ApprovalAnswer

__all__ = [
    "ActionsRequest",
    "ConflictBody",
    "CreateSessionRequest",
    "EraseUserRequest",
    "EraseUserResponse",
    "ErrorBody",
    "ErrorDetail",
    "HealthBody",
    "IndexBody",
    "IndexLinks",
    "MessagesResponse",
    "ModelMessage",
    "ModelsResponse",
    "NotesResponse",
    "ProviderInfo",
    "PutMetaRequest",
    "StreamDropped",
    "ToolsResponse",
    "TurnAccepted",
    "TurnRequest",
    "WebhookRequest",
]


class ErrorDetail(msgspec.Struct, omit_defaults=True):
    code: str
    message: str
    field: str | None = None
    activeTurnId: str | None = None
    turnId: str | None = None
    callId: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


class ConflictBody(msgspec.Struct):
    """A stale ``PUT /meta``: the error and the envelope as it stands now."""

    error: ErrorDetail
    current: Envelope


class CreateSessionRequest(msgspec.Struct, forbid_unknown_fields=True):
    meta: Meta | None = None


class PutMetaRequest(msgspec.Struct, forbid_unknown_fields=True):
    updatedAt: UpdatedAt
    meta: Meta


class ToolsResponse(msgspec.Struct):
    """The tools a session may be offered: each one's name, what the model reads of it
    (description, input schema), its source ("notes", "python" or an MCP server's name)
    and its rules (``idempotent``: rerun after a lost worker, else never rerun without
    telling the model; its timeout and result cap)."""

    tools: list[PublishedTool]


class NotesResponse(msgspec.Struct):
    notes: str | None
    bytes: int


class ModelMessage(msgspec.Struct):
    """One model-facing message in Anthropic format (extra fields pass through)."""

    role: str
    content: str | list[dict[str, Any]]


class MessagesResponse(msgspec.Struct):
    messages: list[ModelMessage]


class WebhookRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Where the turn's end is POSTed: a host the deployment allows
    (``TURNBUS_WEBHOOK_ALLOW``), else ``422 webhook_not_allowed``."""

    url: Annotated[str, msgspec.Meta(min_length=1, max_length=2048)]


class TurnRequest(msgspec.Struct, forbid_unknown_fields=True):
    message: Annotated[str, msgspec.Meta(min_length=1)]
    multitask: Literal["reject", "enqueue", "interrupt"] = "reject"
    # Absent: the deployment's TURNBUS_WEBHOOK_URL, if set.
    webhook: WebhookRequest | None = None
    # Tools the caller runs: a call to one pauses the turn (requires_action).
    clientTools: list[ClientTool] | None = None
    # How long a pause may wait for the answer (capped by TURNBUS_ACTION_TIMEOUT_S).
    actionTimeoutS: Annotated[int, msgspec.Meta(ge=1)] | None = None


class ActionsRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The caller's answer to a paused turn: a result for every pending client call, a
    decision for every call awaiting approval."""

    toolResults: list[ActionAnswer] = msgspec.field(default_factory=list)
    approvals: list[ApprovalAnswer] = msgspec.field(default_factory=list)


class TurnAccepted(msgspec.Struct):
    turnId: str
    status: str
    eventsUrl: str


class HealthBody(msgspec.Struct):
    status: str


class ProviderInfo(msgspec.Struct):
    """A configured model provider: ``name`` goes before the colon of a selectedModel."""

    name: str
    kind: str  # anthropic | openai | scripted
    defaultModel: str | None
    default: bool


class ModelsResponse(msgspec.Struct):
    """``GET /v1/models``: the provider a bare (or unset) selectedModel runs on, and
    every configured provider."""

    default: str
    providers: list[ProviderInfo]


class IndexLinks(msgspec.Struct):
    console: str
    openapi: str
    sessions: str
    health: str
    ready: str
    metrics: str


class IndexBody(msgspec.Struct):
    """``GET /`` for an API client: what this server is and where to go next."""

    name: str
    version: str
    links: IndexLinks


class StreamDropped(msgspec.Struct, tag_field="type", tag="stream.dropped"):
    """The last SSE event of a stream the gateway ends early; reconnect to resume.

    ``reason``: ``slow_consumer`` (fell behind its queue), ``shutdown`` (the gateway
    is stopping), ``unavailable`` (Redis stopped answering) or ``gone`` (the turn was
    deleted with its session: a reconnect answers 404).
    """

    reason: str
    lastEventId: str | None = None


class EraseUserRequest(msgspec.Struct, forbid_unknown_fields=True):
    """``DELETE /v1/users/me``: ``confirm`` must be the caller's own user id."""

    confirm: str | None = None


class EraseUserResponse(msgspec.Struct):
    """What one ``DELETE /v1/users/me`` call erased; ``done`` once nothing is left."""

    done: bool
    sessionsDeleted: int
    turnsCancelled: int
