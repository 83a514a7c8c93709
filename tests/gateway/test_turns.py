from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx
import pytest
import redis.asyncio as aioredis

from harness.waits import poll
from tests.gateway_server import LiveGateway, live_gateway, signed_in
from tests.turn_kit import end_turn
from tests.worker_kit import running_worker
from turnbus.shared import caps
from turnbus.shared.keys import Keys
from turnbus.shared.meta import AUTO_TITLE_MAX_CHARS, title_from_message
from turnbus.shared.settings import Settings
from turnbus.worker.models.scripted import ScriptedModel

# The gateway's suite runs on one Redis and on the local Redis Cluster.
pytestmark = pytest.mark.cluster


@pytest.fixture
async def sid(http: httpx.AsyncClient) -> str:
    r = await http.post("/v1/sessions")
    assert r.status_code == 201
    return str(r.json()["sessionId"])


def _error(r: httpx.Response, status: int, code: str) -> dict[str, str]:
    assert r.status_code == status, r.text
    error: dict[str, str] = r.json()["error"]
    assert error["code"] == code
    return error


async def _work_entries(redis: aioredis.Redis, keys: Keys) -> list[dict[str, str]]:
    return [fields for _, fields in await redis.xrange(keys.work(0))]


async def test_submit_get_and_work_entry(
    http: httpx.AsyncClient, sid: str, redis: aioredis.Redis, keys: Keys
) -> None:
    r = await http.post(f"/v1/sessions/{sid}/turns", json={"message": "hello"})
    assert r.status_code == 202, r.text
    body = r.json()
    tid = body["turnId"]
    assert body == {
        "turnId": tid,
        "status": "queued",
        "eventsUrl": f"/v1/sessions/{sid}/turns/{tid}/events",
    }
    assert await _work_entries(redis, keys) == [{"user": "alice", "session": sid, "turn": tid}]
    record = (await http.get(f"/v1/sessions/{sid}/turns/{tid}")).json()
    assert record["turnId"] == tid
    assert record["status"] == "queued"
    assert record["message"] == "hello"
    assert record["userId"] == "alice"
    _error(await http.get(f"/v1/sessions/{sid}/turns/t_missing"), 404, "not_found")


async def test_idempotency_key(
    http: httpx.AsyncClient, sid: str, redis: aioredis.Redis, keys: Keys, gw: LiveGateway
) -> None:
    url = f"/v1/sessions/{sid}/turns"
    first = await http.post(url, json={"message": "once"}, headers={"Idempotency-Key": "abc"})
    again = await http.post(url, json={"message": "once"}, headers={"Idempotency-Key": "abc"})
    assert first.status_code == again.status_code == 202
    assert first.json()["turnId"] == again.json()["turnId"]
    assert again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    assert len(await _work_entries(redis, keys)) == 1
    error = _error(
        await http.post(url, json={"message": "other"}, headers={"Idempotency-Key": "abc"}),
        409,
        "conflict",
    )
    assert error["turnId"] == first.json()["turnId"]
    assert len(await _work_entries(redis, keys)) == 1
    _error(
        await http.post(url, json={"message": "x"}, headers={"Idempotency-Key": "k" * 300}),
        400,
        "bad_request",
    )
    metrics = gw.app.state.metrics
    assert metrics.turns_accepted._value.get() == 1
    assert metrics.idempotent_replays._value.get() == 1


