"""Tests that play a worker's part on a turn, through the worker's own paths: its start
and finish scripts (:class:`~turnbus.worker.commit.TurnCommit`) and its event writer."""

from __future__ import annotations

import os

from turnbus.shared import caps
from turnbus.shared.events import Event, encode_event
from turnbus.shared.records import TurnRecord
from turnbus.shared.turns import TurnNotFound, TurnStore
from turnbus.worker.commit import TurnCommit
from turnbus.worker.events_out import EventWriter
from turnbus.worker.lease import SessionLease, new_lease_token
from turnbus.worker.models.base import UsageCounts
from turnbus.worker.outcome import TurnOutcome
from turnbus.worker.retry import RedisRetry


def turn_commit(turns: TurnStore, worker: str = "w1") -> TurnCommit:
    """The worker's turn scripts, on the store's client, keys and settings."""
    return TurnCommit(
        turns.redis,
        turns.keys,
        turns.settings,
        worker_name=worker,
        budget=caps.HARNESS_SESSION_MAX_META_BYTES,
        retry=RedisRetry(0),
        replicas=turns.replicas,
    )


async def start_turn(
    turns: TurnStore,
    user: str,
    session: str,
    turn_id: str,
    worker: str,
) -> TurnRecord | None:
    """Start an attempt as worker ``worker`` does, and lose it at once (its lease lapses,
    as a dead worker's does). ``None`` when the turn had already ended."""
    settings = turns.settings
    lease = SessionLease(
        turns.redis,
        turns.keys,
        user=user,
        session=session,
        turn_id=turn_id,
        token=new_lease_token(worker, turn_id),
        lease_ms=settings.lease_ms,
        heartbeat_ms=settings.heartbeat_ms,
    )
    reply = await turn_commit(turns, worker).start(user, session, turn_id, lease)
    await turns.redis.delete(lease.key)
    if reply.status == "not_found":
        raise TurnNotFound(turn_id)
    if reply.status not in ("started", "exhausted"):
        return None
    return reply.record


async def end_turn(
    turns: TurnStore,
    user: str,
    session: str,
    turn_id: str,
    status: str,
    *,
    reason: str | None = None,
    error: str | None = None,
    stop_reason: str | None = None,
    at: int | None = None,
) -> str | None:
    """End the turn as a worker's finish does, without its lease; returns the terminal
    event's id, ``None`` when the turn had already ended."""
    outcome = TurnOutcome(status, reason=reason, error=error, stop_reason=stop_reason)
    return await turn_commit(turns).finish(
        user, session, turn_id, lease_token="", outcome=outcome, usage=UsageCounts(), at=at
    )


async def append_events(
    turns: TurnStore,
    user: str,
    session: str,
    turn_id: str,
    *events: Event,
) -> None:
    """Append events to the turn's stream as a worker's attempt writes them."""
    writer = EventWriter(turns.redis, turns.settings.events_maxlen)
    data = [encode_event(event) for event in events]
    key = turns.keys.turn_events(user, session, turn_id)
    await writer.append(key, data, tag=os.urandom(4).hex(), first=0)
