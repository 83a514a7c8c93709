"""Turn records and their state changes, the gateway's side.

A turn record is a hash (``keys.turn``); its events are a stream (``keys.turn_events``)
whose entry ids are the SSE ids. Here: the submit and the cancel request
(:class:`TurnStore`), which stands on the work queue and its outbox sweep
(:mod:`turnbus.shared.turn_queue`) and on the answers to paused turns
(:mod:`turnbus.shared.turn_answers`). A worker starts and ends a turn with its own
scripts (:mod:`turnbus.worker.commit`). Every state change is one Lua call that refuses
to leave a terminal state, so each accepted turn gets exactly one terminal event.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from typing import Any

import msgspec
import redis.asyncio as aioredis

from turnbus.shared.contracts import CancelReason
from turnbus.shared.envelope import SessionNotFound
from turnbus.shared.events import TurnCancelled, TurnQueued, encode_event
from turnbus.shared.keys import Keys
from turnbus.shared.meta import title_from_message
from turnbus.shared.quotas import ACTIVE, Admission, QuotaExceeded, QuotaLimits, QuotaStore
from turnbus.shared.records import (
    ClientTool,
    TurnRecord,
    TurnWebhook,
    new_turn_id,
    now_ms,
    record_from_hash,
)
from turnbus.shared.replicas import NotReplicated, ReplicaWait
from turnbus.shared.scripts import LuaScript
from turnbus.shared.scripts import text as _s
from turnbus.shared.settings import Settings
from turnbus.shared.turn_answers import REJECTED, ActionAnswer, ApprovalAnswer, TurnAnswers
from turnbus.shared.turn_errors import (
    ActionsInvalid,
    IdempotencyMismatch,
    SessionBusy,
    SessionQueueFull,
    TurnNotFound,
    TurnNotWaiting,
)
from turnbus.shared.turn_queue import TurnQueue, outboxes_due
from turnbus.shared.turn_scripts import TurnRef, TurnScripts

__all__ = [
    "REJECTED",
    "ActionAnswer",
    "ActionsInvalid",
    "ApprovalAnswer",
    "IdempotencyMismatch",
    "SessionBusy",
    "SessionQueueFull",
    "TurnNotFound",
    "TurnNotWaiting",
    "TurnStore",
    "body_digest",
    "outboxes_due",
]

log = logging.getLogger(__name__)
_json_encoder = msgspec.json.Encoder()


def body_digest(
    message: str, multitask: str, extra: bytes = b"", webhook_url: str | None = None
) -> str:
    """The digest an ``Idempotency-Key`` remembers of a submit's body; ``extra``: the
    client tools and the action timeout, when the submit has them; ``webhook_url``: the
    submit's webhook. A body without them digests as it did before they existed."""
    hooked = "" if webhook_url is None else f"\nwebhook {webhook_url}"
    digest = hashlib.sha256(f"{multitask}\n{message}{hooked}".encode())
    if extra:
        digest.update(b"\n" + extra)
    return digest.hexdigest()


