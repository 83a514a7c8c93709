"""The retry rules every HTTP model client shares: the key's rate-limit gate, backoff,
and never a retry once text went out.

A client gives :meth:`RoundAttempts.stream` one *attempt*: an async generator that
sends the round's request, calls ``admitted.passed(headers)`` when a 2xx response
opened, yields the text as it streams and then the ``RoundResult``, and raises
:class:`AttemptFailed` (a :class:`ModelError` and the server's ``Retry-After``) when
it fails. The attempts then go as the Anthropic client's docstring says: a 429 or 529
(``rate_limited`` / ``overloaded``) closes the gate of the key for every turn of the
process and the round waits for it, up to ``settings.model_wait_s``; a 5xx and a
connection failure are retried with exponential backoff and full jitter, up to
``settings.model_max_retries`` times; either only while nothing of the round was
yielded, so a retry never duplicates text.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import email.utils
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any, Protocol

import aiohttp
import httpx2
import msgspec

from turnbus.shared.backoff import Backoff
from turnbus.shared.settings import Settings
from turnbus.worker.models.base import ModelError, ModelWaiting, RoundResult, TextChunk
from turnbus.worker.models.ratelimit import GateTimeout, RateGate
from turnbus.worker.models.transport import Post, SseSplitter

__all__ = [
    "Admitted",
    "AttemptFailed",
    "RoundAttempts",
    "SdkFailures",
    "StreamAssembler",
    "retry_after_s",
    "stream_attempt",
]

log = logging.getLogger(__name__)

_RETRYABLE = frozenset({"provider_error", "connection"})


class AttemptFailed(Exception):
    """A failed attempt: the error to raise if it is the last, and the server's wait hint."""

    def __init__(self, error: ModelError, retry_after_s: float | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.retry_after_s = retry_after_s


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """The server's ``retry-after-ms`` or ``retry-after`` (seconds or an HTTP date)."""
    raw_ms = headers.get("retry-after-ms")
    if raw_ms:
        try:
            return max(float(raw_ms) / 1000, 0.0)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if not raw:
        return None
    try:
        return max(float(raw), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


class Admitted:
    """One attempt's place at the gate: ``passed`` once its response opened."""

    __slots__ = ("_gate", "_max_wait_s", "probe")

    def __init__(self, gate: RateGate, probe: bool, max_wait_s: float) -> None:
        self._gate = gate
        self._max_wait_s = max_wait_s
        self.probe = probe

    def passed(self, headers: Mapping[str, str]) -> None:
        self._gate.passed(headers, self.probe, self._max_wait_s)
        self.probe = False


class StreamAssembler(Protocol):
    """Folds one response's server-sent events into the round's result."""

    def feed_data(self, data: bytes) -> str | None:
        """One event's ``data``; the text it adds to the reply, if any."""
        ...

    def result(self) -> RoundResult:
        """The round; raises AttemptFailed when the stream did not finish."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class SdkFailures:
    """How one SDK's exceptions become failed attempts."""

    status_error: type[Exception]  # APIStatusError
    timeout_error: type[Exception]  # APITimeoutError
    connection_error: type[Exception]  # APIConnectionError
    from_status: Callable[[Any], AttemptFailed]


async def stream_attempt(
    post: Post,
    body: bytes,
    admitted: Admitted,
    assembler: StreamAssembler,
    failures: SdkFailures,
) -> AsyncGenerator[TextChunk | RoundResult, None]:
    """One try of a round: the request (built once by the SDK: auth, base URL, headers,
    timeouts, error statuses as its exceptions; the body encoded by msgspec), the
    streamed response read unparsed by the SDK and folded as it comes."""
    try:
        splitter = SseSplitter()
        response = await post.send(body)
        try:
            admitted.passed(response.headers)
            async for chunk in response.chunks():
                for data in splitter.feed(chunk):
                    text = assembler.feed_data(data)
                    if text:
                        yield TextChunk(text)
        finally:
            await response.aclose()
        result = assembler.result()
    except failures.status_error as exc:
        raise failures.from_status(exc) from None
    except failures.timeout_error:
        raise AttemptFailed(ModelError("connection", "the request timed out")) from None
    except failures.connection_error as exc:
        message = str(getattr(exc, "message", "") or exc)
        raise AttemptFailed(ModelError("connection", message)) from None
    except (httpx2.TransportError, aiohttp.ClientError) as exc:
        message = f"{type(exc).__name__} mid-stream"
        raise AttemptFailed(ModelError("connection", message)) from None
    except TimeoutError:
        raise AttemptFailed(ModelError("connection", "the stream timed out")) from None
    except msgspec.DecodeError as exc:
        message = f"an undecodable stream event: {exc}"
        raise AttemptFailed(ModelError("provider_error", message)) from None
    yield result


Attempt = Callable[[Admitted], AsyncGenerator[TextChunk | RoundResult, None]]


class RoundAttempts:
    """The retry loop of one client (module docstring)."""

    def __init__(
        self,
        settings: Settings,
        *,
        base_delay_s: float = 0.5,
        max_delay_s: float = 8.0,
        max_retry_after_s: float = 30.0,
    ) -> None:
        self._settings = settings
        self.max_retry_after_s = max_retry_after_s
        # A failed round's retry: full jitter, anywhere up to min(base · 2^attempt, max).
        base_delay_s = min(base_delay_s, max_delay_s)
        self._retries = Backoff(base_delay_s, max_delay_s, jitter=1.0)
        # A limit's hold: the same doubling with the limits in a row, half of it jittered.
        self._limits = Backoff(base_delay_s, max_delay_s, jitter=0.5)

    def _backoff_s(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(base · 2^attempt, max)]."""
        return self._retries.delay(attempt + 1)

    def _limit_wait_s(self, gate: RateGate, retry_after: float | None) -> float:
        """How long a 429/529 closes the gate: the server's word (capped), else a shared
        backoff that doubles with the limits in a row (half of it jittered)."""
        if retry_after is not None:
            return min(retry_after, self.max_retry_after_s)
        return self._limits.delay(gate.streak + 1)

    async def stream(
        self, gate: RateGate, attempt: Attempt
    ) -> AsyncIterator[TextChunk | ModelWaiting | RoundResult]:
        settings = self._settings
        deadline = time.monotonic() + settings.model_wait_s
        failures = 0  # failures other than a rate limit, retried by count
        while True:
            announced = False
            while (probe := gate.try_admit()) is None:
                # Behind a limit, followers are told why nothing streams; behind the
                # first request of a fresh process (a probe, no limit seen) they are not.
                if not announced and gate.limiting():
                    announced = True
                    yield ModelWaiting(gate.reason, round(gate.closed_for_s(), 3))
                try:
                    await gate.wait(deadline)
                except GateTimeout as exc:
                    raise ModelError(
                        exc.reason,
                        f"the model's key stayed {exc.reason.replace('_', ' ')} for "
                        f"{settings.model_wait_s:g} s (TURNBUS_MODEL_WAIT_S)",
                    ) from None
            admitted = Admitted(gate, probe, self.max_retry_after_s)
            emitted = False
            try:
                async with contextlib.aclosing(attempt(admitted)) as items:
                    async for item in items:
                        if isinstance(item, TextChunk):
                            emitted = True
                        yield item
                        if isinstance(item, RoundResult):
                            return
                raise AttemptFailed(ModelError("connection", "the stream ended without a result"))
            except AttemptFailed as failed:
                retry = failed
            finally:
                if admitted.probe:  # no verdict on the limit (an error, a cancel)
                    gate.released(True)
                    admitted.probe = False
            error = retry.error
            if emitted:
                raise error
            if error.reason == "rate_limited" or error.reason == "overloaded":
                wait_s = self._limit_wait_s(gate, retry.retry_after_s)
                gate.limited(wait_s, error.reason, admitted.probe)
                log.warning("model round %s: the key's requests held %.2fs", error.reason, wait_s)
                continue
            if error.reason not in _RETRYABLE or failures >= settings.model_max_retries:
                raise error
            delay = self._backoff_s(failures)
            failures += 1
            log.warning(
                "model round failed (%s), retry %d/%d in %.2fs",
                error.reason,
                failures,
                settings.model_max_retries,
                delay,
            )
            await asyncio.sleep(delay)
