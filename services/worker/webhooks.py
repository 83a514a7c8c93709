"""The webhook sender: every worker runs one (:class:`WebhookSender`).

A turn's webhook is queued by the script that writes its terminal event: a mark in the
session slot's webhook outbox (``keys.webhook_outbox``), due at once. The worker that
ended the turn is told and sends it at once, and claims its slot again when a retry it
scheduled falls due; besides, every ``webhook_poll_ms`` one worker of all (a lock)
looks for the marks due in every slot: a cancelled queued or paused turn's, and deliveries whose
sender died. A claim pushes a mark a lease ahead, so two live senders never POST
the same delivery at once; a sender that dies mid-POST leaves it due again when the
lease ends. A webhook is therefore sent at least once, and may be sent twice, always
under one ``webhook-id`` (docs/operations.md, "Webhooks").

Each POST has a timeout; at most ``webhook_host_concurrency`` are in flight per
``host:port`` and as many wait for a place; a delivery beyond those, or one that waited
a whole timeout, is put back for later, so a slow receiver holds up only its own
deliveries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

import aiohttp
import msgspec
import redis.asyncio as aioredis
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

from turnbus.shared.backoff import Backoff
from turnbus.shared.keys import SLOTS, Keys, key_slot
from turnbus.shared.records import TurnRecord, WebhookAttempt, now_ms, record_from_hash
from turnbus.shared.scripts import LuaScript, pairs
from turnbus.shared.scripts import text as _s
from turnbus.shared.settings import Settings
from turnbus.shared.turns import outboxes_due
from turnbus.shared.version import VERSION
from turnbus.shared.webhooks import (
    WebhookRefused,
    check_webhook_url,
    guarded_address,
    host_key,
    parse_secret,
    payload,
    sign,
)

__all__ = ["ATTEMPTS_KEPT", "WebhookSender", "retry_delay_ms"]

log = logging.getLogger(__name__)

# Attempts a record keeps (the latest); the backoff reaches its cap well before.
ATTEMPTS_KEPT = 20
# Deliveries one process sends at once, all receivers together.
_IN_FLIGHT_MAX = 256
_ERROR_MAX_CHARS = 200
_attempt_encoder = msgspec.json.Encoder()


def retry_delay_ms(settings: Settings, attempts: int) -> int:
    """The wait after a webhook's ``attempts``-th failed POST: doubling from
    ``webhook_retry_ms`` up to ``webhook_retry_max_ms``, drawn between half and all of
    it (jitter, so the retries of one outage do not arrive together)."""
    cap = settings.webhook_retry_max_ms
    backoff = Backoff(min(settings.webhook_retry_ms, cap), cap, jitter=0.5)
    return int(backoff.delay(attempts))


class _GuardedResolver(AbstractResolver):
    """Name resolution that never answers a link-local or metadata address, unless the
    allow-list names that address itself: an allowed host name cannot be pointed at
    the metadata service. (An address written in the URL was checked at submit.)"""

    def __init__(self, allow: tuple[str, ...]) -> None:
        self._inner = ThreadedResolver()
        self._allow = frozenset(allow)

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        kept = [r for r in found if not guarded_address(r["host"]) or r["host"] in self._allow]
        if not kept:
            raise OSError(f"{host} resolves only to link-local or metadata addresses")
        return kept

    async def close(self) -> None:
        await self._inner.close()


class WebhookSender:
    """Claims the due webhooks of the slots it is told of (or finds), and POSTs them."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        settings: Settings,
        *,
        name: str,
        stop: asyncio.Event,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.name = name
        self._stop = stop
        self._key = parse_secret(settings.webhook_secret) if settings.webhook_secret else None
        self._claim = LuaScript(redis, "webhook_claim.lua")
        self._record = LuaScript(redis, "webhook_attempt.lua")
        self._timeout_s = settings.webhook_timeout_ms / 1000
        # A claim outlasts the wait for a place at the receiver and the POST itself.
        self._lease_ms = 3 * settings.webhook_timeout_ms
        self._hosts: dict[str, asyncio.Semaphore] = {}
        self._waiting: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots: set[int] = set()
        # Slots holding a delivery this sender put back, and when the earliest falls due
        # (monotonic s): claimed then, without waiting for a pass over every slot.
        self._retries: dict[int, float] = {}
        self._wake = asyncio.Event()
        self._http: aiohttp.ClientSession | None = None
        self.delivered = 0

    def queued(self, user: str, session: str) -> None:
        """A turn of this session queued its webhook: claim it now."""
        self._slots.add(key_slot(f"{user}:{session}"))
        self._wake.set()

    async def run(self) -> None:
        """Until stop: send what is due in the slots it is told of, and every poll
        period, when it holds the lock, in every slot."""
        if self._key is None:
            return  # no secret: this deployment sends no webhooks
        poll_s = self.settings.webhook_poll_ms / 1000
        connector = aiohttp.TCPConnector(resolver=_GuardedResolver(self.settings.webhook_allow))
        self._http = aiohttp.ClientSession(connector=connector)
        next_scan = 0.0
        try:
            while not self._stop.is_set():
                wake_at = min([next_scan, *self._retries.values()])
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(wake_at - time.monotonic(), 0))
                self._wake.clear()
                slots, self._slots = self._slots, set()
                now = time.monotonic()
                for slot in [slot for slot, at in self._retries.items() if at <= now]:
                    del self._retries[slot]
                    slots.add(slot)
                try:
                    if time.monotonic() >= next_scan:
                        next_scan = time.monotonic() + poll_s
                        slots |= await self._due_slots()
                    for slot in slots:
                        await self._claim_slot(slot)
                except Exception:  # a background loop must outlive any one failure
                    log.warning("webhook pass failed", exc_info=True)
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._http.close()

    async def _due_slots(self) -> set[int]:
        lock = self.keys.webhook_sender_lock()
        if not await self.redis.set(lock, self.name, nx=True, px=self.settings.webhook_poll_ms):
            return set()
        outboxes = [self.keys.slot_webhook_outbox(slot) for slot in range(SLOTS)]
        due = await outboxes_due(
            self.redis, outboxes, now_ms(), cluster=self.settings.redis_cluster
        )
        return {key_slot(key) for key in due}

    async def _claim_slot(self, slot: int) -> None:
        room = _IN_FLIGHT_MAX - len(self._tasks)
        if room <= 0:
            return  # still due: a later pass takes it
        outbox = self.keys.slot_webhook_outbox(slot)
        reply = await self._claim(
            keys=[outbox], args=[self.keys.prefix, str(now_ms()), str(self._lease_ms), room]
        )
        for i in range(0, len(reply), 2):
            member = _s(reply[i])
            record = record_from_hash(pairs(reply[i + 1]))
            task = asyncio.create_task(self._deliver(slot, member, record))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _deliver(self, slot: int, member: str, record: TurnRecord) -> None:
        hook = record.webhook
        assert hook is not None and hook.id is not None  # the claim takes pending ones only
        try:
            check_webhook_url(hook.url, self.settings.webhook_allow)
        except WebhookRefused as exc:
            # The allow-list changed since the submit: never sent.
            await self._outcome(slot, member, record, None, str(exc), 0, now_ms(), final=True)
            return
        host = host_key(hook.url)
        gate = self._hosts.setdefault(
            host, asyncio.Semaphore(self.settings.webhook_host_concurrency)
        )
        # A receiver whose places are taken and already waited for holds no more of the
        # process's in-flight room: its delivery goes back, due after one timeout.
        if gate.locked() and self._waiting.get(host, 0) >= self.settings.webhook_host_concurrency:
            await self._put_back(slot, member)
            return
        self._waiting[host] = self._waiting.get(host, 0) + 1
        try:
            await asyncio.wait_for(gate.acquire(), self._timeout_s)
        except TimeoutError:
            await self._put_back(slot, member)
            return
        finally:
            self._waiting[host] -= 1
        try:
            started, at = time.monotonic(), now_ms()
            status, error = await self._post(hook.url, hook.id, payload(record))
            took = int((time.monotonic() - started) * 1000)
        finally:
            gate.release()
        await self._outcome(slot, member, record, status, error, took, at)

    async def _put_back(self, slot: int, member: str) -> None:
        """A delivery not attempted: due again after one timeout (no attempt recorded)."""
        outbox = self.keys.slot_webhook_outbox(slot)
        await self.redis.zadd(
            outbox, {member: now_ms() + self.settings.webhook_timeout_ms}, xx=True
        )
        self._retry_at(slot, self.settings.webhook_timeout_ms)

    def _retry_at(self, slot: int, after_ms: int) -> None:
        at = time.monotonic() + after_ms / 1000
        self._retries[slot] = min(self._retries.get(slot, at), at)
        self._wake.set()

    async def _post(self, url: str, msg_id: str, body: bytes) -> tuple[int | None, str | None]:
        assert self._http is not None and self._key is not None
        timestamp = int(time.time())
        headers = {
            "content-type": "application/json",
            "user-agent": f"turnbus/{VERSION}",
            "webhook-id": msg_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(self._key, msg_id, timestamp, body),
        }
        try:
            async with self._http.post(
                url,
                data=body,
                headers=headers,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=self._timeout_s),
            ) as response:
                return response.status, None
        except TimeoutError:
            return None, f"no answer within {self.settings.webhook_timeout_ms} ms"
        except (aiohttp.ClientError, OSError) as exc:
            return None, (f"{type(exc).__name__}: {exc}")[:_ERROR_MAX_CHARS]

    async def _outcome(
        self,
        slot: int,
        member: str,
        record: TurnRecord,
        status: int | None,
        error: str | None,
        took: int,
        at: int,
        *,
        final: bool = False,
    ) -> None:
        """Record the attempt; the delivery ends (2xx, ``final``, or past the retry
        window) or is due again after the backoff."""
        assert record.webhook is not None
        attempt = WebhookAttempt(at=at, durationMs=took, status=status, error=error)
        next_at, wait_ms = "", 0
        if status is not None and 200 <= status < 300:
            state = "delivered"
            self.delivered += 1
        else:
            wait_ms = retry_delay_ms(self.settings, len(record.webhook.attempts) + 1)
            due = now_ms() + wait_ms
            ended = record.endedAt or at
            if final or due > ended + self.settings.webhook_retry_window_s * 1000:
                state = "failed"
                log.warning("the webhook of turn %s is given up: %s", record.turnId, error)
            else:
                state, next_at = "pending", str(due)
        outbox = self.keys.slot_webhook_outbox(slot)
        keys = [outbox, self.keys.turn(record.userId, record.sessionId, record.turnId)]
        args: list[str | bytes | int] = [
            member,
            _attempt_encoder.encode(attempt),
            state,
            next_at,
            ATTEMPTS_KEPT,
        ]
        try:
            await self._record(keys=keys, args=args)
            if next_at:
                self._retry_at(slot, wait_ms)
        except Exception:
            # The mark is still claimed: the delivery is due again when its lease ends.
            log.warning("webhook attempt of turn %s not recorded", record.turnId, exc_info=True)
