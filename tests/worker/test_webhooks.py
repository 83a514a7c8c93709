"""A turn's webhook: queued with its terminal event, sent signed by a worker, retried
under one webhook-id, and never lost to a dead sender (services/worker/webhooks.py)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from harness.waits import poll
from tests.webhook_receiver import SECRET, Receiver, documented_recipe
from tests.worker_kit import ProgramModel, WorkerProcess, running_worker, text_round
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.keys import Keys
from turnbus.shared.records import ClientTool, TurnRecord
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore
from turnbus.shared.webhooks import webhook_id
from turnbus.worker.models.base import ModelError, ModelRequest, RoundResult, TextChunk
from turnbus.worker.models.scripted import ScriptedModel

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    server = Receiver()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def _hooked(settings: Settings, receiver: Receiver, **knobs: int) -> Settings:
    """The test's settings with webhooks on: its receiver allowed, short retries."""
    quick = {"webhook_poll_ms": 100, "webhook_retry_ms": 100, "webhook_retry_max_ms": 400}
    return dataclasses.replace(
        settings,
        webhook_secret=SECRET,
        webhook_allow=(f"127.0.0.1:{receiver.port}",),
        **{**quick, **knobs},
    )


async def _delivered(turns: TurnStore, session: str, tid: str) -> TurnRecord | None:
    record = await turns.get("u1", session, tid)
    if record is None or record.webhook is None or record.webhook.state != "delivered":
        return None
    return record


def _check_deliveries(receiver: Receiver, record: TurnRecord) -> None:
    """Every POST of the turn is signed (checked with the documented recipe), names the
    turn's end and carries the same webhook-id and body."""
    verify = documented_recipe()
    posts = [(h, b) for h, b in receiver.requests if h["webhook-id"] == webhook_id(record.turnId)]
    assert posts, f"no webhook for {record.turnId}"
    for headers, body in posts:
        verify(SECRET, headers, body)
        sent = json.loads(body)
        assert sent["type"] == f"turn.{record.status}"
        assert sent["turn"]["turnId"] == record.turnId
        assert sent["turn"]["status"] == record.status
        assert "webhook" not in sent["turn"]
    assert len({body for _, body in posts}) == 1
    with pytest.raises(ValueError):
        verify(SECRET, posts[0][0], posts[0][1] + b" ")


def _last_user_text(request: ModelRequest) -> str:
    content = request.messages[-1]["content"]
    if isinstance(content, str):
        return content
    return " ".join(str(block.get("text", "")) for block in content)


