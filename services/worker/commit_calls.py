"""A round's tool calls and the pause, committed as they happen (``lua/turn_calls.lua``,
``lua/turn_pause.lua``): the intent of each side-effecting call before it runs, its
result as soon as it is known, the calls an approver let run, and the pause that waits
for the caller's answers. A resumed attempt reads them back (:class:`RoundCalls`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import redis.asyncio as aioredis

from turnbus.shared.events import Event, TurnRequiresAction, encode_event
from turnbus.shared.keys import Keys
from turnbus.shared.records import PendingCall, now_ms
from turnbus.shared.replicas import ReplicaWait
from turnbus.shared.scripts import LuaScript
from turnbus.shared.scripts import text as _s
from turnbus.shared.settings import Settings
from turnbus.shared.turn_scripts import TurnRef, TurnScripts
from turnbus.worker.history import HistoryFenced, stored_row
from turnbus.worker.lease import SessionLease
from turnbus.worker.retry import RedisRetry

__all__ = ["ACTION_CLOSED", "CallsCommit", "RoundCalls", "StoredResult", "round_calls_from"]

# The result a pending client call gets when its turn ends without an answer (a cancel,
# the action timeout): the history never holds a tool_use without its result.
ACTION_CLOSED = "ERROR no result: the turn ended before its caller answered this call"

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


class CallsCommit:
    """The tool-call scripts of one worker, bound to its client and settings."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        settings: Settings,
        *,
        budget: int,
        retry: RedisRetry,
        replicas: ReplicaWait,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.budget = budget
        self.retry = retry
        # A terminal event is acknowledged (the entry acked) once these replicas have it.
        self.replicas = replicas
        self._scripts = TurnScripts(keys, settings)
        self._calls = LuaScript(redis, "turn_calls.lua")
        self._pause = LuaScript(redis, "turn_pause.lua")

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
        call = self._scripts.turn_calls(
            TurnRef(user, session, turn_id),
            lease,
            mode=mode,
            events=[encode_event(e) for e in events],
            tail=tail,
        )
        if mode in ("intent", "approved"):
            # No call starts before its intent is on the replicas asked for
            # (TURNBUS_WAIT_REPLICAS): a failover cannot then lose it.
            def write() -> Any:
                return self.replicas.write(self.redis, lambda link: self._calls(*call, on=link))
        else:

            def write() -> Any:
                return self._calls(*call)

        reply = await self.retry.run(mode, write, lease)
        if _s(reply) == "fenced":
            raise HistoryFenced(call.keys[1])

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
        call = self._scripts.turn_pause(
            TurnRef(user, session, turn_id),
            lease,
            at=at,
            rnd=rnd,
            assistant=_row_encoder.encode(assistant),
            pending=_row_encoder.encode(list(pending)),
            event=encode_event(event),
            deadline=deadline,
            budget=self.budget,
            timeout_ms=timeout_ms,
            closing=[_row_encoder.encode(stored_row(row, keep_thinking=False)) for row in closing],
            settled=[(call_id, _row_encoder.encode(r)) for call_id, r in settled.items()],
        )
        # The entry is acked after the pause: like a terminal event, the pause must be
        # on the replicas asked for first, or a failover could lose a turn no entry holds.
        reply = await self.retry.run(
            "pause",
            lambda: self.replicas.write(self.redis, lambda link: self._pause(*call, on=link)),
            lease,
            turn=turn_id,
        )
        return _s(reply)
