"""The KEYS and ARGV of every turn script, each built by one method of
:class:`TurnScripts` named after its script (``turn_start`` builds
``lua/turn_start.lua``'s). The scripts' header comments
say what each position holds; these functions are the only code that puts values in
those positions. Nothing here talks to Redis.

Every key of one call is in the session's slot (the session's hash tag, or the slot's
outbox picked for it).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

from turnbus.shared import caps
from turnbus.shared.contracts import CancelReason
from turnbus.shared.keys import Keys
from turnbus.shared.records import TurnRecord, record_fields
from turnbus.shared.settings import Settings

__all__ = ["Arg", "Fence", "QueueScripts", "RunScripts", "ScriptCall", "TurnRef", "TurnScripts"]

Arg = str | bytes | int


class ScriptCall(NamedTuple):
    """One call of a script: its KEYS and its ARGV, in the script's order."""

    keys: list[str]
    args: list[Arg]


class TurnRef(NamedTuple):
    """The turn a call is for."""

    user: str
    session: str
    turn_id: str


class Fence(Protocol):
    """A session lease as a fenced script takes it: its key and the holder's token."""

    key: str
    token: str


class _Bound:
    """A deployment's key prefix and settings, which every builder reads."""

    def __init__(self, keys: Keys, settings: Settings) -> None:
        self.keys = keys
        self.settings = settings


