"""Redis blips under 200 concurrent turns: connections reset with replies in flight,
added latency then none, Redis paused then continued, a restart that loads its data.

The gateway and a worker run in this process and reach Redis through a fault-injecting
proxy (harness/fault_proxy.py); the test reads Redis directly. After each fault: every
turn ends with exactly one terminal event, on its first attempt, with no event written
twice; no request answers 500 (a 503 carries Retry-After); and every turn in flight ends
within 5 s of Redis answering normally again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import signal
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
import uvloop

from harness.fault_proxy import FaultProxy, fault_proxy
from harness.redis_server import SlowLoadingRedis
from tests.gateway_server import SseEvent, live_gateway, signed_in, sse_events
from tests.worker_kit import ProgramModel, running_worker, text_round, wait_until
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.events import TERMINAL_TYPES, TurnStarted, decode_event, is_terminal
from turnbus.shared.keys import Keys
from turnbus.shared.records import TERMINAL_STATUSES
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore
from turnbus.worker.consumer import Worker
from turnbus.worker.events_out import EventWriter
from turnbus.worker.models.base import ModelRequest, RoundResult, TextChunk
from turnbus.worker.retry import REDIS_UNAVAILABLE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

TURNS = 200
# Every turn in flight ends within this of Redis answering normally again.
RECOVERY_S = 5.0
_CHUNKS = 10
# Followed over SSE as well as read from Redis, per fault.
FOLLOWED = 20


class GatedModel(ProgramModel):
    """Each round waits for :attr:`gate`, then streams ten chunks 50 ms apart; every chunk
    of every round is different text, so a text.delta written twice shows."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.chunks = 0
        super().__init__(self._play, delay_s=0.05)

    async def stream_round(self, request: ModelRequest) -> AsyncIterator[TextChunk | RoundResult]:
        async for item in super().stream_round(request):
            if isinstance(item, TextChunk):
                self.chunks += 1
            yield item

    async def _play(self, request: ModelRequest, index: int) -> list[TextChunk | RoundResult]:
        await self.gate.wait()
        text = "".join(f"<{index:06d}.{i:02d}>" for i in range(_CHUNKS))
        return text_round(text, chunks=_CHUNKS)


