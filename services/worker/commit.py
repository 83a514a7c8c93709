"""The turn's three scripts, and the only code that knows their KEYS and ARGV.

- :meth:`TurnCommit.start` (``lua/turn_start.lua``): the session lease (only for the
  session's oldest active turn), the record marked running with the attempt counted,
  ``turn.started``, the envelope overlay, and the envelope and history the first round
  needs;
- :meth:`TurnCommit.commit_round` (``lua/turn_round.lua``): a round's history rows, its
  events, the notes write its tools held, and the envelope when another writer changed it;
- :meth:`TurnCommit.finish` (``lua/turn_finish.lua``): the last rows and events, the final
  status and the one terminal event, the envelope's status and usage, the lease released.

Each is one call on the session's slot. The replies are typed (:class:`StartReply`,
:class:`RoundReply`); what a caller does with them is the attempt's business.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import redis.asyncio as aioredis

from turnbus.shared.events import (
    Event,
    TurnRequiresAction,
    WorkingNotes,
    encode_event,
    notes_digest,
    terminal_event,
)
from turnbus.shared.keys import Keys
from turnbus.shared.records import (
    PendingCall,
    TurnRecord,
    TurnUsage,
    TurnWebhook,
    now_ms,
    record_from_hash,
)
from turnbus.shared.replicas import ReplicaWait
from turnbus.shared.scripts import LuaScript, pairs
from turnbus.shared.scripts import text as _s
from turnbus.shared.settings import Settings
from turnbus.worker.history import CommitPlan, HistoryFenced, stored_row
from turnbus.worker.lease import SessionLease
from turnbus.worker.models.base import UsageCounts
from turnbus.worker.outcome import TurnOutcome
from turnbus.worker.retry import RedisRetry

__all__ = [
    "ACTION_CLOSED",
    "RoundCalls",
    "RoundReply",
    "StartReply",
    "StoredResult",
    "TurnCommit",
    "round_calls_from",
    "usage_json",
]

# The result a pending client call gets when its turn ends without an answer (a cancel,
# the action timeout): the history never holds a tool_use without its result.
ACTION_CLOSED = "ERROR no result: the turn ended before its caller answered this call"

_usage_encoder = msgspec.json.Encoder()
_row_encoder = msgspec.json.Encoder()


class StoredResult(msgspec.Struct, array_like=True):
    """A side-effecting call's result as the calls hash keeps it."""

    output: str
    is_error: bool = False
    truncated: bool = False


_result_decoder = msgspec.json.Decoder(StoredResult)
_row_decoder = msgspec.json.Decoder(dict[str, Any])


@dataclasses.dataclass(frozen=True, slots=True)
class RoundCalls:
    """The round a previous attempt of the turn was running tools in (the calls hash):
    its assistant message, the side-effecting calls whose intent was stored and the
    results stored so far."""

    round: int
    assistant: dict[str, Any]
    intents: frozenset[str]
    results: dict[str, StoredResult]
    # The turn paused in this round (requires_action): the answers are among ``results``.
    paused: bool = False
    # The calls an approver let run (approve, or edit: the input to run it with, else
    # None); a rejected call's answer is its error result, among ``results``.
    approved: dict[str, dict[str, Any] | None] = dataclasses.field(default_factory=dict)


def round_calls_from(flat: Mapping[str, Any]) -> RoundCalls | None:
    """The round the calls hash holds (its fields flat, values raw), if it holds one."""
    if "round" not in flat or "assistant" not in flat:
        return None
    try:
        rnd = int(_s(flat["round"]))
        assistant = _row_decoder.decode(flat["assistant"])
        results = {
            name.removeprefix("result:"): _result_decoder.decode(value)
            for name, value in flat.items()
            if name.startswith("result:")
        }
    except (ValueError, msgspec.DecodeError):
        return None
    intents = frozenset(n.removeprefix("intent:") for n in flat if n.startswith("intent:"))
    approved: dict[str, dict[str, Any] | None] = {}
    for name, value in flat.items():
        if name.startswith("approval:"):
            try:
                decision = _row_decoder.decode(value)
            except msgspec.DecodeError:
                continue
            edited = decision.get("input")
            approved[name.removeprefix("approval:")] = edited if isinstance(edited, dict) else None
    return RoundCalls(rnd, assistant, intents, results, paused="paused" in flat, approved=approved)