async def test_concurrent_submissions_accept_exactly_one_turn(
    http: httpx.AsyncClient, redis: aioredis.Redis, keys: Keys, gw: LiveGateway
) -> None:
    url = "/v1/sessions/{}/turns"
    # The same Idempotency-Key at once: one turn, one queue entry, the rest replays.
    sid = (await http.post("/v1/sessions")).json()["sessionId"]
    same = await asyncio.gather(
        *(
            http.post(url.format(sid), json={"message": "m"}, headers={"Idempotency-Key": "k"})
            for _ in range(10)
        )
    )
    assert {r.status_code for r in same} == {202}
    assert len({r.json()["turnId"] for r in same}) == 1
    assert sum(r.headers.get("idempotent-replayed") == "true" for r in same) == 9
    assert len(await _work_entries(redis, keys)) == 1
    # Different bodies at once on an idle session: one wins, the rest are told who.
    sid = (await http.post("/v1/sessions")).json()["sessionId"]
    racing = await asyncio.gather(
        *(http.post(url.format(sid), json={"message": f"m{i}"}) for i in range(10))
    )
    winners = [r.json()["turnId"] for r in racing if r.status_code == 202]
    assert len(winners) == 1
    for r in racing:
        if r.status_code != 202:
            assert _error(r, 409, "session_busy")["activeTurnId"] == winners[0]
    assert len(await _work_entries(redis, keys)) == 2
    metrics = gw.app.state.metrics
    assert metrics.turns_accepted._value.get() == 2
    assert metrics.idempotent_replays._value.get() == 9


async def test_busy_session_and_enqueue(
    http: httpx.AsyncClient, sid: str, redis: aioredis.Redis, keys: Keys, gw: LiveGateway
) -> None:
    url = f"/v1/sessions/{sid}/turns"
    active = (await http.post(url, json={"message": "first"})).json()["turnId"]
    error = _error(await http.post(url, json={"message": "second"}), 409, "session_busy")
    assert error["activeTurnId"] == active
    assert active in error["message"]
    assert len(await _work_entries(redis, keys)) == 1
    r = await http.post(url, json={"message": "second", "multitask": "enqueue"})
    assert r.status_code == 202
    assert len(await _work_entries(redis, keys)) == 2
    # Once the active turns end, the session takes a plain turn again.
    for tid in (active, r.json()["turnId"]):
        await end_turn(gw.gateway.turns, "alice", sid, tid, "completed")
    assert (await http.post(url, json={"message": "third"})).status_code == 202