@dataclasses.dataclass
class Stack:
    settings: Settings
    keys: Keys
    proxy: FaultProxy
    direct: aioredis.Redis  # the test's own client, not through the proxy
    http: httpx.AsyncClient
    worker: Worker
    model: GatedModel
    user: str = "alice"
    statuses: list[tuple[int, str | None]] = dataclasses.field(default_factory=list)

    async def sessions(self, n: int) -> list[str]:
        store = EnvelopeStore(self.direct, self.keys)
        ids = [f"s{uuid.uuid4().hex[:10]}" for _ in range(n)]
        await asyncio.gather(*(store.create(self.user, sid) for sid in ids))
        return ids

    async def submit(self, session: str, *, within: float = 30.0) -> str:
        """One turn over HTTP, retried with its Idempotency-Key while the answer is 503
        (as a client following Retry-After would); every answer is recorded."""
        key = uuid.uuid4().hex
        deadline = asyncio.get_running_loop().time() + within
        while True:
            try:
                resp = await self.http.post(
                    f"/v1/sessions/{session}/turns",
                    json={"message": "hello"},
                    headers={"Idempotency-Key": key},
                )
            except httpx.TransportError:
                self.statuses.append((0, None))
            else:
                self.statuses.append((resp.status_code, resp.headers.get("retry-after")))
                if resp.status_code == 202:
                    return str(resp.json()["turnId"])
                assert resp.status_code == 503, resp.text
            assert asyncio.get_running_loop().time() < deadline, "no 202 within the deadline"
            await asyncio.sleep(0.05)  # a client's pause before it retries

    async def submit_all(self, sessions: list[str]) -> list[tuple[str, str]]:
        gate = asyncio.Semaphore(32)

        async def one(session: str) -> tuple[str, str]:
            async with gate:
                return session, await self.submit(session)

        return list(await asyncio.gather(*(one(s) for s in sessions)))

    async def statuses_of(self, turns: list[tuple[str, str]]) -> list[str]:
        async with self.direct.pipeline(transaction=False) as pipe:
            for session, tid in turns:
                pipe.hget(self.keys.turn(self.user, session, tid), "status")
            return [str(s) for s in await pipe.execute()]

    async def wait_ended(self, turns: list[tuple[str, str]], within: float) -> None:
        async def ended() -> bool:
            return all(s in TERMINAL_STATUSES for s in await self.statuses_of(turns))

        await wait_until(ended, within, interval=0.05)

    async def start_held(self, n: int) -> list[tuple[str, str]]:
        """``n`` turns submitted and started, each waiting for the model's gate."""
        self.model.gate.clear()
        turns = await self.submit_all(await self.sessions(n))

        async def running() -> bool:
            return bool(self.worker.metrics.running._value.get() >= n)

        await wait_until(running, 30)
        return turns

    def follow(self, turns: list[tuple[str, str]]) -> list[asyncio.Task[list[SseEvent]]]:
        """An SSE follower of each turn, through the gateway (and its hub)."""
        return [asyncio.create_task(self._follow(session, tid)) for session, tid in turns]

    async def _follow(self, session: str, tid: str) -> list[SseEvent]:
        """The turn's events as a client sees them: reconnecting with Last-Event-ID
        whenever the stream ends before the terminal event (``stream.dropped``, a cut,
        a 503), until the terminal event."""
        seen: list[SseEvent] = []
        while True:
            headers = {"Last-Event-ID": seen[-1].id or ""} if seen else {}
            url = f"/v1/sessions/{session}/turns/{tid}/events"
            try:
                async with self.http.stream("GET", url, headers=headers) as resp:
                    self.statuses.append((resp.status_code, resp.headers.get("retry-after")))
                    if resp.status_code == 200:
                        async for message in sse_events(resp.aiter_lines()):
                            if message.id is None:
                                continue  # control events: stream.dropped, resync
                            seen.append(message)
                            if message.event in TERMINAL_TYPES:
                                return seen
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)  # a client's pause before it reconnects

    async def check(self, turns: list[tuple[str, str]]) -> None:
        """Each turn: one terminal event, completed, on its first attempt, and no event
        written twice. No answer was a 500, and every 503 said when to retry."""
        async with self.direct.pipeline(transaction=False) as pipe:
            for session, tid in turns:
                pipe.xrange(self.keys.turn_events(self.user, session, tid))
            streams = await pipe.execute()
        for (_session, tid), entries in zip(turns, streams, strict=True):
            data = [fields["data"] for _id, fields in entries]
            events = [decode_event(d) for d in data]
            terminal = [e for e in events if is_terminal(e)]
            assert len(terminal) == 1, (tid, data)
            assert type(terminal[0]).__name__ == "TurnCompleted", (tid, data)
            started = [e for e in events if isinstance(e, TurnStarted)]
            assert [s.attempt for s in started] == [1], (tid, data)
            assert len(set(data)) == len(data), ("an event written twice", tid, data)
        assert not [s for s in self.statuses if s[0] >= 500 and s[0] != 503], self.statuses
        assert not [s for s in self.statuses if s[0] not in (0, 200, 202, 503)], self.statuses
        assert all(retry for status, retry in self.statuses if status == 503), self.statuses


@contextlib.asynccontextmanager
async def stack_on(redis_url: str, **overrides: int) -> AsyncIterator[Stack]:
    prefix = "t" + uuid.uuid4().hex[:12]
    model = GatedModel()
    async with fault_proxy(redis_url) as proxy:
        settings = Settings(
            redis_url=proxy.url,
            prefix=prefix,
            jwt_secret="test-secret-" + prefix,
            # Gateway, worker, proxy and test share this event loop: only Redis's own
            # slowness should hold back the worker here.
            worker_max_loop_lag_ms=2000,
        )
        settings = dataclasses.replace(settings, **overrides)
        direct = aioredis.Redis.from_pool(
            aioredis.BlockingConnectionPool.from_url(
                redis_url, max_connections=32, decode_responses=True
            )
        )
        try:
            async with (
                live_gateway(settings) as gw,
                signed_in(gw, settings) as http,
                running_worker(settings, model, concurrency=300) as worker,
            ):
                yield Stack(settings, Keys(prefix), proxy, direct, http, worker, model)
        finally:
            await direct.aclose()