class TurnStore:
    """A turn's submit, its record's read and its cancel; the work entries and the outbox
    sweep are :attr:`queue`'s (:class:`TurnQueue`), an answer to a paused turn is
    :attr:`answers`' (:class:`TurnAnswers`).

    A submit is two calls: the session's script (the record, its indexes, its
    ``turn.queued`` event and a mark in its slot's outbox) and the work entry on the
    shard's stream, which a Redis Cluster keeps on another slot (the sweep writes it
    again for a turn whose second call failed).
    A submit refused ``503 not_replicated`` has written its turn on the primary: its
    work entry is written all the same. A replay of a turn no worker has started
    writes the entry again if the work stream lacks it.
    """

    def __init__(self, redis: aioredis.Redis, keys: Keys, settings: Settings) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.scripts = TurnScripts(keys, settings)
        self._submit = LuaScript(redis, "turn_submit.lua")
        self._transition = LuaScript(redis, "turn_transition.lua")
        self.quotas = QuotaStore(redis, keys)
        # A submit's 202 and a terminal event are acknowledged once these replicas have them.
        self.replicas = ReplicaWait.from_settings(settings)
        self.queue = TurnQueue(redis, keys, settings)
        self.answers = TurnAnswers(
            redis,
            keys,
            settings,
            replicas=self.replicas,
            read=self.get,
            enqueue=self.queue.write_work_entry,
        )
        # The queue's and the answers' calls, on the store where callers find them.
        self.enqueue = self.queue.enqueue
        self.sweep_outboxes = self.queue.sweep_outboxes
        self.submit_actions = self.answers.submit

    async def submit_queued(
        self,
        user: str,
        session: str,
        message: str,
        *,
        multitask: str = "reject",
        idempotency_key: str | None = None,
        allowed_tools: str | None = None,
        trace: Mapping[str, str] | None = None,
        client_tools: list[ClientTool] | None = None,
        action_timeout_s: int | None = None,
        limits: QuotaLimits | None = None,
        webhook_url: str | None = None,
    ) -> tuple[TurnRecord, bool, tuple[str, str] | None]:
        """Accept a turn; returns ``(record, replayed, queued)``, ``queued`` being the new
        turn's ``turn.queued`` entry as ``(entry id, data)`` (``None`` for a replay), so
        a follower can start from it.

        Raises :class:`SessionNotFound`, :class:`SessionBusy`, :class:`SessionQueueFull`,
        :class:`QuotaExceeded` (nothing written), :class:`IdempotencyMismatch`. ``allowed_tools``: the
        submitting token's ``tools`` claim, kept on the record for the worker. ``trace``:
        the submit span's trace context, carried to the worker in the work entry.
        ``client_tools`` (checked by the caller) and ``action_timeout_s`` (capped by the
        setting) are kept on the record for a pause.
        ``limits``: the user's quotas; :class:`QuotaExceeded` over one (nothing written).
        None on (the default) costs no Redis call.
        ``webhook_url``: where the turn's end is POSTed (checked by the caller against
        the allow-list), kept on the record; the terminal event's script queues it.
        """
        turn_id = new_turn_id()
        created = now_ms()
        shard = Keys.shard_for(user, session, self.settings.shards)
        record = TurnRecord(
            turnId=turn_id,
            sessionId=session,
            userId=user,
            status="queued",
            message=message,
            createdAt=created,
            multitask=multitask,
            shard=shard,
            allowedTools=allowed_tools,
            clientTools=client_tools or None,
            webhook=None if webhook_url is None else TurnWebhook(url=webhook_url),
        )
        extra = b""
        if client_tools or action_timeout_s is not None:
            extra = _json_encoder.encode([client_tools or [], action_timeout_s])
        if client_tools:
            timeout_s = min(action_timeout_s or self.settings.action_timeout_s,
                            self.settings.action_timeout_s)  # fmt: skip
            record.actionTimeoutMs = timeout_s * 1000
        idem = hashlib.sha256(idempotency_key.encode()).hexdigest() if idempotency_key else ""
        admission: Admission | None = None
        if limits is not None and limits.any:
            record.quotas = limits.record_value()
            admission = await self._admit(user, session, multitask, idem, limits)
        queued = TurnQueued(turnId=turn_id, sessionId=session, at=created)
        queued_data = encode_event(queued)
        call = self.scripts.turn_submit(
            record,
            idem=idem,
            digest=body_digest(message, multitask, extra, webhook_url),
            queued=queued_data,
            title=title_from_message(message),
        )
        try:
            reply = await self.replicas.write(self.redis, lambda link: self._submit(*call, on=link))
        except NotReplicated as exc:
            # Stored on the primary, not confirmed (503): its work entry is written all
            # the same, so the turn runs at once if the primary keeps it, as a retry
            # under the same Idempotency-Key will be told.
            stored = _s(exc.result[0]) if exc.result else ""
            if stored == "ok":
                await self._accepted(user, session, turn_id, exc.result, trace)
            elif stored == "replay":
                prior = await self.get(user, session, _s(exc.result[1]))
                if prior is not None:
                    await self.queue.ensure_work_entry(prior)
            raise
        status = _s(reply[0])
        if status == "ok":
            await self._accepted(user, session, turn_id, reply, trace)
            return record, False, (_s(reply[1]), queued_data.decode())
        if admission is not None:
            # Nothing was written: what the quotas counted goes back.
            await self.quotas.release(admission)
        if status == "not_found":
            raise SessionNotFound(session)
        if status == "busy":
            raise SessionBusy(_s(reply[1]))
        if status == "queue_full":
            raise SessionQueueFull(int(reply[1]), self.settings.session_queue_max)
        if status == "mismatch":
            raise IdempotencyMismatch(_s(reply[1]))
        if status == "replay":
            prior = await self.get(user, session, _s(reply[1]))
            if prior is None:
                raise TurnNotFound(_s(reply[1]))
            # The first answer may have been a 503, or its work entry lost with a failed
            # master of the work stream: a replay is answered as accepted, so the turn
            # must have an entry.
            await self.queue.ensure_work_entry(prior)
            return prior, True, None
        raise RuntimeError(f"unexpected submit reply {status!r}")

    async def _admit(
        self, user: str, session: str, multitask: str, idem: str, limits: QuotaLimits
    ) -> Admission | None:
        """The quotas' check and count before the session's script (another slot on a
        cluster). A refused retry of an accepted submit (its ``Idempotency-Key`` already
        names a turn) is let through uncounted, so it replays rather than answer 429."""
        try:
            return await self.quotas.admit(user, session, multitask, limits)
        except QuotaExceeded:
            if idem and await self.redis.exists(self.keys.idempotency(user, session, idem)):
                return None
            raise

    async def _accepted(
        self,
        user: str,
        session: str,
        turn_id: str,
        reply: list[Any],
        trace: Mapping[str, str] | None,
    ) -> None:
        """After the submit's script: the cancel of the turn it interrupted (if any)
        announced to the workers (a turn paused for its caller is ended here, as a
        cancel ends it), then the work entry."""
        interrupted = _s(reply[2]) if len(reply) > 2 else None
        if interrupted and len(reply) > 3 and _s(reply[3]) == "requires_action":
            try:
                await self.request_cancel(user, session, interrupted, by=turn_id)
            except Exception:
                # The record holds the request: an answer resumes it, and its worker
                # then ends it as interrupted.
                log.warning(
                    "turn %s: paused %s not ended by the interrupt", turn_id, interrupted,
                    exc_info=True,
                )  # fmt: skip
        elif interrupted:
            message = json.dumps(
                {"user": user, "session": session, "turn": interrupted, "by": turn_id}
            )
            try:
                await self.redis.publish(self.keys.cancel_channel(), message)
            except Exception:
                # The record holds the request: a worker (re)subscribing reads it.
                log.warning(
                    "turn %s: interrupt of %s not announced", turn_id, interrupted, exc_info=True
                )
        await self.queue.write_work_entry(user, session, turn_id, trace, interrupts=interrupted)

    async def get(self, user: str, session: str, turn_id: str) -> TurnRecord | None:
        flat = await self.redis.hgetall(self.keys.turn(user, session, turn_id))
        if not flat:
            return None
        return record_from_hash({_s(a): _s(b) for a, b in flat.items()})

    async def active_turns(self, user: str, session: str) -> list[str]:
        items = await self.redis.lrange(self.keys.active(user, session), 0, -1)
        return [_s(i) for i in items]

    async def request_cancel(
        self, user: str, session: str, turn_id: str, *, by: str | None = None
    ) -> TurnRecord:
        """Cancel a turn: a queued one ends at once, and so does one paused for its caller
        (its pending calls closed in the history); a running one is told through pub/sub
        (its worker ends it). One call of ``lua/turn_transition.lua``, which refuses to
        leave a terminal state. ``by``: the turn whose interrupt this is (the end says
        ``interrupted``)."""
        now = now_ms()
        reason: CancelReason = "cancelled" if by is None else "interrupted"
        event = TurnCancelled(turnId=turn_id, at=now, reason=None if by is None else reason, by=by)
        call = self.scripts.turn_transition_cancel(
            TurnRef(user, session, turn_id),
            now=now,
            event=encode_event(event),
            announce=json.dumps({"user": user, "session": session, "turn": turn_id}),
            reason=reason,
        )
        reply = await self.replicas.write(self.redis, lambda link: self._transition(*call, on=link))
        if _s(reply[0]) == "not_found":
            raise TurnNotFound(turn_id)
        record = await self.get(user, session, turn_id)
        if record is None:
            raise TurnNotFound(turn_id)
        if _s(reply[0]) == "ended" and record.quotas and ACTIVE in record.quotas.split():
            # A queued turn ended here, not by a worker: its count goes back here.
            await self.quotas.turn_ended(user, session)
        return record