def _flat_bytes(flat: Any) -> dict[str, bytes]:
    """A flat ``[field, value, ...]`` reply as a dict of text fields to raw values."""
    items = list(flat or [])
    return {_s(items[i]): items[i + 1] for i in range(0, len(items), 2)}


def usage_json(usage: UsageCounts) -> str:
    """The turn's usage as the record and the envelope store it."""
    return _usage_encoder.encode(
        TurnUsage(
            inputTokens=usage.input_tokens,
            outputTokens=usage.output_tokens,
            cacheReadTokens=usage.cache_read_tokens,
            cacheWriteTokens=usage.cache_write_tokens,
        )
    ).decode()


@dataclasses.dataclass(frozen=True, slots=True)
class StartReply:
    """What the start script answered. ``status``:

    - ``started``: ``record``, the ``envelope`` (flat) and the history ``rows`` (all of
      them, or with ``after`` those after the rows the worker held); ``announced`` when
      round 1's ``round.started`` went with ``turn.started`` (the turn's first attempt);
    - ``exhausted``: the attempt cap is reached (``record``, every history row; the
      lease is taken for the end); ``action_timeout``: the same for a turn whose caller
      did not answer its pause in time;
    - ``waiting``: the turn waits for its caller (nothing started);
    - ``not_head`` (``head``: the session's oldest active turn, or ""), ``busy``,
      ``terminal``, ``not_found``: nothing started.
    """

    status: str
    head: str = ""
    record: TurnRecord | None = None
    envelope: dict[str, str] = dataclasses.field(default_factory=dict)
    rows: list[Any] = dataclasses.field(default_factory=list)
    announced: bool = False
    after: bool = False
    # A later attempt's (a resume's): the turn's calls hash, flat, and its last events
    # (newest first), read by the script; ``None`` for a first attempt.
    calls: dict[str, bytes] | None = None
    last_events: list[tuple[str, dict[str, bytes]]] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class RoundReply:
    """What a round's commit answered. ``status``: ``ok`` (``envelope``: the envelope as
    stored, flat; empty when the session is gone), ``same`` (nobody else wrote the
    envelope; ``notes_at``: the clock of the round's notes write, if there was one),
    ``fenced`` (the lease is not held: nothing written) or ``too_large`` (the held notes
    write no longer fits the meta budget: nothing written)."""

    status: str
    envelope: dict[str, str] = dataclasses.field(default_factory=dict)
    notes_at: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class _TurnKeys:
    """The keys of one turn's scripts (all in the session's slot)."""

    turn: str
    active: str
    lease: str
    events: str
    env: str
    log: str
    messages: str
    outbox: str
    webhooks: str

    @classmethod
    def of(cls, k: Keys, user: str, session: str, turn_id: str) -> _TurnKeys:
        return cls(
            turn=k.turn(user, session, turn_id),
            active=k.active(user, session),
            lease=k.lease(user, session),
            events=k.turn_events(user, session, turn_id),
            env=k.env(user, session),
            log=k.log(user, session),
            messages=k.messages(user, session),
            outbox=k.outbox(user, session),
            webhooks=k.webhook_outbox(user, session),
        )


