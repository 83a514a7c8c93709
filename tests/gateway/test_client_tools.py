"""A submit's client tools: checked (each refusal a 422 naming the field, nothing
written), stored on the turn record, part of the Idempotency-Key's body."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from turnbus.shared import caps
from turnbus.shared.keys import Keys

pytestmark = pytest.mark.timeout(60)

PICK = {
    "name": "pick_file",
    "description": "Ask the user to pick a file.",
    "inputSchema": {"type": "object", "properties": {"prompt": {"type": "string"}}},
}


@pytest.fixture
async def sid(http: httpx.AsyncClient) -> str:
    r = await http.post("/v1/sessions")
    assert r.status_code == 201
    return str(r.json()["sessionId"])


async def test_client_tools_are_stored_on_the_turn_record(
    http: httpx.AsyncClient, sid: str
) -> None:
    url = f"/v1/sessions/{sid}/turns"
    r = await http.post(url, json={"message": "hi", "clientTools": [PICK], "actionTimeoutS": 60})
    assert r.status_code == 202, r.text
    record = (await http.get(f"{url}/{r.json()['turnId']}")).json()
    assert record["clientTools"] == [PICK]
    assert record["actionTimeoutMs"] == 60_000
    assert record["status"] == "queued" and "pendingCalls" not in record


async def test_an_action_timeout_above_the_setting_is_capped(
    http: httpx.AsyncClient, sid: str
) -> None:
    url = f"/v1/sessions/{sid}/turns"
    body = {"message": "hi", "clientTools": [PICK], "actionTimeoutS": 10**7}
    r = await http.post(url, json=body)
    assert r.status_code == 202, r.text
    record = (await http.get(f"{url}/{r.json()['turnId']}")).json()
    assert record["actionTimeoutMs"] == 24 * 3600 * 1000


def _tool(**changes: Any) -> dict[str, Any]:
    return {**PICK, **changes}


@pytest.mark.parametrize(
    ("tools", "field"),
    [
        ([_tool(name="bad name")], "clientTools[0].name"),
        ([_tool(name="")], "clientTools[0].name"),
        ([PICK, _tool()], "clientTools[1].name"),
        ([_tool(name="working_notes_get")], "clientTools[0].name"),
        ([_tool(inputSchema={"type": "string"})], "clientTools[0].inputSchema"),
        ([_tool(inputSchema={"type": "object", "properties": 5})], "clientTools[0].inputSchema"),
        (
            [_tool(description="d" * (caps.CLIENT_TOOL_DESCRIPTION_MAX_BYTES + 1))],
            "clientTools[0].description",
        ),
        ([_tool(name=f"t{i}") for i in range(caps.CLIENT_TOOLS_MAX + 1)], "clientTools"),
        ([_tool(extra=1)], "clientTools[0].extra"),
        ([{"description": "no name"}], "clientTools[0].name"),
    ],
)
async def test_a_bad_client_tool_is_refused_naming_the_field_and_nothing_is_written(
    http: httpx.AsyncClient,
    sid: str,
    redis: aioredis.Redis,
    keys: Keys,
    tools: list[dict[str, Any]],
    field: str,
) -> None:
    r = await http.post(f"/v1/sessions/{sid}/turns", json={"message": "hi", "clientTools": tools})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "unprocessable"
    assert error["field"] == field, error
    assert await redis.llen(keys.active("alice", sid)) == 0
    assert await redis.xlen(keys.work(0)) == 0


async def test_a_zero_action_timeout_is_refused(http: httpx.AsyncClient, sid: str) -> None:
    body = {"message": "hi", "clientTools": [PICK], "actionTimeoutS": 0}
    r = await http.post(f"/v1/sessions/{sid}/turns", json=body)
    assert r.status_code == 422 and r.json()["error"]["field"] == "actionTimeoutS", r.text


async def test_the_idempotency_key_covers_the_client_tools(
    http: httpx.AsyncClient, sid: str
) -> None:
    url = f"/v1/sessions/{sid}/turns"
    headers = {"Idempotency-Key": "k1"}
    body = {"message": "hi", "clientTools": [PICK]}
    first = await http.post(url, json=body, headers=headers)
    again = await http.post(url, json=body, headers=headers)
    assert first.status_code == again.status_code == 202
    assert again.json()["turnId"] == first.json()["turnId"]
    other = await http.post(url, json={"message": "hi"}, headers=headers)
    assert other.status_code == 409 and other.json()["error"]["code"] == "conflict"
