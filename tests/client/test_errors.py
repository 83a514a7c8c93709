"""The client's error classes: one per code the gateway answers, the code carried on it."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway_server import LiveGateway
from turnbus import (
    ERROR_CLASSES,
    ApiError,
    AsyncClient,
    Conflict,
    InvalidAnswer,
    NotFound,
    QuotaExceeded,
    SessionBusy,
    SessionQueueFull,
    ToolResultAnswer,
    TurnNotWaiting,
    Unauthorized,
    Unavailable,
    Unprocessable,
)
from turnbus.gateway.auth import mint_token
from turnbus.gateway.errors import CODES
from turnbus.shared.settings import Settings

pytestmark = pytest.mark.timeout(30)

# The classes earlier releases raised for these codes: still raised (or a subclass).
EARLIER = {
    "unauthorized": Unauthorized,
    "not_found": NotFound,
    "conflict": Conflict,
    "session_busy": SessionBusy,
    "turn_not_waiting": Conflict,
    "session_queue_full": SessionQueueFull,
    "quota_exceeded": QuotaExceeded,
    "unavailable": Unavailable,
    "not_replicated": Unavailable,
}


def test_every_code_of_the_gateway_has_a_client_class() -> None:
    assert set(ERROR_CLASSES) == set(CODES)
    assert all(issubclass(cls, ApiError) for cls in ERROR_CLASSES.values())


def _refusing(status: int, error: dict[str, str]) -> httpx.MockTransport:
    def gateway(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json={"error": error}, headers={"Retry-After": "4"})

    return httpx.MockTransport(gateway)


@pytest.mark.parametrize("code", list(CODES))
async def test_a_refusal_raises_its_codes_class_carrying_the_code(code: str) -> None:
    error = {"code": code, "message": "refused", "field": "f", "callId": "c_1"}
    transport = _refusing(CODES[code], error)
    async with AsyncClient("http://gw", "t", transport=transport) as tb:
        with pytest.raises(ApiError) as refused:
            await tb.create_session()  # not retried, whatever the status
    assert type(refused.value) is ERROR_CLASSES[code]
    assert (refused.value.status, refused.value.code, refused.value.message) == (
        CODES[code],
        code,
        "refused",
    )
    assert (refused.value.field, refused.value.call_id, refused.value.retry_after) == (
        "f",
        "c_1",
        4.0,
    )
    assert isinstance(refused.value, EARLIER.get(code, ApiError))


async def test_a_code_this_client_does_not_know_raises_its_status_class() -> None:
    transport = _refusing(422, {"code": "some_new_refusal", "message": "no"})
    async with AsyncClient("http://gw", "t", transport=transport) as tb:
        with pytest.raises(Unprocessable) as refused:
            await tb.create_session()
    assert refused.value.code == "some_new_refusal"


def test_a_refused_answer_to_a_paused_turn_is_an_invalid_answer() -> None:
    for code in ("unknown_call", "missing_call", "duplicate_call", "wrong_answer"):
        assert ERROR_CLASSES[code] is InvalidAnswer
    assert issubclass(InvalidAnswer, Unprocessable)


async def test_an_answer_to_a_turn_not_waiting_raises_turn_not_waiting(
    gw: LiveGateway, settings: Settings
) -> None:
    assert settings.jwt_secret
    async with AsyncClient(gw.base_url, mint_token(settings.jwt_secret, "alice")) as tb:
        session = await tb.create_session()
        turn = await tb.submit_turn(session.session_id, "hello")
        # No worker runs: the turn is queued, not waiting for an answer.
        with pytest.raises(TurnNotWaiting) as refused:
            await tb.submit_actions(
                session.session_id,
                turn.turn_id,
                tool_results=[ToolResultAnswer("c_1", "42")],
            )
        assert (refused.value.status, refused.value.code) == (409, "turn_not_waiting")
        record = await tb.get_turn(session.session_id, turn.turn_id)
        assert record.status == "queued"  # the refused answer changed nothing