class TurnCommit:
    """The turn scripts of one worker, bound to its client and settings."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        settings: Settings,
        *,
        worker_name: str,
        budget: int,
        retry: RedisRetry,
        replicas: ReplicaWait,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.worker_name = worker_name
        self.budget = budget
        self.retry = retry
        # A terminal event is acknowledged (the entry acked) once these replicas have it.
        self.replicas = replicas
        self._start = LuaScript(redis, "turn_start.lua")
        self._round = LuaScript(redis, "turn_round.lua")
        self._finish = LuaScript(redis, "turn_finish.lua")
        self._calls = LuaScript(redis, "turn_calls.lua")
        self._pause = LuaScript(redis, "turn_pause.lua")

    async def start(
        self,
        user: str,
        session: str,
        turn_id: str,
        lease: SessionLease,
        held: tuple[str, bytes] = ("0", b""),
        redis_lost_ms: int | None = None,
    ) -> StartReply:
        """Start an attempt (one try). ``held``: how many history rows the worker holds
        from the session's last turn here, and the last of them
        (:meth:`HistoryCache.check_args`). ``redis_lost_ms``: how long this worker lost
        Redis just before, which a new attempt's ``turn.started`` names as its cause."""
        t = _TurnKeys.of(self.keys, user, session, turn_id)
        calls = self.keys.turn_calls(user, session, turn_id)
        keys = [t.turn, t.active, lease.key, t.events, t.env, t.log, t.messages, t.outbox, calls]
        args: list[str | bytes | int] = [
            turn_id,
            lease.token,
            str(lease.lease_ms),
            self.worker_name,
            str(now_ms()),
            str(self.settings.max_deliveries),
            str(self.settings.events_maxlen),
            str(self.settings.log_maxlen),
            str(self.budget),
            session,
            Keys.outbox_member(user, session, turn_id),
            *held,
            "" if redis_lost_ms is None else str(redis_lost_ms),
        ]
        reply = await self._start(keys=keys, args=args)
        status = _s(reply[0])
        if status in ("exhausted", "action_timeout"):
            return StartReply(status, record=record_from_hash(pairs(reply[1])), rows=list(reply[2]))
        if status != "started":
            return StartReply(status, head=_s(reply[1]) if len(reply) > 1 else "")
        return StartReply(
            status,
            record=record_from_hash(pairs(reply[1])),
            envelope=pairs(reply[2]),
            rows=list(reply[3]),
            announced=len(reply) > 5 and _s(reply[5]) == "1",
            after=len(reply) > 6 and _s(reply[6]) == "after",
            calls=_flat_bytes(reply[7]) if len(reply) > 8 else None,
            last_events=[(_s(e[0]), _flat_bytes(e[1])) for e in reply[8] or []]
            if len(reply) > 8
            else None,
        )

    async def commit_round(
        self,
        user: str,
        session: str,
        turn_id: str,
        *,
        lease: SessionLease,
        plan: CommitPlan,
        envelope_at: int | None,
        events: Sequence[Event],
        notes: str | None,
    ) -> RoundReply:
        """Commit a round: the rows of ``plan``, ``events``, the held ``notes`` write (""
        = a clear, ``None``: none), answered against the envelope's clock the worker holds
        (``envelope_at``). Retried while Redis is unreachable: a try whose reply was lost
        but that was stored is not sent again (its rows end the history)."""
        t = _TurnKeys.of(self.keys, user, session, turn_id)
        keys = [t.messages, lease.key, t.turn, t.events, t.env, t.log]
        args = [
            lease.token,
            plan.mode,
            str(plan.drop),
            str(envelope_at or ""),
            str(self.settings.events_maxlen),
            *self._events_args(session, events, notes),
            *plan.rows,
        ]
        tries = 0

        async def commit() -> Any:
            nonlocal tries
            tries += 1
            if tries > 1 and await self._landed(keys[0], plan.rows):
                # The previous try ran but its reply was lost: never append twice.
                envelope = await self.redis.hgetall(keys[4])
                return [b"ok", [x for kv in envelope.items() for x in kv]]
            return await self._round(keys=keys, args=args)

        reply = await self.retry.run("commit", commit, lease)
        status = _s(reply[0])
        if status == "ok":
            return RoundReply(status, envelope=pairs(reply[1]))
        if status == "same" and reply[1]:
            return RoundReply(status, notes_at=int(reply[1]))
        return RoundReply(status)

    def _events_args(
        self, session: str, events: Sequence[Event], notes: str | None
    ) -> list[str | bytes]:
        """The round's notes write and its events: the ``working_notes`` events go to the
        session log too, those of the held write completed with its clock (their
        ``updatedAt`` 0)."""
        encoded = [encode_event(e) for e in events]
        logged = [str(i) for i, e in enumerate(events, 1) if isinstance(e, WorkingNotes)]
        write: list[str | bytes] = ["", "", "", ""]
        if notes is not None:
            digest = notes_digest(notes)
            write = ["1", notes, str(digest.bytes), digest.sha256]
        return [
            str(len(encoded)),
            *write,
            session,
            str(self.settings.log_maxlen),
            str(self.budget),
            str(now_ms()),
            str(len(logged)),
            *logged,
            *encoded,
        ]

    async def _landed(self, messages_key: str, rows: list[bytes]) -> bool:
        """Whether a commit whose reply was lost was stored: its rows end the history."""
        if not rows:
            return False
        tail = await self.redis.lrange(messages_key, -len(rows), -1)
        return [_s(t) for t in tail] == [r.decode() for r in rows]

    async def record_intent(
        self,
        user: str,
        session: str,
        turn_id: str,
        *,
        lease: SessionLease,
        rnd: int,
        assistant: dict[str, Any],
        side_effecting: Sequence[str],
        events: Sequence[Event],
    ) -> None:
        """Before a round's calls start: the round's assistant message (as stored), the
        intent of its side-effecting calls and ``events``, in one call fenced by the
        lease (raises :class:`HistoryFenced` when it is not held). Retried while Redis
        is unreachable; a retry of a try that was stored writes nothing twice."""
        args: list[str | bytes] = [str(rnd), _row_encoder.encode(assistant), *side_effecting]
        await self._run_calls(user, session, turn_id, lease, "intent", events, args)

    async def record_approved(
        self,
        user: str,
        session: str,
        turn_id: str,
        *,
        lease: SessionLease,
        side_effecting: Sequence[str],
        events: Sequence[Event],
    ) -> None:
        """Before calls an approver let run start, in the round the pause kept: the
        intent of the side-effecting ones and ``events`` (fenced and retried like
        :meth:`record_intent`; the round's assistant message and results stay)."""
        await self._run_calls(user, session, turn_id, lease, "approved", events, [*side_effecting])

    async def record_result(
        self,
        user: str,
        session: str,
        turn_id: str,
        *,
        lease: SessionLease,
        call_id: str,
        output: str,
        is_error: bool,
        truncated: bool,
        event: Event,
    ) -> None:
        """A side-effecting call's result and its ``tool.result`` event, as soon as it is
        known (fenced by the lease, retried like :meth:`record_intent`)."""
        stored = _row_encoder.encode(StoredResult(output, is_error, truncated))
        await self._run_calls(user, session, turn_id, lease, "result", [event], [call_id, stored])

    async def _run_calls(
        self,
        user: str,
        session: str,
        turn_id: str,
        lease: SessionLease,
        mode: str,
        events: Sequence[Event],
        tail: list[str | bytes],
    ) -> None:
        k = self.keys
        keys = [
            lease.key,
            k.turn_calls(user, session, turn_id),
            k.turn_events(user, session, turn_id),
        ]
        args: list[str | bytes] = [
            lease.token,
            mode,
            str(self.settings.events_ttl_s * 1000),
            str(self.settings.events_maxlen),
            str(len(events)),
            *(encode_event(e) for e in events),
            *tail,
        ]
        if mode in ("intent", "approved"):
            # No call starts before its intent is on the replicas asked for
            # (TURNBUS_WAIT_REPLICAS): a failover cannot then lose it.
            def write() -> Any:
                return self.replicas.write(
                    self.redis, lambda link: self._calls(keys=keys, args=args, on=link)
                )
        else:

            def write() -> Any:
                return self._calls(keys=keys, args=args)

        reply = await self.retry.run(mode, write, lease)
        if _s(reply) == "fenced":
            raise HistoryFenced(keys[1])

    async def round_calls(self, user: str, session: str, turn_id: str) -> RoundCalls | None:
        """The round a previous attempt was running tools in, if it left one (one read,
        made only by a resumed attempt)."""
        raw = await self.retry.run(
            "calls", lambda: self.redis.hgetall(self.keys.turn_calls(user, session, turn_id))
        )
        return round_calls_from({_s(k): v for k, v in (raw or {}).items()})

    async def closing_rows(self, user: str, session: str, turn_id: str) -> list[dict[str, Any]]:
        """The rows that close a paused round whose caller never answered (its assistant
        message, and its results with the pending calls' :data:`ACTION_CLOSED`), as the
        pause stored them; none when there are none."""
        raw = await self.redis.hmget(
            self.keys.turn_calls(user, session, turn_id), "close:1", "close:2"
        )
        try:
            return [_row_decoder.decode(r) for r in raw if r]
        except msgspec.DecodeError:
            return []

    async def pause(
        self,
        user: str,
        session: str,
        turn_id: str,
        *,
        lease: SessionLease,
        rnd: int,
        assistant: dict[str, Any],
        settled: dict[str, StoredResult],
        pending: Sequence[PendingCall],
        closing: Sequence[dict[str, Any]],
        timeout_ms: int,
    ) -> str:
        """Pause the turn for its caller (one script, ``lua/turn_pause.lua``, fenced by the
        lease): the round's assistant message and its ``settled`` results kept for the
        resume, the ``closing`` rows for an end without an answer, the ``pending`` calls on
        the record and in ``turn.requires_action``, the status ``requires_action``, the
        envelope's ``turnStatus``, the lease released and the turn's outbox mark set to its
        deadline (the sweeper enqueues it then, and a worker ends it ``action_timeout``).
        Returns ``paused``, ``cancel`` (a cancel was asked for: nothing written) or
        ``fenced``. Retried while Redis is unreachable; a retry of a try that was stored
        answers ``paused``."""
        at = now_ms()
        deadline = at + timeout_ms
        event = TurnRequiresAction(
            turnId=turn_id, round=rnd, calls=list(pending), expiresAt=deadline, at=at
        )
        k = self.keys
        keys = [
            lease.key,
            k.turn(user, session, turn_id),
            k.turn_events(user, session, turn_id),
            k.turn_calls(user, session, turn_id),
            k.env(user, session),
            k.log(user, session),
            k.outbox(user, session),
        ]
        args: list[str | bytes] = [
            lease.token,
            str(at),
            str(rnd),
            _row_encoder.encode(assistant),
            _row_encoder.encode(list(pending)),
            encode_event(event),
            str(deadline),
            str(deadline - self.settings.outbox_grace_ms),
            Keys.outbox_member(user, session, turn_id),
            str(self.settings.events_maxlen),
            str(self.settings.log_maxlen),
            str(self.budget),
            session,
            # The hash outlives the wait: a late end still finds the closing rows.
            str(timeout_ms + self.settings.events_ttl_s * 1000),
            *(_row_encoder.encode(stored_row(row, keep_thinking=False)) for row in closing),
            *(b"" for _ in range(2 - len(closing))),
            *(x for call_id, r in settled.items() for x in (call_id, _row_encoder.encode(r))),
        ]
        # The entry is acked after the pause: like a terminal event, the pause must be
        # on the replicas asked for first, or a failover could lose a turn no entry holds.
        reply = await self.retry.run(
            "pause",
            lambda: self.replicas.write(
                self.redis, lambda link: self._pause(keys=keys, args=args, on=link)
            ),
            lease,
            turn=turn_id,
        )
        return _s(reply)

    async def finish(
        self,
        user: str,
        session: str,
        turn_id: str,
        *,
        lease_token: str,
        outcome: TurnOutcome,
        usage: UsageCounts,
        events: Sequence[Event] = (),
        plan: CommitPlan | None = None,
        at: int | None = None,
        webhook: TurnWebhook | None = None,
    ) -> str | None:
        """End the turn (one try): ``events``, the rows of ``plan``, the final status and
        the terminal event of ``outcome``, the envelope's status and usage (only while the
        lease holds ``lease_token``: a turn ended without it must not overwrite the status
        of the turn that may be running; "" = no lease), the lease released. Returns the
        terminal event's id, ``None`` when the turn had already ended (nothing written).
        ``at``: the end's time (now by default). ``webhook``: the record's, queued by the
        same call (none: nothing more is written)."""
        at = now_ms() if at is None else at
        event = terminal_event(
            turn_id,
            outcome.status,
            at=at,
            reason=outcome.reason,
            message=outcome.error,
            stop_reason=outcome.stop_reason,
            by=outcome.by,
        )
        usage_text = usage_json(usage)
        fields: dict[str, str] = {"status": outcome.status, "usage": usage_text}
        for key, value in (
            ("reason", outcome.reason),
            ("error", outcome.error),
            ("stopReason", outcome.stop_reason),
            ("by", outcome.by),
        ):
            if value is not None:
                fields[key] = value
        patch = {"turnRunId": turn_id, "turnStatus": outcome.status, "usage": usage_text}
        mode, drop, rows = ("", "0", []) if plan is None else (plan.mode, str(plan.drop), plan.rows)
        encoded = [encode_event(e) for e in events]
        t = _TurnKeys.of(self.keys, user, session, turn_id)
        keys = [t.turn, t.active, t.events, t.log, t.lease, t.env, t.messages, t.webhooks]
        args: list[str | bytes | int] = [
            turn_id,
            lease_token,
            str(at),
            str(len(fields)),
            encode_event(event),
            str(self.settings.events_maxlen),
            str(self.settings.log_maxlen),
            str(self.settings.events_ttl_s),
            str(self.settings.session_ttl_ms or ""),
            Keys.outbox_member(user, session, turn_id),
            session,
            str(self.budget),
            str(len(patch)),
            mode,
            drop,
            str(len(encoded)),
            "" if webhook is None else _usage_encoder.encode(TurnWebhook(url=webhook.url)),
            *encoded,
            *(x for kv in fields.items() for x in kv),
            *(x for kv in patch.items() for x in kv),
            *rows,
        ]
        reply = await self.replicas.write(
            self.redis, lambda link: self._finish(keys=keys, args=args, on=link)
        )
        return _s(reply[1]) if _s(reply[0]) == "ended" else None
