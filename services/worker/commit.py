"""The turn's three scripts (their KEYS and ARGV: :mod:`turnbus.shared.turn_scripts`).

- :meth:`TurnCommit.start` (``lua/turn_start.lua``): the session lease (only for the
  session's oldest active turn), the record marked running with the attempt counted,
  ``turn.started``, the envelope overlay, and the envelope and history the first round
  needs;
- :meth:`TurnCommit.commit_round` (``lua/turn_round.lua``): a round's history rows, its
  events, the notes write its tools held, and the envelope when another writer changed it;
- :meth:`TurnCommit.finish` (``lua/turn_finish.lua``): the last rows and events, the final
  status and the one terminal event, the envelope's status and usage, the lease released.

The scripts of a round's tool calls and of the pause are :class:`CallsCommit`'s
(:mod:`turnbus.worker.commit_calls`). Each is one call on the session's slot. The replies are typed (:class:`StartReply`,
:class:`RoundReply`); what a caller does with them is the attempt's business.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import msgspec
import redis.asyncio as aioredis

from turnbus.shared.events import (
    Event,
    WorkingNotes,
    encode_event,
    notes_digest,
    terminal_event,
)
from turnbus.shared.keys import Keys
from turnbus.shared.records import (
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
from turnbus.shared.turn_scripts import TurnRef
from turnbus.worker.commit_calls import (
    ACTION_CLOSED,
    CallsCommit,
    RoundCalls,
    StoredResult,
    round_calls_from,
)
from turnbus.worker.history import CommitPlan
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

_usage_encoder = msgspec.json.Encoder()
_row_encoder = msgspec.json.Encoder()


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
      a ``round.started`` went with ``turn.started``: round 1's on the turn's first
      attempt; on the first attempt after an answer that left no call to run, the
      one of the round after the paused one;
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
    # A later attempt's (a resume's): the turn's calls hash, flat, and its last usage
    # event among its last 100 events, as the script found it: ``[id, data]``, ``[]``
    # (the turn has no other events) or ``[id]`` (none among them: the oldest's id);
    # ``None`` for a first attempt.
    calls: dict[str, bytes] | None = None
    last_usage: list[Any] | None = None


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


class TurnCommit(CallsCommit):
    """The turn scripts of one worker, bound to its client and settings: an attempt's
    start, a round's commit and the turn's end here, a round's tool calls and the pause
    in :class:`CallsCommit`."""

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
        super().__init__(redis, keys, settings, budget=budget, retry=retry, replicas=replicas)
        self.worker_name = worker_name
        self._start = LuaScript(redis, "turn_start.lua")
        self._round = LuaScript(redis, "turn_round.lua")
        self._finish = LuaScript(redis, "turn_finish.lua")

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
        call = self._scripts.turn_start(
            TurnRef(user, session, turn_id),
            lease,
            lease_ms=lease.lease_ms,
            worker=self.worker_name,
            now=now_ms(),
            budget=self.budget,
            held=held,
            redis_lost_ms=redis_lost_ms,
        )
        reply = await self._start(*call)
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
            last_usage=list(reply[8] or []) if len(reply) > 8 else None,
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
        encoded = [encode_event(e) for e in events]
        logged = [i for i, e in enumerate(events, 1) if isinstance(e, WorkingNotes)]
        held = None
        if notes is not None:
            digest = notes_digest(notes)
            held = (notes, digest.bytes, digest.sha256)
        call = self._scripts.turn_round(
            TurnRef(user, session, turn_id),
            lease,
            mode=plan.mode,
            drop=plan.drop,
            envelope_at=envelope_at,
            events=encoded,
            logged=logged,
            notes=held,
            budget=self.budget,
            now=now_ms(),
            rows=plan.rows,
        )
        tries = 0

        async def commit() -> Any:
            nonlocal tries
            tries += 1
            if tries > 1 and await self._landed(call.keys[0], plan.rows):
                # The previous try ran but its reply was lost: never append twice.
                envelope = await self.redis.hgetall(self.keys.env(user, session))
                return [b"ok", [x for kv in envelope.items() for x in kv]]
            return await self._round(*call)

        reply = await self.retry.run("commit", commit, lease)
        status = _s(reply[0])
        if status == "ok":
            return RoundReply(status, envelope=pairs(reply[1]))
        if status == "same" and reply[1]:
            return RoundReply(status, notes_at=int(reply[1]))
        return RoundReply(status)

    async def _landed(self, messages_key: str, rows: list[bytes]) -> bool:
        """Whether a commit whose reply was lost was stored: its rows end the history."""
        if not rows:
            return False
        tail = await self.redis.lrange(messages_key, -len(rows), -1)
        return [_s(t) for t in tail] == [r.decode() for r in rows]

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
        mode, drop, rows = ("", 0, []) if plan is None else (plan.mode, plan.drop, plan.rows)
        call = self._scripts.turn_finish(
            TurnRef(user, session, turn_id),
            token=lease_token,
            at=at,
            terminal=encode_event(event),
            budget=self.budget,
            mode=mode,
            drop=drop,
            events=[encode_event(e) for e in events],
            webhook="" if webhook is None else _usage_encoder.encode(TurnWebhook(url=webhook.url)),
            fields=fields,
            patch=patch,
            rows=rows,
        )
        reply = await self.replicas.write(self.redis, lambda link: self._finish(*call, on=link))
        return _s(reply[1]) if _s(reply[0]) == "ended" else None
