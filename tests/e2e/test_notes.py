"""End to end: a live gateway over HTTP, a worker, a real Redis and the scripted model.

The working notes as a user meets them: "remember …" writes them, the next turn's
``/system`` and the system prompt the model receives both carry them, "forget
everything" removes them, and a cancel, the wall clock or an over-cap write never
loses or truncates them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from tests.gateway_server import LiveGateway, live_gateway, sse_events
from tests.worker_kit import running_worker, wait_until
from turnbus.gateway.auth import mint_token
from turnbus.shared import caps
from turnbus.shared.settings import Settings
from turnbus.shared.system import WORKING_NOTES_FOLD, working_notes_block
from turnbus.worker.models.base import ModelRequest, RoundResult, TextChunk
from turnbus.worker.models.scripted import ScriptedModel
from turnbus.worker.tools import NOTES_CLEARED

pytestmark = [pytest.mark.timeout(60), pytest.mark.cluster]


class RecordingModel:
    """The scripted model, recording the system prompt of every round it is asked for."""

    name = "scripted"

    def __init__(self, settings: Settings) -> None:
        self.inner = ScriptedModel(settings)
        self.requests: list[ModelRequest] = []

    async def stream_round(self, request: ModelRequest) -> AsyncIterator[TextChunk | RoundResult]:
        self.requests.append(request)
        async for item in self.inner.stream_round(request):
            yield item

    async def aclose(self) -> None:
        await self.inner.aclose()


@dataclasses.dataclass
class Stack:
    http: httpx.AsyncClient
    model: RecordingModel
    gateway: LiveGateway


@contextlib.asynccontextmanager
async def stack(settings: Settings) -> AsyncIterator[Stack]:
    assert settings.jwt_secret
    model = RecordingModel(settings)
    headers = {"Authorization": f"Bearer {mint_token(settings.jwt_secret, 'alice')}"}
    async with (
        live_gateway(settings) as gateway,
        running_worker(settings, model, name="e2e"),
        httpx.AsyncClient(base_url=gateway.base_url, headers=headers, timeout=20) as http,
    ):
        yield Stack(http, model, gateway)


async def new_session(http: httpx.AsyncClient) -> str:
    r = await http.post("/v1/sessions")
    assert r.status_code == 201, r.text
    return str(r.json()["sessionId"])


async def submit(http: httpx.AsyncClient, session: str, message: str) -> str:
    r = await http.post(f"/v1/sessions/{session}/turns", json={"message": message})
    assert r.status_code == 202, r.text
    return str(r.json()["turnId"])


async def follow(http: httpx.AsyncClient, session: str, turn: str) -> list[dict[str, Any]]:
    """Every event of the turn over SSE; the stream ends after the terminal event."""
    out: list[dict[str, Any]] = []
    async with http.stream("GET", f"/v1/sessions/{session}/turns/{turn}/events") as r:
        assert r.status_code == 200
        async for event in sse_events(r.aiter_lines()):
            out.append(event.json())
    return out


async def notes_of(http: httpx.AsyncClient, session: str) -> dict[str, Any]:
    r = await http.get(f"/v1/sessions/{session}/notes")
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def system_of(http: httpx.AsyncClient, session: str) -> str:
    r = await http.get(f"/v1/sessions/{session}/system")
    assert r.status_code == 200, r.text
    return r.text


def of_type(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]


async def test_remember_then_the_next_turn_sees_it_then_forget(
    settings: Settings, redis: aioredis.Redis
) -> None:
    async with stack(settings) as s:
        sid = await new_session(s.http)
        first = await submit(s.http, sid, "remember the build is green")
        events = await follow(s.http, sid, first)
        assert events[-1]["type"] == "turn.completed"
        [notes_event] = of_type(events, "working_notes")
        assert notes_event["action"] == "update" and notes_event["persisted"] is True
        assert "notes" not in notes_event  # size and digest only, never the text
        assert notes_event["sha256"] == hashlib.sha256(b"- the build is green").hexdigest()
        assert await notes_of(s.http, sid) == {"notes": "- the build is green", "bytes": 20}

        system = await system_of(s.http, sid)
        assert system.endswith(working_notes_block("- the build is green") or "")
        second = await submit(s.http, sid, "how are things?")
        events = await follow(s.http, sid, second)
        # The next turn's model received exactly the system the API shows.
        assert s.model.requests[-1].system == system
        reply = "".join(e["text"] for e in of_type(events, "text.delta"))
        assert "I see 20 bytes of working notes" in reply

        third = await submit(s.http, sid, "forget everything")
        events = await follow(s.http, sid, third)
        assert [e["output"] for e in of_type(events, "tool.result")] == [NOTES_CLEARED]
        assert of_type(events, "working_notes")[0]["action"] == "clear"
        assert (await notes_of(s.http, sid))["bytes"] == 0
        assert WORKING_NOTES_FOLD not in await system_of(s.http, sid)
        await submit(s.http, sid, "anything left?")
        await wait_until(lambda: _true(len(s.model.requests) >= 6))
        assert WORKING_NOTES_FOLD not in s.model.requests[-1].system


async def test_a_note_survives_a_cancel(settings: Settings, redis: aioredis.Redis) -> None:
    slow = dataclasses.replace(settings, scripted_delay_ms=150)
    async with stack(slow) as s:
        sid = await new_session(s.http)
        turn = await submit(s.http, sid, "remember the cache is warm")
        seen: list[dict[str, Any]] = []
        async with s.http.stream("GET", f"/v1/sessions/{sid}/turns/{turn}/events") as r:
            async for event in sse_events(r.aiter_lines()):
                seen.append(event.json())
                if event.json()["type"] == "working_notes":
                    cancel = await s.http.post(f"/v1/sessions/{sid}/turns/{turn}/cancel")
                    assert cancel.status_code == 202
        assert seen[-1]["type"] == "turn.cancelled"
        assert (await notes_of(s.http, sid))["notes"] == "- the cache is warm"
        record = (await s.http.get(f"/v1/sessions/{sid}/turns/{turn}")).json()
        assert record["status"] == "cancelled"


async def test_past_the_wall_clock_the_turn_times_out_and_keeps_its_notes(
    settings: Settings, redis: aioredis.Redis
) -> None:
    slow = dataclasses.replace(settings, scripted_delay_ms=120, turn_wall_clock_ms=900)
    async with stack(slow) as s:
        sid = await new_session(s.http)
        turn = await submit(
            s.http, sid, "remember the deploy needs a feature flag and a rollback plan first"
        )
        events = await follow(s.http, sid, turn)
        assert events[-1]["type"] == "turn.timed_out"
        assert of_type(events, "working_notes"), "the note was written before the clock ran out"
        notes = await notes_of(s.http, sid)
        assert notes["notes"] == "- the deploy needs a feature flag and a rollback plan first"


async def test_an_over_cap_update_is_an_error_and_changes_nothing(
    settings: Settings, redis: aioredis.Redis
) -> None:
    async with stack(settings) as s:
        sid = await new_session(s.http)
        near_cap = "n" * (caps.WORKING_NOTES_MAX_BYTES - 10)
        envelope = (await s.http.get(f"/v1/sessions/{sid}")).json()
        r = await s.http.put(
            f"/v1/sessions/{sid}/meta",
            json={"updatedAt": envelope["updatedAt"] + 1, "meta": {"workingNotes": near_cap}},
        )
        assert r.status_code == 200, r.text
        turn = await submit(s.http, sid, "remember one more thing that does not fit")
        events = await follow(s.http, sid, turn)
        [result] = of_type(events, "tool.result")
        assert result["isError"] is True
        assert result["output"].startswith(
            "ERROR working_notes_update: notes exceed the 32 KiB cap"
        )
        assert f"the cap is {caps.WORKING_NOTES_MAX_BYTES} bytes" in result["output"]
        assert of_type(events, "working_notes") == []
        assert (await notes_of(s.http, sid))["notes"] == near_cap


async def _true(value: bool) -> bool:
    return value


async def test_a_model_paced_at_a_token_rate_streams_a_round_as_several_deltas(
    settings: Settings, redis: aioredis.Redis
) -> None:
    paced = dataclasses.replace(settings, scripted_ttft_ms=20, scripted_tokens_per_s=40)
    async with stack(paced) as s:
        sid = await new_session(s.http)
        turn = await submit(s.http, sid, "remember the release train leaves every second Tuesday")
        events = await follow(s.http, sid, turn)
        assert events[-1]["type"] == "turn.completed"
        deltas = of_type(events, "text.delta")
        last_round = [e for e in deltas if e["round"] == 2]
        # Deltas 75 ms apart outlast the worker's 50 ms coalescing window.
        assert len(last_round) > 1
        assert "".join(e["text"] for e in last_round).startswith(
            "Noted: the release train leaves every second Tuesday."
        )
