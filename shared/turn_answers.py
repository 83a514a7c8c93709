"""A caller's answer to a paused turn (``POST …/turns/{tid}/actions``): the results of
its client calls and the decisions on its calls awaiting approval, checked against the
pending calls and stored with the move back to ``queued`` in one script
(``lua/turn_actions.lua``), then the work entry written.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

import jsonschema  # type: ignore[import-untyped]
import msgspec
import redis.asyncio as aioredis

from turnbus.shared.events import ToolResult, encode_event
from turnbus.shared.keys import Keys
from turnbus.shared.records import PendingCall, TurnRecord, now_ms, record_from_hash
from turnbus.shared.replicas import ReplicaWait
from turnbus.shared.scripts import LuaScript, pairs
from turnbus.shared.scripts import text as _s
from turnbus.shared.settings import Settings
from turnbus.shared.tool_specs import truncate_tool_result
from turnbus.shared.turn_errors import (
    ActionsInvalid,
    IdempotencyMismatch,
    TurnNotFound,
    TurnNotWaiting,
)
from turnbus.shared.turn_scripts import TurnRef, TurnScripts

__all__ = [
    "APPROVAL_REASON_MAX_BYTES",
    "REJECTED",
    "ActionAnswer",
    "ApprovalAnswer",
    "TurnAnswers",
]

_json_encoder = msgspec.json.Encoder()


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


class TurnAnswers:
    """Answers to paused turns. ``read``: the turn record's read; ``enqueue``: the work
    entry's write (:meth:`TurnQueue.write_work_entry`)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        settings: Settings,
        *,
        replicas: ReplicaWait,
        read: Callable[[str, str, str], Awaitable[TurnRecord | None]],
        enqueue: Callable[[str, str, str], Awaitable[None]],
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.replicas = replicas
        self._read = read
        self._enqueue = enqueue
        self._scripts = TurnScripts(keys, settings)
        self._actions = LuaScript(redis, "turn_actions.lua")

    async def submit(
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
                replayed = await self._read(user, session, turn_id)
                if replayed is None:
                    raise TurnNotFound(turn_id)
                return replayed, True
        now = now_ms()

        def actions(
            pending: str, answered: int, events: list[bytes], approved: list[str | bytes],
            written: list[str | bytes],
        ) -> Awaitable[Any]:  # fmt: skip
            call = self._scripts.turn_actions(
                TurnRef(user, session, turn_id), now=now, pending=pending, idem=idem,
                digest=digest, answered=answered, events=events, approved=approved,
                written=written,
            )  # fmt: skip
            return self.replicas.write(self.redis, lambda link: self._actions(*call, on=link))

        checked: tuple[str, str] | None = None
        if not approvals:
            # Results only, the common answer: the script checks them against the
            # pending calls itself, which saves the read before it.
            results = [(a.callId, a.output, a.isError) for a in answers]
            events, written = _answered(turn_id, results, pieces=True)
            # The pending calls as checked: "" while unchecked.
            reply = await actions("", len(answers), events, [], written)
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
            reply = await actions(pending_json, len(events), events, approved, written)
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
            await self._enqueue(user, session, turn_id)
            return answered, False
        replayed = await self._read(user, session, turn_id)
        if replayed is None:
            raise TurnNotFound(turn_id)
        return replayed, True


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