async def _followed(stack: Stack, followers: list[asyncio.Task[list[SseEvent]]]) -> None:
    """Every follower saw its turn's events once each, in order, up to one terminal
    event: what the turn's stream holds."""
    done, _ = await asyncio.wait(followers, timeout=RECOVERY_S)
    assert len(done) == len(followers), "a follower did not see its turn end"
    for task in followers:
        seen = task.result()
        ids = [m.id for m in seen]
        assert len(set(ids)) == len(ids), ids
        assert sum(m.event in TERMINAL_TYPES for m in seen) == 1


async def _streamed(stack: Stack, n: int) -> bool:
    """The model has streamed about two chunks (of ten) of each of ``n`` turns."""
    return stack.model.chunks >= 2 * n


async def _loading(port: int) -> bool:
    """Redis answers PING with ``-LOADING`` (read raw: a client library would retry
    it by itself)."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    try:
        writer.write(b"PING\r\n")
        return (await asyncio.wait_for(reader.readline(), 1.0)).startswith(b"-LOADING")
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()


@pytest.fixture
async def slow_loading_redis(tmp_path: Path) -> AsyncIterator[SlowLoadingRedis]:
    server = SlowLoadingRedis(tmp_path / "redis")
    await asyncio.to_thread(server.start)
    try:
        yield server
    finally:
        await asyncio.to_thread(server.stop)


async def _reset_with_replies_in_flight(stack: Stack) -> None:
    """Every connection reset while 200 turns stream; their replies (event writes,
    commits, a read of the work stream that delivered new turns) were lost first."""
    turns_store = TurnStore(stack.direct, stack.keys, stack.settings)
    turns = await stack.start_held(TURNS)
    followers = stack.follow(turns[:FOLLOWED])
    late_sessions = await stack.sessions(20)
    stack.model.gate.set()
    await wait_until(lambda: _streamed(stack, TURNS))
    reset = asyncio.create_task(stack.proxy.reset(replies_lost=True, hold_s=0.3))
    # Submitted straight to Redis while replies are lost: the worker's blocked read
    # delivers them, and never hears of it.
    late = [
        (s, (await turns_store.submit_queued(stack.user, s, "late"))[0].turnId)
        for s in late_sessions
    ]
    await reset
    await stack.wait_ended(turns + late, RECOVERY_S)
    await _followed(stack, followers)
    await stack.check(turns + late)


def test_a_reset_with_replies_in_flight_under_200_turns_on_uvloop(
    redis_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the services run (uvloop, where a write to a transport a reset closed raises
    RuntimeError): every turn ends within 5 s of the reset, and no attempt is silent:
    every turn whose event write the reset made fail logs a retry (or a give-up) that
    names it."""
    caplog.set_level(logging.INFO, logger="turnbus.worker")
    # The turns' event streams whose write failed with a lost connection, seen where
    # the worker writes them (every streaming turn writes every 50 ms).
    hit: set[str] = set()
    append = EventWriter.append

    async def noting_failures(
        writer: EventWriter, key: str, data: Sequence[bytes | str], *, tag: str, first: int
    ) -> None:
        try:
            await append(writer, key, data, tag=tag, first=first)
        except REDIS_UNAVAILABLE:
            hit.add(key)
            raise

    monkeypatch.setattr(EventWriter, "append", noting_failures)

    async def scenario() -> None:
        async with stack_on(redis_url) as stack:
            await _reset_with_replies_in_flight(stack)

    uvloop.run(scenario())
    about_attempts = [
        r.getMessage()
        for r in caplog.records
        if r.name in ("turnbus.worker.retry", "turnbus.worker.entries")
        and r.levelno >= logging.WARNING
        and "cancel subscription" not in r.getMessage()
    ]
    names = [re.match(r"turn (t_\w+)", m) for m in about_attempts]
    assert all(names), about_attempts
    named = {name.group(1) for name in names if name}
    hit_turns = {key.removesuffix(":events").rsplit(":turn:", 1)[1] for key in hit}
    assert hit_turns, "the reset made no event write fail"
    assert hit_turns <= named, ("silent attempts", sorted(hit_turns - named), about_attempts)


