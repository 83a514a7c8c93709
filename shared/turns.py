"""Turn records and their state changes.

A turn record is a hash (``keys.turn``); its events are a stream (``keys.turn_events``)
whose entry ids are the SSE ids. Here: the submit, the work entry, the outbox sweep and
the cancel request (the gateway's side). A worker starts and ends a turn with its own
scripts (:mod:`turnbus.worker.commit`). Every state change is one Lua call that refuses
to leave a terminal state, so each accepted turn gets exactly one terminal event.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from typing import Any, Literal

import jsonschema  # type: ignore[import-untyped]
import msgspec
import redis.asyncio as aioredis

from turnbus.shared import caps
from turnbus.shared.contracts import WorkEntry
from turnbus.shared.envelope import SessionNotFound
from turnbus.shared.events import (
    ToolResult,
    TurnCancelled,
    TurnQueued,
    encode_event,
)
from turnbus.shared.keys import SLOTS, InvalidId, Keys
from turnbus.shared.meta import title_from_message
from turnbus.shared.quotas import ACTIVE, Admission, QuotaExceeded, QuotaLimits, QuotaStore
from turnbus.shared.records import (
    ClientTool,
    PendingCall,
    TurnRecord,
    TurnWebhook,
    new_turn_id,
    now_ms,
    record_fields,
    record_from_hash,
)
from turnbus.shared.replicas import NotReplicated, ReplicaWait
from turnbus.shared.scripts import LuaScript, pairs
from turnbus.shared.scripts import text as _s
from turnbus.shared.settings import Settings
from turnbus.shared.tool_specs import truncate_tool_result

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
    "outboxes_due",
]

log = logging.getLogger(__name__)
_json_encoder = msgspec.json.Encoder()


class SessionBusy(Exception):
    """The session already has an active turn (HTTP 409 ``session_busy``)."""

    def __init__(self, active_turn_id: str) -> None:
        super().__init__(f"session has an active turn {active_turn_id}")
        self.active_turn_id = active_turn_id


class SessionQueueFull(Exception):
    """The session already holds its maximum of unfinished turns (HTTP 429 ``session_queue_full``)."""

    def __init__(self, active: int, limit: int) -> None:
        super().__init__(f"the session has {active} unfinished turns; the limit is {limit}")
        self.active = active
        self.limit = limit


class IdempotencyMismatch(Exception):
    """The ``Idempotency-Key`` was used before with a different body (HTTP 409)."""

    def __init__(self, turn_id: str) -> None:
        super().__init__(f"idempotency key already used for turn {turn_id} with another body")
        self.turn_id = turn_id


class TurnNotFound(LookupError):
    """No such turn in that session (HTTP 404)."""


class TurnNotWaiting(Exception):
    """An answer to a turn that is not waiting for one (HTTP 409 ``turn_not_waiting``)."""

    def __init__(self, status: str) -> None:
        super().__init__(f"the turn is {status}, not waiting for an answer")
        self.status = status


class ActionsInvalid(ValueError):
    """An answer that does not match the pending calls (HTTP 422): ``code`` is
    ``unknown_call``, ``missing_call``, ``duplicate_call``, ``wrong_answer`` (a result
    for a call awaiting approval, or a decision for a client call) or ``unprocessable``
    (an approval's input or reason), ``call_id`` the call."""

    def __init__(self, code: str, call_id: str, field: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.call_id = call_id
        self.field = field


class ActionAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """The caller's result of one pending call (``toolResults[]``)."""

    callId: str
    output: str
    isError: bool = False


class ApprovalAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """A person's decision on one call that waits for approval (``approvals[]``):
    ``approve`` runs it with the model's input, ``edit`` with ``input``, ``reject`` gives
    the model an error result with ``reason``."""

    callId: str
    decision: Literal["approve", "reject", "edit"]
    input: dict[str, Any] | None = None
    reason: str | None = None


# The result a rejected call gives the model.
REJECTED = "ERROR the call was rejected by the person approving it: {reason}"
_NO_REASON = "no reason given"
# A reason is for the model to read; a long one is an error, not a cut.
APPROVAL_REASON_MAX_BYTES = 4096


class _StoredResult(msgspec.Struct, array_like=True):
    # The calls hash's form of a result (the worker's ``commit.StoredResult``).
    output: str
    is_error: bool = False
    truncated: bool = False


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


# A replayed submit looks for its turn's work entry this far either side of the turn's
# acceptance (the gateway's clock against Redis's), a page at a time.
_ENTRY_WINDOW_MS = 10_000
_ENTRY_PAGE = 500
# Marks looked at per outbox per sweeper call, and outboxes counted per round trip.
_SWEEP_MARKS = 100
_SWEEP_BATCH = 2048


async def outboxes_due(
    redis: aioredis.Redis, outboxes: list[str], cutoff: int, *, cluster: bool
) -> list[str]:
    """The outboxes (sorted sets, one per slot) holding a mark scored ``cutoff`` or less."""
    due: list[str] = []
    for i in range(0, len(outboxes), _SWEEP_BATCH):
        batch = outboxes[i : i + _SWEEP_BATCH]
        # One Redis holds every slot's outbox, so one EXISTS tells whether a batch has any
        # mark at all (mostly none): a command, not 2,048. A cluster refuses a command
        # over several slots; there each outbox is counted on its own.
        if not cluster and not await redis.exists(*batch):
            continue
        async with redis.pipeline(transaction=False) as pipe:
            for key in batch:
                pipe.zcount(key, "-inf", cutoff)
            counts = await pipe.execute()
        due.extend(key for key, count in zip(batch, counts, strict=True) if int(count))
    return due


class TurnStore:
    """Turn records, their event streams and the work queue.

    A submit is two calls: the session's script (the record, its indexes, its
    ``turn.queued`` event and a mark in its slot's outbox) and the work entry on the
    shard's stream, which a Redis Cluster keeps on another slot. The mark stays until a
    worker starts the turn; :meth:`sweep_outboxes` enqueues again any turn accepted more
    than ``outbox_grace_ms`` ago that no worker has seen (its second call failed).
    A submit refused ``503 not_replicated`` has written its turn on the primary: its
    work entry is written all the same. A replay of a turn no worker has started
    writes the entry again if the work stream lacks it.
    """

    def __init__(self, redis: aioredis.Redis, keys: Keys, settings: Settings) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self._submit = LuaScript(redis, "turn_submit.lua")
        self._transition = LuaScript(redis, "turn_transition.lua")
        self._outbox_due = LuaScript(redis, "outbox_due.lua")
        self._actions = LuaScript(redis, "turn_actions.lua")
        self.quotas = QuotaStore(redis, keys)
        # A submit's 202 and a terminal event are acknowledged once these replicas have them.
        self.replicas = ReplicaWait.from_settings(settings)

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
        k = self.keys
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
        submit_keys = [
            k.env(user, session),
            k.turn(user, session, turn_id),
            k.turns(user, session),
            k.active(user, session),
            k.idempotency(user, session, idem or "none"),
            k.idempotency_index(user, session),
            k.turn_events(user, session, turn_id),
            k.outbox(user, session),
            k.log(user, session),
        ]
        submit_args: list[str | bytes | int] = [
            turn_id,
            str(self.settings.events_ttl_s),
            multitask,
            idem,
            body_digest(message, multitask, extra, webhook_url),
            str(self.settings.idempotency_ttl_s),
            queued_data,
            str(self.settings.events_maxlen),
            user,
            session,
            str(created),
            k.session_tag(user, session),
            str(self.settings.session_queue_max),
            title_from_message(message),
            str(self.settings.log_maxlen),
            str(caps.HARNESS_SESSION_MAX_META_BYTES),
            str(self.settings.session_ttl_ms or ""),
            *(x for kv in record_fields(record).items() for x in kv),
        ]
        try:
            reply = await self.replicas.write(
                self.redis, lambda link: self._submit(keys=submit_keys, args=submit_args, on=link)
            )
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
                    await self._ensure_work_entry(prior)
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
            await self._ensure_work_entry(prior)
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
        announced to the workers, then the work entry."""
        interrupted = _s(reply[2]) if len(reply) > 2 else None
        if interrupted:
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
        await self._write_work_entry(user, session, turn_id, trace, interrupts=interrupted)

    async def _has_work_entry(self, record: TurnRecord) -> bool:
        """Whether the work stream holds an entry of this queued turn: one written by its
        submit lies within a few seconds of its acceptance (entry ids are Redis's clock
        in ms; an unstarted turn's entry is never trimmed). Read only for a replay; a
        clock far off makes it answer ``False``, and a second entry is harmless (the
        turn's start runs it once)."""
        stream = self.keys.work(
            Keys.shard_for(record.userId, record.sessionId, self.settings.shards)
        )
        after = f"{max(record.createdAt - _ENTRY_WINDOW_MS, 0)}-0"
        until = str(record.createdAt + _ENTRY_WINDOW_MS)
        while True:
            reply = await self.redis.xrange(stream, after, until, count=_ENTRY_PAGE)
            page: list[Any] = list(reply or [])
            for _entry_id, fields in page:
                try:
                    if WorkEntry.decode(fields or {}).turn == record.turnId:
                        return True
                except InvalidId:
                    continue  # not a turn's entry: no worker runs it either
            if len(page) < _ENTRY_PAGE:
                return False
            after = "(" + _s(page[-1][0])

    async def _ensure_work_entry(self, record: TurnRecord) -> None:
        """A turn no worker has started gets a work entry unless it has one."""
        if record.status == "queued" and not await self._has_work_entry(record):
            await self._write_work_entry(record.userId, record.sessionId, record.turnId)

    async def _write_work_entry(
        self,
        user: str,
        session: str,
        turn_id: str,
        trace: Mapping[str, str] | None = None,
        *,
        interrupts: str | None = None,
    ) -> None:
        """The submit's second call. A failure leaves the turn to the outbox sweeper:
        its mark stays until a worker starts it."""
        try:
            await self.enqueue(user, session, turn_id, trace, interrupts=interrupts)
        except Exception:
            log.warning("turn %s accepted, its work entry not written", turn_id, exc_info=True)

    async def enqueue(
        self,
        user: str,
        session: str,
        turn_id: str,
        trace: Mapping[str, str] | None = None,
        *,
        interrupts: str | None = None,
    ) -> str:
        """Append the turn's work entry to its shard's stream (the submit's second call).
        ``trace``: a trace context (``traceparent``, ``tracestate``), stored as fields of
        the entry beside the ids, so the worker's turn span joins the submit's trace.
        ``interrupts``: the turn this one interrupted (its worker then looks for the
        session's turn to end without backing off)."""
        shard = Keys.shard_for(user, session, self.settings.shards)
        trace = trace or {}
        entry = WorkEntry(
            user=user,
            session=session,
            turn=turn_id,
            interrupts=interrupts or None,
            traceparent=trace.get("traceparent"),
            tracestate=trace.get("tracestate"),
        )
        entry_id = await self.redis.xadd(self.keys.work(shard), entry.fields())  # type: ignore[arg-type]
        return _s(entry_id)

    async def sweep_outboxes(self, slots: range = range(SLOTS)) -> list[str]:
        """Enqueue again every turn of these slots' outboxes accepted more than
        ``outbox_grace_ms`` ago that no worker has started; returns their ids.

        A turn enqueued twice still runs once: its start takes the session lease and
        refuses a turn that is not queued or resumable."""
        now = now_ms()
        cutoff = now - self.settings.outbox_grace_ms
        outboxes = [self.keys.slot_outbox(slot) for slot in slots]
        due = await outboxes_due(self.redis, outboxes, cutoff, cluster=self.settings.redis_cluster)
        enqueued: list[str] = []
        for key in due:
            args: list[str | bytes | int] = [
                self.keys.prefix,
                str(now),
                str(self.settings.outbox_grace_ms),
                _SWEEP_MARKS,
            ]
            for member in await self._outbox_due(keys=[key], args=args):
                user, session, turn_id = _s(member).split(":")
                await self.enqueue(user, session, turn_id)
                log.warning("turn %s had no work entry after the grace period; enqueued", turn_id)
                enqueued.append(turn_id)
        return enqueued

    async def submit_actions(
        self,
        user: str,
        session: str,
        turn_id: str,
        answers: list[ActionAnswer],
        *,
        approvals: list[ApprovalAnswer] | None = None,
        schemas: Mapping[str, dict[str, Any]] | None = None,
        idempotency_key: str | None = None,
    ) -> tuple[TurnRecord, bool]:
        """Answer every pending call of a paused turn at once: the results stored with
        the move back to ``queued`` (one script, ``lua/turn_actions.lua``), then the work
        entry written (the outbox mark guards that gap, as for a submit). ``approvals``
        decide the calls that wait for approval: a rejected one's error result is stored
        like a caller's result, an approved or edited one is marked for the worker to
        run; an edit's input is checked against ``schemas`` (the published tools' input
        schemas, by name) when its tool's is there. Returns ``(record, replayed)``.

        Raises :class:`TurnNotFound`, :class:`TurnNotWaiting`, :class:`ActionsInvalid`,
        :class:`IdempotencyMismatch` (nothing written)."""
        k = self.keys
        turn_key, calls_key = k.turn(user, session, turn_id), k.turn_calls(user, session, turn_id)
        approvals = approvals or []
        body = _json_encoder.encode(answers)
        if approvals:
            body += b"\n" + _json_encoder.encode(approvals)
        digest = hashlib.sha256(body).hexdigest()
        idem = ""
        if idempotency_key:
            idem = hashlib.sha256(f"actions\n{turn_id}\n{idempotency_key}".encode()).hexdigest()
            prior = await self.redis.get(k.idempotency(user, session, idem))
            if prior is not None:
                if _s(prior) != f"{turn_id} {digest}":
                    raise IdempotencyMismatch(turn_id)
                replayed = await self.get(user, session, turn_id)
                if replayed is None:
                    raise TurnNotFound(turn_id)
                return replayed, True
        keys = [
            turn_key,
            calls_key,
            k.turn_events(user, session, turn_id),
            k.outbox(user, session),
            k.idempotency(user, session, idem or "none"),
        ]
        head: list[str | bytes | int] = [
            turn_id,
            str(now_ms()),
            "",  # the pending calls as checked: "" while unchecked
            idem,
            digest,
            str(self.settings.idempotency_ttl_s),
            Keys.outbox_member(user, session, turn_id),
            str(self.settings.events_maxlen),
        ]
        checked: tuple[str, str] | None = None
        if not approvals:
            # Results only, the common answer: the script checks them against the
            # pending calls itself, which saves the read before it.
            results = [(a.callId, a.output, a.isError) for a in answers]
            events, written = _answered(turn_id, results, pieces=True)
            args = [*head, str(len(answers)), *events, *written]
            reply = await self.replicas.write(
                self.redis, lambda link: self._actions(keys=keys, args=args, on=link)
            )
            if _s(reply[0]) == "check":
                checked = (_s(reply[1]), _s(reply[2]))
        else:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hgetall(turn_key)
                pipe.hget(calls_key, "round")
                flat, rnd = await pipe.execute()
            if not flat:
                raise TurnNotFound(turn_id)
            raw = {_s(a): _s(b) for a, b in flat.items()}
            if raw.get("status") != "requires_action":
                raise TurnNotWaiting(raw.get("status", ""))
            checked = (raw.get("pendingCalls", ""), _s(rnd))
        if checked is not None:
            pending_json, rnd_text = checked
            calls = _pending_decoder.decode(pending_json) if pending_json else None
            if not calls:
                raise TurnNotWaiting("requires_action")
            pending = {call.callId: call for call in calls}
            _check_answers(answers, approvals, pending, schemas or {})
            results = [(a.callId, a.output, a.isError) for a in answers]
            approved: list[str | bytes] = []
            for approval in approvals:
                if approval.decision == "reject":
                    reason = REJECTED.format(reason=approval.reason or _NO_REASON)
                    results.append((approval.callId, reason, True))
                else:
                    mark = {"decision": approval.decision}
                    if approval.decision == "edit":
                        mark["input"] = approval.input  # type: ignore[assignment]
                    approved += ["approval:" + approval.callId, _json_encoder.encode(mark)]
            names = {call_id: call.name for call_id, call in pending.items()}
            events, written = _answered(turn_id, results, rnd=int(rnd_text or 0), names=names)
            head[2] = pending_json
            args = [*head, str(len(events)), *events, *approved, *written]
            reply = await self.replicas.write(
                self.redis, lambda link: self._actions(keys=keys, args=args, on=link)
            )
        status = _s(reply[0])
        if status == "not_found":
            raise TurnNotFound(turn_id)
        if status == "mismatch":
            raise IdempotencyMismatch(turn_id)
        if status == "not_waiting":
            raise TurnNotWaiting(_s(reply[1]))
        if status == "changed":
            raise TurnNotWaiting("waiting on other calls")
        if status == "ok":
            # The record as the answer left it, answered by the script (a worker may
            # start the turn as soon as its work entry is written).
            answered = record_from_hash(pairs(reply[1]))
            await self._write_work_entry(user, session, turn_id)
            return answered, False
        replayed = await self.get(user, session, turn_id)
        if replayed is None:
            raise TurnNotFound(turn_id)
        return replayed, True

    async def get(self, user: str, session: str, turn_id: str) -> TurnRecord | None:
        flat = await self.redis.hgetall(self.keys.turn(user, session, turn_id))
        if not flat:
            return None
        return record_from_hash({_s(a): _s(b) for a, b in flat.items()})

    async def active_turns(self, user: str, session: str) -> list[str]:
        items = await self.redis.lrange(self.keys.active(user, session), 0, -1)
        return [_s(i) for i in items]

    async def request_cancel(self, user: str, session: str, turn_id: str) -> TurnRecord:
        """Cancel a turn: a queued one ends at once, and so does one paused for its caller
        (its pending calls closed in the history); a running one is told through pub/sub
        (its worker ends it). One call of ``lua/turn_transition.lua``, which refuses to
        leave a terminal state."""
        k = self.keys
        now = now_ms()
        event = TurnCancelled(turnId=turn_id, at=now)
        cancel_msg = json.dumps({"user": user, "session": session, "turn": turn_id})
        transition_keys = [
            k.turn(user, session, turn_id),
            k.active(user, session),
            k.turn_events(user, session, turn_id),
            k.log(user, session),
            k.turn_calls(user, session, turn_id),
            k.messages(user, session),
            k.env(user, session),
            k.webhook_outbox(user, session),
        ]
        transition_args: list[str | bytes | int] = [
            "cancel",
            str(now),
            turn_id,
            json.dumps({"reason": "cancelled"}),
            encode_event(event),
            str(self.settings.events_maxlen),
            str(self.settings.log_maxlen),
            str(self.settings.events_ttl_s),
            k.cancel_channel(),
            cancel_msg,
            str(caps.HARNESS_SESSION_MAX_META_BYTES),
            session,
            Keys.outbox_member(user, session, turn_id),
        ]
        reply = await self.replicas.write(
            self.redis,
            lambda link: self._transition(keys=transition_keys, args=transition_args, on=link),
        )
        if _s(reply[0]) == "not_found":
            raise TurnNotFound(turn_id)
        record = await self.get(user, session, turn_id)
        if record is None:
            raise TurnNotFound(turn_id)
        if _s(reply[0]) == "ended" and record.quotas and ACTIVE in record.quotas.split():
            # A queued turn ended here, not by a worker: its count goes back here.
            await self.quotas.turn_ended(user, session)
        return record


# A stand-in for the tool's name in an event the actions script completes: msgspec
# writes the NULs as escapes, so its JSON is found nowhere else in the event.
_NAME_MARK = "\x00name\x00"
_NAME_MARK_JSON = b',"name":' + _json_encoder.encode(_NAME_MARK)
_ROUND_MARK_JSON = b'"round":0,'
_pending_decoder = msgspec.json.Decoder(list[PendingCall])


def _answered(
    turn_id: str,
    results: list[tuple[str, str, bool]],
    *,
    rnd: int = 0,
    names: Mapping[str, str] | None = None,
    pieces: bool = False,
) -> tuple[list[bytes], list[str | bytes]]:
    """The ``tool.result`` events and the calls hash's ``result:<call id>`` pairs of an
    answer's results, each output cut to the tool result cap. ``pieces``: the round and
    the names are the script's to fill in; each event is three pieces (the JSON before
    the round, between the round and the name, after the name)."""
    events: list[bytes] = []
    written: list[str | bytes] = []
    for call_id, given, is_error in results:
        output, truncated = truncate_tool_result(given)
        written += ["result:" + call_id, _json_encoder.encode(
            _StoredResult(output, is_error, truncated))]  # fmt: skip
        name = _NAME_MARK if pieces or names is None else names[call_id]
        event = encode_event(
            ToolResult(
                turnId=turn_id,
                round=rnd,
                callId=call_id,
                name=name,
                output=output,
                isError=is_error,
                truncated=truncated,
            )
        )
        if not pieces:
            events.append(event)
            continue
        # The round comes before the call id, the name and the output: the first of
        # each mark is the field's own.
        before, after = event.split(_ROUND_MARK_JSON, 1)
        middle, rest = after.split(_NAME_MARK_JSON, 1)
        events += [before + b'"round":', b"," + middle + b',"name":', rest]
    return events, written


def _check_answers(
    answers: list[ActionAnswer],
    approvals: list[ApprovalAnswer],
    pending: dict[str, PendingCall],
    schemas: Mapping[str, dict[str, Any]],
) -> None:
    """Every pending call answered once, by the answer its kind takes (a result for a
    client call, a decision for one awaiting approval), and nothing else: else the
    first fault."""
    seen: set[str] = set()
    given = [("toolResults", i, a.callId, "client") for i, a in enumerate(answers)]
    given += [("approvals", i, a.callId, "approval") for i, a in enumerate(approvals)]
    for where, i, call_id, kind in given:
        field = f"{where}[{i}].callId"
        if call_id in seen:
            raise ActionsInvalid(
                "duplicate_call", call_id, field, f"call {call_id!r} is answered twice"
            )
        call = pending.get(call_id)
        if call is None:
            raise ActionsInvalid(
                "unknown_call", call_id, field, f"the turn waits on no call {call_id!r}"
            )
        if (call.kind == "approval") != (kind == "approval"):
            wanted = "approvals" if call.kind == "approval" else "toolResults"
            raise ActionsInvalid(
                "wrong_answer", call_id, field, f"call {call_id!r} is answered in {wanted}"
            )
        seen.add(call_id)
    for i, approval in enumerate(approvals):
        _check_approval(i, approval, pending[approval.callId], schemas)
    for call_id in pending:
        if call_id not in seen:
            raise ActionsInvalid(
                "missing_call",
                call_id,
                "approvals" if pending[call_id].kind == "approval" else "toolResults",
                f"call {call_id!r} is not answered; every pending call must be answered at once",
            )


def _check_approval(
    i: int, approval: ApprovalAnswer, call: PendingCall, schemas: Mapping[str, dict[str, Any]]
) -> None:
    at = f"approvals[{i}]"
    if (approval.decision == "edit") != (approval.input is not None):
        message = (
            "an edit carries the input to run the call with"
            if approval.decision == "edit"
            else f"only an edit carries an input, not {approval.decision!r}"
        )
        raise ActionsInvalid("unprocessable", approval.callId, f"{at}.input", message)
    if approval.reason is not None and len(approval.reason.encode()) > APPROVAL_REASON_MAX_BYTES:
        raise ActionsInvalid(
            "unprocessable",
            approval.callId,
            f"{at}.reason",
            f"the reason is over {APPROVAL_REASON_MAX_BYTES} bytes",
        )
    schema = schemas.get(call.name)
    if approval.input is None or not schema:
        return  # a schema the gateway does not know: the worker checks the edit
    validator = jsonschema.validators.validator_for(schema)(schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(approval.input))
    if error is not None:
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        raise ActionsInvalid(
            "unprocessable",
            approval.callId,
            f"{at}.input",
            f"the edited input does not fit {call.name}'s schema: {error.message} (at `${path}`)",
        )
