"""Redis calls retried while Redis is unreachable, instead of abandoning the attempt."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.exceptions

from turnbus.shared.backoff import Backoff
from turnbus.shared.records import now_ms
from turnbus.worker.health import WorkerMetrics
from turnbus.worker.lease import SessionLease

__all__ = ["REDIS_ERRORS", "REDIS_UNAVAILABLE", "RedisRetry"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# Refused or lost connections, no pooled connection free: Redis is unreachable (for now).
REDIS_UNAVAILABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
# Any failed Redis call: unreachable, or an error reply.
REDIS_ERRORS = (redis.exceptions.RedisError, OSError)


class RedisRetry:
    """Runs a call; while Redis is unreachable retries it, backing off, for up to
    ``retry_ms`` (the lease heartbeat keeps renewing meanwhile)."""

    def __init__(self, retry_ms: int, metrics: WorkerMetrics | None = None) -> None:
        self.retry_ms = retry_ms
        self.metrics = metrics
        # The last stretch in which this process's calls found Redis unreachable: from
        # the start of the first call that failed to the end of the next one that did not.
        self._unreachable_since: int | None = None
        self._outage: tuple[int, int] | None = None

    def recent_outage_ms(self, within_ms: int) -> int | None:
        """How long Redis did not answer this process, if that ended (or goes on) within
        the last ``within_ms``: what a new attempt of an interrupted turn names."""
        now = now_ms()
        if self._unreachable_since is not None:
            return now - self._unreachable_since
        if self._outage is not None and now - self._outage[1] <= within_ms:
            return self._outage[1] - self._outage[0]
        return None

    async def run(
        self,
        what: str,
        call: Callable[[], Awaitable[_T]],
        lease: SessionLease | None = None,
        *,
        turn: str | None = None,
    ) -> _T:
        """``call()``, tried again while Redis is unreachable, unless ``lease`` is lost.
        Each retry and a give-up are logged with the turn's id (``turn``, else the
        lease's)."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        # 50 ms doubling to 1 s, for up to retry_ms from the first try.
        backoff = Backoff(0.05, 1.0, within_s=self.retry_ms / 1000, clock=loop.time)
        label = turn or (lease.turn_id if lease is not None else None)
        what = f"turn {label}: {what}" if label else what
        while True:
            started = now_ms()
            try:
                result = await call()
            except REDIS_UNAVAILABLE as exc:
                if self._unreachable_since is None or started < self._unreachable_since:
                    self._unreachable_since = started
                lost = lease is not None and lease.lost.is_set()
                delay = None if lost else next(backoff, None)
                if delay is None:
                    log.warning(
                        "%s: Redis unavailable (%s); giving up after %.1f s%s",
                        what,
                        exc,
                        loop.time() - began,
                        " (the lease is lost)" if lost else "",
                    )
                    raise
                log.warning("%s: Redis unavailable (%s); retrying in %.2f s", what, exc, delay)
                if self.metrics is not None:
                    self.metrics.redis_retries.inc()
                await asyncio.sleep(delay)
                continue
            if self._unreachable_since is not None:
                self._outage = (self._unreachable_since, now_ms())
                self._unreachable_since = None
            return result