async def test_resets_with_replies_in_flight_latency_and_a_pause_under_200_turns(
    slow_loading_redis: SlowLoadingRedis,
) -> None:
    async with stack_on(slow_loading_redis.url) as stack:
        loop = asyncio.get_running_loop()
        turns_store = TurnStore(stack.direct, stack.keys, stack.settings)

        # 1. Every connection reset while 200 turns stream, replies in flight.
        await _reset_with_replies_in_flight(stack)

        # 2. +300 ms each way until 200 turns have ended under it (the worker backs off:
        # Redis answers slowly), then none: new turns run at once again.
        turns = await stack.start_held(TURNS)
        stack.proxy.delay(0.3)
        stack.model.gate.set()

        async def saturated() -> bool:
            return bool(stack.worker.metrics.saturated._value.get() == 1)

        await wait_until(saturated, 20)
        await stack.wait_ended(turns, 60)
        stack.proxy.delay(0)
        fast_again = loop.time()
        probe_sessions = await stack.sessions(TURNS)
        probes = [
            (s, (await turns_store.submit_queued(stack.user, s, "probe"))[0].turnId)
            for s in probe_sessions
        ]
        await stack.wait_ended(probes, RECOVERY_S - (loop.time() - fast_again))
        await stack.check(turns + probes)

        async def calm() -> bool:
            return not await saturated()

        # The gauge follows the worker's last check: on a loaded machine a late event
        # loop may hold it a moment longer, so it is waited on, not read once.
        await wait_until(calm, RECOVERY_S)

        # 3. Redis paused (SIGSTOP) while 200 turns stream, then continued: the worker
        # says it is saturated while nothing comes back (its blocking read is given up),
        # /readyz says 503, and the turns go on with the same attempt once Redis does.
        turns = await stack.start_held(TURNS)
        stack.model.gate.set()
        await wait_until(lambda: _streamed(stack, TURNS))
        child = slow_loading_redis.child
        assert child is not None
        child.signal(signal.SIGSTOP)
        try:
            await wait_until(saturated, 10)
            ready = await stack.http.get("/readyz")  # PING unanswered for its 1 s
        finally:
            child.signal(signal.SIGCONT)
        assert ready.status_code == 503 and ready.headers.get("retry-after"), ready.text
        await stack.wait_ended(turns, RECOVERY_S)
        await stack.check(turns)


async def test_a_restart_that_loads_its_data_under_200_turns(
    slow_loading_redis: SlowLoadingRedis,
) -> None:
    server = slow_loading_redis
    if not server.answers_while_loading:
        pytest.skip("Redis 6.2 serves no client while it loads its data at startup")
    # Turns ride out the load on their first attempt however long this machine takes
    # to load (1 ms a key: a few seconds for what 200 turns hold).
    async with stack_on(server.url, redis_retry_ms=60_000, lease_ms=60_000) as stack:
        loop = asyncio.get_running_loop()
        turns = await stack.start_held(TURNS)
        followers = stack.follow(turns[:FOLLOWED])
        # What the turns hold goes into the AOF's RDB part, which Redis loads answering
        # clients every KiB (the commands after it, every 1,024 commands).
        await stack.direct.bgrewriteaof()

        async def rewritten() -> bool:
            info = await stack.direct.info("persistence")
            return not info["aof_rewrite_in_progress"] and not info["aof_rewrite_scheduled"]

        await wait_until(rewritten, 20)
        stack.model.gate.set()
        await wait_until(lambda: _streamed(stack, TURNS))
        await asyncio.to_thread(server.stop)  # SIGTERM: Redis writes its AOF and exits
        started = asyncio.create_task(asyncio.to_thread(server.start))
        loading = 0
        readyz: list[tuple[int, str | None]] = []
        while not started.done():
            # Straight to Redis: is it loading? Then so must the gateway say (counted
            # when Redis still loads after the gateway answered).
            if await _loading(server.port):
                loading += 1
                ready = await stack.http.get("/readyz")
                during = await stack.http.post(
                    f"/v1/sessions/{turns[0][0]}/turns",
                    json={"message": "while loading", "multitask": "enqueue"},
                )
                stack.statuses.append((during.status_code, during.headers.get("retry-after")))
                if await _loading(server.port):
                    readyz.append((ready.status_code, ready.headers.get("retry-after")))
            await asyncio.sleep(0.05)
        await started
        answering = loop.time()
        await stack.direct.connection_pool.disconnect()  # the test's own, cut by the restart
        assert loading, "Redis was never seen loading"
        assert readyz and all(status == 503 and retry for status, retry in readyz), readyz
        await stack.wait_ended(turns, RECOVERY_S - (loop.time() - answering))
        await _followed(stack, followers)
        await stack.check(turns)
        assert (await stack.http.get("/readyz")).status_code == 200
