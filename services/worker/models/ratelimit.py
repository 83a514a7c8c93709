"""One rate-limit gate per API, endpoint and key per worker process.

When the API answers 429 or 529, or a response's ``anthropic-ratelimit-*`` headers say
a budget is spent, the gate closes for every turn of the process that uses that key:
no new request goes out until the server's ``retry-after`` (or the budget's reset, or a
shared backoff when the server named no time). When it reopens, one request goes first
(the *probe*); the others wait for its answer, then go together if it was let through,
or wait again if it was limited. A process that has not yet had an answer from a key
starts the same way, with one probe. So a limit costs a handful of requests however
many turns wait, instead of every turn retrying on its own.

Waiting is bounded by the caller's deadline (``TURNBUS_MODEL_WAIT_S`` per round);
past it :meth:`RateGate.wait` raises :class:`GateTimeout`.

The gate holds no loop-bound primitive (a waiter parks on a future of its own loop),
so one gate serves every event loop of the process, as the tests run several.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import time
from collections.abc import Mapping

from turnbus.worker.models.base import LimitReason

__all__ = ["GateTimeout", "RateGate", "budget_reset_s", "gate_for"]

# A budget header says "spent" when its remaining count is 0; its reset is RFC 3339.
_BUDGETS = ("requests", "tokens", "input-tokens", "output-tokens")


class GateTimeout(Exception):
    """The gate stayed closed past the caller's deadline; ``reason`` is the last limit's."""

    def __init__(self, reason: LimitReason) -> None:
        super().__init__(reason)
        self.reason = reason


def budget_reset_s(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds until the latest reset of a spent ``anthropic-ratelimit-*`` budget, or
    None when no budget is spent (or the headers are absent, as they are on most fakes)."""
    wait: float | None = None
    for budget in _BUDGETS:
        if headers.get(f"anthropic-ratelimit-{budget}-remaining") != "0":
            continue
        raw = headers.get(f"anthropic-ratelimit-{budget}-reset")
        if not raw:
            continue
        try:
            reset = datetime.datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
        left = max(reset - (time.time() if now is None else now), 0.0)
        wait = left if wait is None else max(wait, left)
    return wait


class RateGate:
    """See the module docstring. Every method runs on the caller's loop, without awaits
    between reading and changing the state, so it needs no lock."""

    def __init__(self) -> None:
        self._closed_until = 0.0  # time.monotonic()
        self._verified = False  # an answer came through since the last limit
        self._probing = False
        self._waiters: list[asyncio.Future[None]] = []
        self.reason: LimitReason = "rate_limited"
        # Limits in a row without an answer let through: the shared backoff's exponent.
        self.streak = 0

    def try_admit(self) -> bool | None:
        """``False``: go. ``True``: go as the probe (report its outcome). ``None``: wait."""
        if self._probing or time.monotonic() < self._closed_until:
            return None
        if self._verified:
            return False
        self._probing = True
        return True

    def limiting(self) -> bool:
        """Closed, or reopened after a limit and not yet let through."""
        return self.streak > 0 or time.monotonic() < self._closed_until

    def closed_for_s(self) -> float:
        return max(self._closed_until - time.monotonic(), 0.0)

    async def wait(self, deadline: float) -> None:
        """Park until the gate may have changed (it reopens, a probe is answered) or
        ``deadline`` (``time.monotonic()``), then return; raise GateTimeout past it."""
        now = time.monotonic()
        if now >= deadline:
            raise GateTimeout(self.reason)
        until = deadline
        if self._closed_until > now:
            until = min(until, self._closed_until)
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), max(until - now, 0.0))
        except TimeoutError:
            pass
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def passed(self, headers: Mapping[str, str], probe: bool, max_wait_s: float) -> None:
        """An answer came through (2xx): open for all, unless its budget headers say spent."""
        if probe:
            self._probing = False
        self._verified = True
        self.streak = 0
        spent = budget_reset_s(headers)
        if spent is not None and spent > 0:
            self._close(min(spent, max_wait_s), "rate_limited")
        self._wake()

    def limited(self, wait_s: float, reason: LimitReason, probe: bool) -> None:
        """A 429 or 529: closed for ``wait_s``; the next request after it is a probe."""
        if probe:
            self._probing = False
        self.streak += 1
        self._close(wait_s, reason)
        self._wake()

    def released(self, probe: bool) -> None:
        """A request ended without a verdict on the limit (another error, a cancel)."""
        if probe:
            self._probing = False
            self._wake()

    def _close(self, wait_s: float, reason: LimitReason) -> None:
        self._verified = False
        self.reason = reason
        self._closed_until = max(self._closed_until, time.monotonic() + wait_s)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if waiter.done():
                continue
            loop = waiter.get_loop()
            if loop.is_closed():
                continue
            loop.call_soon(_settle, waiter)


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


_GATES: dict[str, RateGate] = {}


def gate_for(api: str, api_key: str | None, base_url: str) -> RateGate:
    """The process's gate for one key at one endpoint of one API (``anthropic``,
    ``openai``); the key is held only as a digest. The API is part of the gate's identity
    because one base URL and key can serve both (a proxy such as LiteLLM's), and a limit
    one API's endpoint reports is that endpoint's: it does not hold the other API's turns."""
    digest = hashlib.sha256(f"{api}\0{base_url}\0{api_key or ''}".encode()).hexdigest()
    gate = _GATES.get(digest)
    if gate is None:
        gate = _GATES[digest] = RateGate()
    return gate