@pytest.mark.cluster
async def test_every_terminal_type_is_delivered_signed_once_per_turn(
    redis: aioredis.Redis, keys: Keys, settings: Settings, receiver: Receiver
) -> None:
    settings = _hooked(settings, receiver, turn_wall_clock_ms=1_000)
    turns = TurnStore(redis, keys, settings)
    store = EnvelopeStore(redis, keys)
    sessions = ["done", "fail", "slow", "cancel", "plain"]
    for session in sessions:
        await store.create("u1", session)

    async def program(request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        text = _last_user_text(request)
        if "fail" in text:
            raise ModelError("overloaded", "the API stayed overloaded")
        if "slow" in text:
            return [TextChunk(".") for _ in range(1000)]
        return text_round("answer")

    tids: dict[str, str] = {}
    # Cancelled while queued: the gateway's script ends it and queues its webhook.
    queued, _, _ = await turns.submit_queued("u1", "cancel", "cancel me", webhook_url=receiver.url)
    await turns.request_cancel("u1", "cancel", queued.turnId)
    tids["cancel"] = queued.turnId
    # A turn without a webhook: nothing is queued, nothing is sent.
    plain, _, _ = await turns.submit_queued("u1", "plain", "plain turn")
    async with running_worker(settings, ProgramModel(program, delay_s=0.01)):
        for session in ("done", "fail", "slow"):
            record, _, _ = await turns.submit_queued(
                "u1", session, f"{session} turn", webhook_url=receiver.url
            )
            tids[session] = record.turnId
        ended = {}
        for session, tid in tids.items():
            ended[session] = await poll(
                lambda s=session, t=tid: _delivered(turns, s, t), within=20, what=session
            )
        await poll(lambda: _plain_done(turns, plain.turnId), within=10, what="the plain turn")
    statuses = {session: record.status for session, record in ended.items()}
    assert statuses == {
        "done": "completed",
        "fail": "failed",
        "slow": "timed_out",
        "cancel": "cancelled",
    }
    for record in ended.values():
        _check_deliveries(receiver, record)
        assert record.webhook is not None and record.webhook.id == webhook_id(record.turnId)
        assert record.webhook.attempts[-1].status == 200
    # One logical delivery per turn, and none for the turn without a webhook.
    assert sorted(set(receiver.ids())) == sorted(webhook_id(t) for t in tids.values())
    assert len(receiver.requests) == len(tids)
    plain_record = await turns.get("u1", "plain", plain.turnId)
    assert plain_record is not None and plain_record.webhook is None
    for session in sessions:
        assert await redis.zcard(keys.webhook_outbox("u1", session)) == 0


async def _plain_done(turns: TurnStore, tid: str) -> bool:
    record = await turns.get("u1", "plain", tid)
    return record is not None and record.terminal


async def test_a_receiver_down_for_ten_seconds_gets_the_webhook_under_one_id(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    receiver = Receiver()  # not listening yet: every POST is refused
    settings = _hooked(settings, receiver, webhook_retry_max_ms=1_000)
    turns = TurnStore(redis, keys, settings)
    await store.create("u1", "s1")
    down_ms = 10_000

    async def down_long_enough() -> bool:
        record = await turns.get("u1", "s1", tid)
        hook = record.webhook if record is not None else None
        if hook is None or len(hook.attempts) < 3:
            return False
        assert all(a.status is None and a.error for a in hook.attempts)
        assert hook.state == "pending" and hook.nextAttemptAt is not None
        return hook.attempts[-1].at - hook.attempts[0].at >= down_ms

    try:
        async with running_worker(settings, ProgramModel(lambda r, i: _answer())):
            record, _, _ = await turns.submit_queued("u1", "s1", "hi", webhook_url=receiver.url)
            tid = record.turnId
            await poll(down_long_enough, within=30, what="ten seconds of refused POSTs")
            await receiver.start()
            ended = await poll(lambda: _delivered(turns, "s1", tid), within=10, what="delivery")
    finally:
        await receiver.stop()
    assert ended.webhook is not None
    failed = [a for a in ended.webhook.attempts if a.status is None]
    assert len(failed) >= 3 and ended.webhook.attempts[-1].status == 200
    # Backoff: the waits grow (jittered) up to the cap.
    gaps = [b.at - a.at for a, b in itertools.pairwise(failed)]
    assert max(gaps) <= 1_000 + 500 and gaps[-1] >= 400
    assert set(receiver.ids()) == {webhook_id(tid)}
    _check_deliveries(receiver, ended)


async def _answer() -> list[TextChunk | RoundResult]:
    return text_round("answer")


@pytest.mark.cluster
async def test_a_sender_killed_mid_post_loses_no_webhook(
    redis: aioredis.Redis,
    keys: Keys,
    settings: Settings,
    store: EnvelopeStore,
    receiver: Receiver,
    tmp_path: Path,
) -> None:
    settings = _hooked(settings, receiver, webhook_timeout_ms=1_000)
    turns = TurnStore(redis, keys, settings)
    await store.create("u1", "s1")
    receiver.hang = True  # the victim's POST is never answered
    victim = WorkerProcess(
        settings,
        "victim",
        tmp_path / "victim.log",
        TURNBUS_WEBHOOK_SECRET=SECRET,
        TURNBUS_WEBHOOK_ALLOW=f"127.0.0.1:{receiver.port}",
        TURNBUS_WEBHOOK_TIMEOUT_MS="2000",
    )
    try:
        record, _, _ = await turns.submit_queued("u1", "s1", "hi", webhook_url=receiver.url)
        tid = record.turnId
        await poll(lambda: receiver.requests, within=20, what="the victim's POST")
        ended = await turns.get("u1", "s1", tid)
        assert ended is not None and ended.status == "completed"
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(timeout=10)
    finally:
        victim.stop()
    assert ended.webhook is not None and ended.webhook.attempts == []
    receiver.hang = False
    # The victim's claim lapses three of its timeouts (6 s) after it was taken; the
    # rescuer's pass finds the delivery due then.
    async with running_worker(settings, ProgramModel(lambda r, i: _answer()), name="rescuer"):
        delivered = await poll(lambda: _delivered(turns, "s1", tid), within=15, what="delivery")
    assert set(receiver.ids()) == {webhook_id(tid)}
    assert len(receiver.requests) == 2  # sent twice: at least once, as the docs say
    _check_deliveries(receiver, delivered)


async def test_a_slow_receiver_does_not_hold_up_another(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    slow, fast = Receiver(), Receiver()
    slow.hang = True
    await slow.start()
    await fast.start()
    settings = dataclasses.replace(
        _hooked(settings, slow, webhook_timeout_ms=20_000, webhook_host_concurrency=1),
        webhook_allow=(f"127.0.0.1:{slow.port}", f"127.0.0.1:{fast.port}"),
    )
    turns = TurnStore(redis, keys, settings)
    try:
        async with running_worker(settings, ProgramModel(lambda r, i: _answer())):
            for n in range(4):
                await store.create("u1", f"slow{n}")
                await turns.submit_queued("u1", f"slow{n}", "hi", webhook_url=slow.url)
            await poll(lambda: slow.requests, within=10, what="the slow receiver's first POST")
            await store.create("u1", "fast")
            record, _, _ = await turns.submit_queued("u1", "fast", "hi", webhook_url=fast.url)
            # Delivered while every slow POST is still held (one at a time: its bound).
            await poll(lambda: _delivered(turns, "fast", record.turnId), within=5, what="fast")
            assert len(slow.requests) == 1
    finally:
        await slow.stop()
        await fast.stop()


async def _paused(turns: TurnStore, session: str, tid: str) -> bool:
    record = await turns.get("u1", session, tid)
    return record is not None and record.status == "requires_action"


async def test_a_paused_turn_ended_by_a_cancel_or_its_action_timeout_is_delivered(
    redis: aioredis.Redis, keys: Keys, settings: Settings, receiver: Receiver
) -> None:
    # Short leases and a short outbox grace: the action timeout's re-enqueue comes soon.
    settings = dataclasses.replace(
        _hooked(settings, receiver),
        lease_ms=1000,
        heartbeat_ms=200,
        claim_idle_ms=600,
        outbox_grace_ms=400,
    )
    turns = TurnStore(redis, keys, settings)
    store = EnvelopeStore(redis, keys)
    pick = ClientTool(name="pick_file", inputSchema={"type": "object"})
    call = 'call pick_file {"prompt": "a"}'
    tids: dict[str, str] = {}
    async with running_worker(settings, ScriptedModel(settings)):
        for session, timeout_s in (("cancel", 3600), ("timeout", 1)):
            await store.create("u1", session)
            record, _, _ = await turns.submit_queued(
                "u1",
                session,
                call,
                client_tools=[pick],
                action_timeout_s=timeout_s,
                webhook_url=receiver.url,
            )
            tids[session] = record.turnId
        for session, tid in tids.items():
            await poll(lambda s=session, t=tid: _paused(turns, s, t), within=15, what=session)
        # A pause is not an end: nothing is queued or sent for it.
        assert receiver.requests == []
        # Cancelled while paused: the gateway's script ends it and queues its webhook
        # (a worker's pass over the slots sends it).
        cancelled = await turns.request_cancel("u1", "cancel", tids["cancel"])
        assert cancelled.status == "cancelled"
        ended = {
            session: await poll(
                lambda s=session, t=tid: _delivered(turns, s, t), within=25, what=session
            )
            for session, tid in tids.items()
        }
    assert {s: r.status for s, r in ended.items()} == {
        "cancel": "cancelled",
        "timeout": "timed_out",
    }
    assert ended["timeout"].reason == "action_timeout"
    for record in ended.values():
        _check_deliveries(receiver, record)
    types = sorted(json.loads(body)["type"] for _, body in receiver.requests)
    assert types == ["turn.cancelled", "turn.timed_out"]
    for session in tids:
        assert await redis.zcard(keys.webhook_outbox("u1", session)) == 0
