"""An attempt's rounds against what interrupts them, and how the attempt ended.

The rounds run as a task of their own; a cancel, the wall clock, a lost lease or the
worker's grace period running out interrupt the model stream at once (the stream is
stopped, nothing more is written). How the rounds ended, or what interrupted them,
becomes the attempt's :class:`~turnbus.worker.outcome.TurnOutcome`: a terminal status
to end the turn with, ``abandoned`` (left for redelivery) or ``gone``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from turnbus.shared.envelope import LeaseNotHeld, SessionNotFound
from turnbus.shared.keys import Keys
from turnbus.shared.records import TurnRecord, now_ms
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnNotFound
from turnbus.worker.cancellation import stop_task
from turnbus.worker.history import HistoryFenced
from turnbus.worker.interrupts import Signal
from turnbus.worker.models.base import ModelError
from turnbus.worker.outcome import TurnOutcome
from turnbus.worker.retry import REDIS_UNAVAILABLE
from turnbus.worker.rounds import RoundRunner
from turnbus.worker.state import AttemptState

__all__ = ["AttemptRunner"]

log = logging.getLogger(__name__)


class AttemptRunner:
    """Runs the rounds of an attempt until they end or something interrupts them."""

    def __init__(
        self, redis: aioredis.Redis, keys: Keys, settings: Settings, rounds: RoundRunner
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.rounds = rounds

    async def run(
        self,
        state: AttemptState,
        *,
        deadline_ms: int,
        cancel: asyncio.Event,
        stop: asyncio.Event | None = None,
    ) -> TurnOutcome:
        """Play the turn's rounds until it ends; a cancel, the wall clock, a lost lease or
        ``stop`` (the worker's grace period ran out) interrupt the model stream at once."""
        record, lease = state.record, state.lease
        loop = asyncio.get_running_loop()
        body = loop.create_task(self.rounds.play(state), name=f"turn:{record.turnId}")
        # What interrupts the rounds resolves one future (a Signal calls back); a plain
        # Event is waited on by a task of its own.
        interrupted: asyncio.Future[str] = loop.create_future()
        removers: list[Callable[[], None]] = []
        watchers: dict[asyncio.Task[Any], str] = {}

        def interrupt(why: str) -> Callable[[], None]:
            def fire() -> None:
                if not interrupted.done():
                    interrupted.set_result(why)

            return fire

        for event, why in ((cancel, "cancel"), (lease.lost, "lease_lost"), (stop, "stop")):
            if isinstance(event, Signal):
                removers.append(event.on_set(interrupt(why)))
            elif event is not None:
                watchers[loop.create_task(event.wait())] = why
        timeout = max((deadline_ms - now_ms()) / 1000, 0)
        waits: set[asyncio.Future[Any]] = {body, interrupted, *watchers}
        try:
            done, _ = await asyncio.wait(
                waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        except asyncio.CancelledError:
            # Cancelled from outside (the worker stopping): the body must stop too, and
            # redis-py can swallow a single cancel, so it is repeated until it lands.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(stop_task(body))
            raise
        finally:
            for remove in removers:
                remove()
            for watcher in watchers:
                watcher.cancel()
            if not interrupted.done():
                interrupted.cancel()
        if body in done:
            outcome = self._body_outcome(body, record.turnId)
            if outcome.status == "abandoned" and not await self._record_exists(record):
                outcome = TurnOutcome("gone")
            return outcome
        await stop_task(body)
        if interrupted in done:
            why = interrupted.result()
        else:
            why = next((watchers[w] for w in done if w in watchers), "timeout")
        if why == "lease_lost" and not await self._record_exists(record):
            return TurnOutcome("gone")
        if why == "cancel":
            return TurnOutcome("cancelled")
        if why == "timeout":
            return TurnOutcome(
                "timed_out",
                reason="wall_clock",
                error=f"the turn ran past its wall clock of {self.settings.turn_wall_clock_ms} ms",
            )
        return TurnOutcome("abandoned", reason=why)

    def _body_outcome(self, body: asyncio.Task[TurnOutcome], turn_id: str) -> TurnOutcome:
        exc = body.exception()
        if exc is None:
            return body.result()
        if isinstance(exc, ModelError):
            return TurnOutcome("failed", reason=exc.reason, error=exc.message)
        if isinstance(exc, HistoryFenced | LeaseNotHeld):
            return TurnOutcome("abandoned", reason="lease_lost")
        if isinstance(exc, TurnNotFound | SessionNotFound):
            return TurnOutcome("gone")
        if isinstance(exc, REDIS_UNAVAILABLE):
            # Not the turn's fault: leave it for redelivery, resumed from its last
            # committed round (bounded by the attempt cap).
            log.warning("turn %s interrupted: Redis unavailable (%s)", turn_id, exc)
            return TurnOutcome("abandoned", reason="redis_unavailable")
        log.error("turn %s failed inside the engine", turn_id, exc_info=exc)
        return TurnOutcome(
            "failed",
            reason="internal",
            error=f"internal error in the turn engine ({type(exc).__name__})",
        )

    async def _record_exists(self, record: TurnRecord) -> bool:
        key = self.keys.turn(record.userId, record.sessionId, record.turnId)
        return bool(await self.redis.exists(key))