class QueueScripts(_Bound):
    """The scripts the gateway runs: a turn in, its cancel while it waits, the outbox's
    due marks, and the answer to a paused turn."""

    def turn_submit(
        self,
        record: TurnRecord,
        *,
        idem: str,
        digest: str,
        queued: bytes,
        title: str,
    ) -> ScriptCall:
        """``lua/turn_submit.lua``: the new turn's ``record`` (its fields last), its
        ``turn.queued`` event, the ``Idempotency-Key``'s digest (``idem``, "" for none) and the
        body's, and the title the session takes from the message when it has none."""
        k, settings = self.keys, self.settings
        user, session, turn_id = record.userId, record.sessionId, record.turnId
        keys = [
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
        args: list[Arg] = [
            turn_id,
            str(settings.events_ttl_s),
            record.multitask,
            idem,
            digest,
            str(settings.idempotency_ttl_s),
            queued,
            str(settings.events_maxlen),
            user,
            session,
            str(record.createdAt),
            k.session_tag(user, session),
            str(settings.session_queue_max),
            title,
            str(settings.log_maxlen),
            str(caps.HARNESS_SESSION_MAX_META_BYTES),
            str(settings.session_ttl_ms or ""),
            *_flat(record_fields(record).items()),
        ]
        return ScriptCall(keys, args)

    def turn_transition_cancel(
        self,
        turn: TurnRef,
        *,
        now: int,
        event: bytes,
        announce: str,
        reason: CancelReason = "cancelled",
    ) -> ScriptCall:
        """``lua/turn_transition.lua``'s cancel: the ``turn.cancelled`` ``event`` and the
        record's ``reason`` for a turn it ends, the message ``announce`` on the cancel channel
        for a running one (and for a paused one with turns queued behind it: their
        workers look at once)."""
        k, settings = self.keys, self.settings
        user, session, turn_id = turn
        keys = [
            k.turn(user, session, turn_id),
            k.active(user, session),
            k.turn_events(user, session, turn_id),
            k.log(user, session),
            k.turn_calls(user, session, turn_id),
            k.messages(user, session),
            k.env(user, session),
            k.webhook_outbox(user, session),
        ]
        args: list[Arg] = [
            "cancel",
            str(now),
            turn_id,
            json.dumps({"reason": reason}),
            event,
            str(settings.events_maxlen),
            str(settings.log_maxlen),
            str(settings.events_ttl_s),
            k.cancel_channel(),
            announce,
            str(caps.HARNESS_SESSION_MAX_META_BYTES),
            session,
            Keys.outbox_member(user, session, turn_id),
        ]
        return ScriptCall(keys, args)

    def outbox_due(self, outbox: str, *, now: int, marks: int) -> ScriptCall:
        """``lua/outbox_due.lua``: at most ``marks`` of one slot's ``outbox`` past the grace."""
        return ScriptCall(
            [outbox], [self.keys.prefix, str(now), str(self.settings.outbox_grace_ms), marks]
        )

    def turn_actions(
        self,
        turn: TurnRef,
        *,
        now: int,
        pending: str,
        idem: str,
        digest: str,
        answered: int,
        events: Sequence[Arg],
        approved: Sequence[Arg] = (),
        written: Sequence[Arg],
    ) -> ScriptCall:
        """``lua/turn_actions.lua``: an answer to a paused turn. ``pending``: the pending
        calls as the caller checked them ("" while unchecked: the script checks the results
        itself, and each of the ``answered`` events is then three pieces); ``approved``: the
        calls' approval marks; ``written``: the calls hash's result fields. With turns
        queued behind this one, the script says so on the cancel channel, as a cancel of a
        paused turn does (``turn_transition``), so their workers look at once."""
        k, settings = self.keys, self.settings
        user, session, turn_id = turn
        keys = [
            k.turn(user, session, turn_id),
            k.turn_calls(user, session, turn_id),
            k.turn_events(user, session, turn_id),
            k.outbox(user, session),
            k.idempotency(user, session, idem or "none"),
            k.active(user, session),
        ]
        args: list[Arg] = [
            turn_id,
            str(now),
            pending,
            idem,
            digest,
            str(settings.idempotency_ttl_s),
            Keys.outbox_member(user, session, turn_id),
            str(settings.events_maxlen),
            str(answered),
            k.cancel_channel(),
            json.dumps({"user": user, "session": session, "answered": turn_id}),
            *events,
            *approved,
            *written,
        ]
        return ScriptCall(keys, args)


class RunScripts(_Bound):
    """The scripts a worker runs over a turn's life: start, each round, its tool calls,
    the pause, the end."""

    def turn_start(
        self,
        turn: TurnRef,
        lease: Fence,
        *,
        lease_ms: int,
        worker: str,
        now: int,
        budget: int,
        held: tuple[str, bytes],
        redis_lost_ms: int | None,
    ) -> ScriptCall:
        """``lua/turn_start.lua``: an attempt's start under the lease ``token``; ``held``:
        how many history rows the worker holds and the last of them; ``redis_lost_ms``: how
        long the worker lost Redis just before (``None``: it did not)."""
        k, settings = self.keys, self.settings
        user, session, turn_id = turn
        keys = [
            k.turn(user, session, turn_id),
            k.active(user, session),
            lease.key,
            k.turn_events(user, session, turn_id),
            k.env(user, session),
            k.log(user, session),
            k.messages(user, session),
            k.outbox(user, session),
            k.turn_calls(user, session, turn_id),
        ]
        args: list[Arg] = [
            turn_id,
            lease.token,
            str(lease_ms),
            worker,
            str(now),
            str(settings.max_deliveries),
            str(settings.events_maxlen),
            str(settings.log_maxlen),
            str(budget),
            session,
            Keys.outbox_member(user, session, turn_id),
            *held,
            "" if redis_lost_ms is None else str(redis_lost_ms),
            str(caps.MAX_MODEL_ROUNDS),
        ]
        return ScriptCall(keys, args)

    def turn_round(
        self,
        turn: TurnRef,
        lease: Fence,
        *,
        mode: str,
        drop: int,
        envelope_at: int | None,
        events: Sequence[bytes],
        logged: Sequence[int],
        notes: tuple[str, int, str] | None,
        budget: int,
        now: int,
        rows: Sequence[bytes],
    ) -> ScriptCall:
        """``lua/turn_round.lua``: a round's history ``rows`` (``mode`` and ``drop``: how
        they join the list), its ``events`` (``logged``: the 1-based places of those that go
        on the session log too), the held notes write (text, bytes, SHA-256; "" text: a
        clear; ``None``: none), answered against the worker's envelope clock
        ``envelope_at``."""
        k, settings = self.keys, self.settings
        user, session, turn_id = turn
        keys = [
            k.messages(user, session),
            lease.key,
            k.turn(user, session, turn_id),
            k.turn_events(user, session, turn_id),
            k.env(user, session),
            k.log(user, session),
        ]
        write: list[Arg] = ["", "", "", ""]
        if notes is not None:
            write = ["1", notes[0], str(notes[1]), notes[2]]
        args: list[Arg] = [
            lease.token,
            mode,
            str(drop),
            str(envelope_at or ""),
            str(settings.events_maxlen),
            str(len(events)),
            *write,
            session,
            str(settings.log_maxlen),
            str(budget),
            str(now),
            str(len(logged)),
            *(str(i) for i in logged),
            *events,
            *rows,
        ]
        return ScriptCall(keys, args)

    def turn_calls(
        self,
        turn: TurnRef,
        lease: Fence,
        *,
        mode: str,
        events: Sequence[bytes],
        tail: Sequence[Arg],
    ) -> ScriptCall:
        """``lua/turn_calls.lua``: a round's tool calls (``mode``: ``intent``, ``approved``
        or ``result``, whose values are ``tail``) and ``events``, fenced by the lease."""
        k, settings = self.keys, self.settings
        user, session, turn_id = turn
        keys = [
            lease.key,
            k.turn_calls(user, session, turn_id),
            k.turn_events(user, session, turn_id),
        ]
        args: list[Arg] = [
            lease.token,
            mode,
            str(settings.events_ttl_s * 1000),
            str(settings.events_maxlen),
            str(len(events)),
            *events,
            *tail,
        ]
        return ScriptCall(keys, args)

    def turn_pause(
        self,
        turn: TurnRef,
        lease: Fence,
        *,
        at: int,
        rnd: int,
        assistant: bytes,
        pending: bytes,
        event: bytes,
        deadline: int,
        budget: int,
        timeout_ms: int,
        closing: Sequence[bytes],
        settled: Iterable[tuple[str, bytes]],
    ) -> ScriptCall:
        """``lua/turn_pause.lua``: the round's ``assistant`` message and ``settled`` results
        kept for the resume, the ``closing`` rows (at most two) for an end without an
        answer, the ``pending`` calls and ``turn.requires_action`` (``event``), the outbox
        mark set to the ``deadline``."""
        k, settings = self.keys, self.settings
        user, session, turn_id = turn
        keys = [
            lease.key,
            k.turn(user, session, turn_id),
            k.turn_events(user, session, turn_id),
            k.turn_calls(user, session, turn_id),
            k.env(user, session),
            k.log(user, session),
            k.outbox(user, session),
        ]
        args: list[Arg] = [
            lease.token,
            str(at),
            str(rnd),
            assistant,
            pending,
            event,
            str(deadline),
            str(deadline - settings.outbox_grace_ms),
            Keys.outbox_member(user, session, turn_id),
            str(settings.events_maxlen),
            str(settings.log_maxlen),
            str(budget),
            session,
            # The hash outlives the wait: a late end still finds the closing rows.
            str(timeout_ms + settings.events_ttl_s * 1000),
            *closing,
            *(b"" for _ in range(2 - len(closing))),
            *_flat(settled),
        ]
        return ScriptCall(keys, args)

    def turn_finish(
        self,
        turn: TurnRef,
        *,
        token: str,
        at: int,
        terminal: bytes,
        budget: int,
        mode: str,
        drop: int,
        events: Sequence[bytes],
        webhook: bytes | str,
        fields: dict[str, str],
        patch: dict[str, str],
        rows: Sequence[bytes],
    ) -> ScriptCall:
        """``lua/turn_finish.lua``: the turn's end. ``terminal``: its terminal event, after
        ``events``; ``fields``: the record's, ``patch``: the envelope's (under the lease
        ``token`` only, "" for none); the history ``rows`` (``mode``, ``drop``); ``webhook``:
        the record's webhook to queue ("": none)."""
        k, settings = self.keys, self.settings
        user, session, turn_id = turn
        keys = [
            k.turn(user, session, turn_id),
            k.active(user, session),
            k.turn_events(user, session, turn_id),
            k.log(user, session),
            k.lease(user, session),
            k.env(user, session),
            k.messages(user, session),
            k.webhook_outbox(user, session),
        ]
        args: list[Arg] = [
            turn_id,
            token,
            str(at),
            str(len(fields)),
            terminal,
            str(settings.events_maxlen),
            str(settings.log_maxlen),
            str(settings.events_ttl_s),
            str(settings.session_ttl_ms or ""),
            Keys.outbox_member(user, session, turn_id),
            session,
            str(budget),
            str(len(patch)),
            mode,
            str(drop),
            str(len(events)),
            webhook,
            *events,
            *_flat(fields.items()),
            *_flat(patch.items()),
            *rows,
        ]
        return ScriptCall(keys, args)


class TurnScripts(QueueScripts, RunScripts):
    """Every turn script's builder, bound to a deployment's key prefix and settings."""


def _flat(pairs: Iterable[tuple[str, Arg]]) -> list[Arg]:
    return [x for pair in pairs for x in pair]
