"""The caller as a user: ``DELETE /v1/users/me`` erases everything of theirs."""

from __future__ import annotations

import time

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from turnbus.gateway.body import decode_json_body, read_body
from turnbus.gateway.errors import ApiError
from turnbus.gateway.routes.spec import Answer, Operation
from turnbus.gateway.schemas import EraseUserRequest, EraseUserResponse
from turnbus.gateway.state import authenticate, gateway_of
from turnbus.shared.purge import PURGE_BATCH_DEFAULT, UserPurge

__all__ = ["ERASE_REQUEST_BUDGET_S", "erase_user"]

# How long one call erases before it answers 202 (call again to go on): well inside a
# proxy's usual 30-60 s request timeout. A batch under way when it passes is finished.
ERASE_REQUEST_BUDGET_S = 5.0
_BODY_MAX_BYTES = 4096

_decoder = msgspec.json.Decoder(EraseUserRequest)
_encoder = msgspec.json.Encoder()


@Operation(
    "DELETE",
    "/v1/users/me",
    "eraseUser",
    summary="Erase every session of the caller, in batches",
    description=(
        'The body `{"confirm": "<your user id>"}` is required. Each call erases for up to '
        "5 s: `200` with `done` once nothing is left, else `202`: call again."
    ),
    body=EraseUserRequest,
    body_required=False,
    answers={
        200: Answer("everything of the caller is erased", EraseUserResponse),
        202: Answer("part erased: call again", EraseUserResponse),
    },
    errors=["confirmation_required"],
)
async def erase_user(request: Request) -> Response:
    """Delete the caller's sessions, a batch at a time, for up to
    :data:`ERASE_REQUEST_BUDGET_S`: ``200`` with ``done`` once the caller has none left,
    else ``202`` (call again). The body must confirm the caller's own user id."""
    user = authenticate(request)
    raw = await read_body(request, _BODY_MAX_BYTES)
    body = decode_json_body(raw, _decoder) if raw.strip() else EraseUserRequest()
    if body.confirm != user:
        raise ApiError(
            "confirmation_required",
            'erasing a user needs the body {"confirm": "<your user id>"}; nothing was deleted',
            field="confirm",
        )
    gateway = gateway_of(request)
    purge = UserPurge(gateway.redis, gateway.keys, user, batch=PURGE_BATCH_DEFAULT)
    deadline = time.monotonic() + ERASE_REQUEST_BUDGET_S
    done = False
    while not done and time.monotonic() < deadline:
        done = not await purge.index_batch()
    counts = purge.counts
    answer = EraseUserResponse(
        done=done, sessionsDeleted=counts.sessions, turnsCancelled=counts.turns_cancelled
    )
    return Response(
        _encoder.encode(answer), status_code=200 if done else 202, media_type="application/json"
    )