async def test_submit_refusals(
    http: httpx.AsyncClient, sid: str, redis: aioredis.Redis, keys: Keys
) -> None:
    url = f"/v1/sessions/{sid}/turns"
    big = "é" * (caps.TURN_MESSAGE_MAX_BYTES // 2 + 1)
    _error(await http.post(url, json={"message": big}), 413, "payload_too_large")
    assert (
        await http.post(url, json={"message": "a" * caps.TURN_MESSAGE_MAX_BYTES})
    ).status_code == 202
    await redis.delete(keys.active("alice", sid))
    for body, field in [
        ({"message": ""}, "message"),
        ({"message": "   "}, "message"),
        ({"message": 5}, "message"),
        ({}, "message"),
        ({"message": "hi", "extra": 1}, "extra"),
        ({"message": "hi", "multitask": "rollback"}, "multitask"),
    ]:
        error = _error(await http.post(url, json=body), 422, "unprocessable")
        assert error["field"] == field, body
    _error(await http.post(url, content=b"nope"), 400, "bad_request")
    _error(await http.post("/v1/sessions/s_nope/turns", json={"message": "x"}), 404, "not_found")
    assert len(await _work_entries(redis, keys)) == 1


async def test_the_turn_record_serves_usage_as_an_object(
    http: httpx.AsyncClient, sid: str, redis: aioredis.Redis, keys: Keys
) -> None:
    tid = (await http.post(f"/v1/sessions/{sid}/turns", json={"message": "x"})).json()["turnId"]
    # Stored as the worker stores it: JSON text in one hash field.
    counts = {"inputTokens": 12, "outputTokens": 5, "cacheReadTokens": 3, "cacheWriteTokens": 0}
    await redis.hset(keys.turn("alice", sid, tid), "usage", json.dumps(counts))
    r = await http.get(f"/v1/sessions/{sid}/turns/{tid}")
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == counts
    # Counts that do not parse leave the record readable, without usage.
    await redis.hset(keys.turn("alice", sid, tid), "usage", "not json")
    r = await http.get(f"/v1/sessions/{sid}/turns/{tid}")
    assert r.status_code == 200, r.text
    assert "usage" not in r.json() and r.json()["turnId"] == tid


async def test_cancel(http: httpx.AsyncClient, sid: str, keys: Keys, redis: aioredis.Redis) -> None:
    tid = (await http.post(f"/v1/sessions/{sid}/turns", json={"message": "x"})).json()["turnId"]
    r = await http.post(f"/v1/sessions/{sid}/turns/{tid}/cancel")
    assert r.status_code == 202
    assert r.json()["status"] == "cancelled"
    # A terminal turn stays as it is.
    r = await http.post(f"/v1/sessions/{sid}/turns/{tid}/cancel")
    assert r.status_code == 202
    assert r.json()["status"] == "cancelled"
    _error(await http.post(f"/v1/sessions/{sid}/turns/t_nope/cancel"), 404, "not_found")
    events = await redis.xrange(keys.turn_events("alice", sid, tid))
    assert [f["data"].split('"type":"')[1].split('"')[0] for _, f in events] == [
        "turn.queued",
        "turn.cancelled",
    ]


async def test_a_full_session_queue_answers_429_and_writes_nothing(
    settings: Settings, redis: aioredis.Redis, keys: Keys
) -> None:
    settings = dataclasses.replace(settings, session_queue_max=3)
    async with live_gateway(settings) as gw, signed_in(gw, settings) as http:
        sid = (await http.post("/v1/sessions")).json()["sessionId"]
        other = (await http.post("/v1/sessions")).json()["sessionId"]
        url = f"/v1/sessions/{sid}/turns"
        accepted = []
        for i in range(3):
            r = await http.post(
                url,
                json={"message": f"m{i}", "multitask": "enqueue"},
                headers={"Idempotency-Key": f"k{i}"},
            )
            assert r.status_code == 202, r.text
            accepted.append(r.json()["turnId"])
        before_turns = await redis.zcard(keys.turns("alice", sid))
        before_work = len(await _work_entries(redis, keys))
        before_keys = sorted([k async for k in redis.scan_iter(match=f"{keys.prefix}:*")])

        r = await http.post(
            url,
            json={"message": "one more", "multitask": "enqueue"},
            headers={"Idempotency-Key": "k9"},
        )
        error = _error(r, 429, "session_queue_full")
        assert int(r.headers["Retry-After"]) >= 1
        assert "3" in error["message"]
        # Nothing was written: no record, no work entry, no idempotency key, no new stream.
        assert await redis.zcard(keys.turns("alice", sid)) == before_turns
        assert len(await _work_entries(redis, keys)) == before_work
        assert sorted([k async for k in redis.scan_iter(match=f"{keys.prefix}:*")]) == before_keys
        assert await redis.llen(keys.active("alice", sid)) == 3

        # A replay of an accepted turn still answers as before.
        again = await http.post(
            url, json={"message": "m1", "multitask": "enqueue"}, headers={"Idempotency-Key": "k1"}
        )
        assert again.status_code == 202
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.json()["turnId"] == accepted[1]
        # Another session is not affected, and once a turn ends the session takes one more.
        assert (
            await http.post(f"/v1/sessions/{other}/turns", json={"message": "x"})
        ).status_code == 202
        await end_turn(gw.gateway.turns, "alice", sid, accepted[0], "completed")
        r = await http.post(url, json={"message": "now", "multitask": "enqueue"})
        assert r.status_code == 202, r.text


async def test_the_first_message_titles_an_untitled_session_and_a_host_title_wins(
    http: httpx.AsyncClient, redis: aioredis.Redis, keys: Keys
) -> None:
    sid = (await http.post("/v1/sessions")).json()["sessionId"]
    message = "Plan the release of version two for the mobile and web teams together\nthen more"
    await http.post(f"/v1/sessions/{sid}/turns", json={"message": message})
    envelope = (await http.get(f"/v1/sessions/{sid}")).json()
    title = "Plan the release of version two for the mobile and web…"
    assert envelope["meta"]["title"] == title and len(title) <= 60
    row = (await http.get("/v1/sessions")).json()["sessions"][0]
    assert (row["sessionId"], row["title"]) == (sid, title)
    # The title write is on the session log, like any envelope write.
    log = [json.loads(f["data"]) for _, f in await redis.xrange(keys.log("alice", sid))]
    assert log[-1]["origin"] == "submit" and log[-1]["set"] == {"title": title}

    # A later turn leaves the title alone; so does one after the host cleared it.
    await http.post(
        f"/v1/sessions/{sid}/turns", json={"message": "other words", "multitask": "enqueue"}
    )
    assert (await http.get(f"/v1/sessions/{sid}")).json()["meta"]["title"] == title

    # The host's replace wins: it renames the session, or clears the title.
    put = await http.put(
        f"/v1/sessions/{sid}/meta",
        json={"updatedAt": envelope["updatedAt"] + 1, "meta": {"title": "Release plan"}},
    )
    assert put.status_code == 200, put.text
    assert (await http.get(f"/v1/sessions/{sid}")).json()["meta"]["title"] == "Release plan"
    cleared = await http.put(
        f"/v1/sessions/{sid}/meta", json={"updatedAt": put.json()["updatedAt"] + 1, "meta": {}}
    )
    assert "title" not in cleared.json()["meta"]
    await http.post(f"/v1/sessions/{sid}/turns", json={"message": "third", "multitask": "enqueue"})
    assert "title" not in (await http.get(f"/v1/sessions/{sid}")).json()["meta"]

    # A title the host gave at creation stays through the first turn.
    named = (await http.post("/v1/sessions", json={"meta": {"title": "Mine"}})).json()
    await http.post(f"/v1/sessions/{named['sessionId']}/turns", json={"message": "hello"})
    got = (await http.get(f"/v1/sessions/{named['sessionId']}")).json()
    assert got["meta"]["title"] == "Mine"


@pytest.mark.parametrize(
    ("message", "title"),
    [
        ("hello", "hello"),
        ("\n\n  spaced   out \t words \nsecond line", "spaced out words"),
        ("x" * 80, "x" * 59 + "…"),
        ("word " * 12 + "tail", "word " * 11 + "word…"),
        ("abc " * 14 + "defghijk", "abc " * 13 + "abc…"),
        ("a" * 60, "a" * 60),
        ("   \n  ", ""),
    ],
)
def test_title_from_message(message: str, title: str) -> None:
    assert title_from_message(message) == title
    assert len(title_from_message(message)) <= AUTO_TITLE_MAX_CHARS


async def test_an_interrupt_over_http_ends_the_running_turn_interrupted_and_starts_the_new(
    http: httpx.AsyncClient, sid: str, settings: Settings
) -> None:
    slow = dataclasses.replace(settings, scripted_delay_ms=100, scripted_rounds=40)
    url = f"/v1/sessions/{sid}/turns"
    async with running_worker(slow, ScriptedModel(slow)):
        first = (await http.post(url, json={"message": "take your time"})).json()["turnId"]

        async def running() -> bool:
            return bool((await http.get(f"{url}/{first}")).json()["status"] == "running")

        await poll(running, within=10, interval=0.02)
        await asyncio.sleep(0.3)  # mid-stream
        r = await http.post(url, json={"message": "a new question", "multitask": "interrupt"})
        assert r.status_code == 202, r.text
        second = r.json()["turnId"]
        # The first turn's stream ends with its terminal event: cancelled, interrupted.
        events = (await http.get(f"{url}/{first}/events", timeout=10)).text
        terminal = [line for line in events.splitlines() if '"turn.cancelled"' in line]
        assert len(terminal) == 1
        data = json.loads(terminal[0].removeprefix("data: "))
        assert (data["reason"], data["by"]) == ("interrupted", second)
        record = (await http.get(f"{url}/{first}")).json()
        assert (record["status"], record["reason"], record["by"]) == (
            "cancelled",
            "interrupted",
            second,
        )

        # The new turn starts next (how soon is tests/worker/test_interrupt.py's).
        async def second_started() -> bool:
            status = (await http.get(f"{url}/{second}")).json()["status"]
            return status in ("running", "completed")

        await poll(second_started, within=10, interval=0.02)
        await http.post(f"{url}/{second}/cancel")
