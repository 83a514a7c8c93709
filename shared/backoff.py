"""The delays between the tries of a retry loop: :class:`Backoff`, the one every loop uses.

Importing it imports nothing but the standard library (the client uses it too).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

__all__ = ["Backoff"]

# Past this many doublings every delay is the cap anyway (and 2**n stays a small int).
_MAX_DOUBLINGS = 64


class Backoff(Iterator[float]):
    """A retry loop's delays: ``base_s``, doubling at each try up to ``cap_s``, each cut
    at random by up to ``jitter`` of itself (``0.5``: anywhere in its upper half;
    ``1.0``: anywhere from nothing to all of it), so callers that failed together do not
    come back together.

    It is an iterator of delays: ``next(backoff)`` is the delay before the next try.
    A loop that gives up says when: after ``max_tries`` delays, or (``within_s``) when a
    delay would end more than ``within_s`` after the backoff was made; then
    ``next(backoff, None)`` is ``None``. :meth:`reset` after a try that succeeded starts
    again from ``base_s``. ``clock`` is the one the deadline is kept on (an event loop's
    ``time``, say)."""

    __slots__ = ("_clock", "base_s", "cap_s", "deadline", "jitter", "max_tries", "tries")

    def __init__(
        self,
        base_s: float,
        cap_s: float,
        *,
        jitter: float = 0.0,
        max_tries: int | None = None,
        within_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 <= base_s <= cap_s:
            raise ValueError(f"a backoff needs 0 <= base_s <= cap_s, not {base_s} and {cap_s}")
        if not 0 <= jitter <= 1:
            raise ValueError(f"jitter is a fraction of the delay (0 to 1), not {jitter}")
        self.base_s = base_s
        self.cap_s = cap_s
        self.jitter = jitter
        self.max_tries = max_tries
        self._clock = clock
        self.deadline = None if within_s is None else clock() + within_s
        self.tries = 0  # delays given since the start or the last reset

    def delay(self, tries: int) -> float:
        """The delay after ``tries`` failures in a row (1: the first), jitter drawn;
        counts nothing (for a loop that keeps its own count)."""
        doublings = min(max(tries - 1, 0), _MAX_DOUBLINGS)
        delay = min(self.cap_s, self.base_s * 2.0**doublings)
        if self.jitter:
            delay *= 1.0 - random.random() * self.jitter
        return delay

    def __next__(self) -> float:
        if self.max_tries is not None and self.tries >= self.max_tries:
            raise StopIteration
        delay = self.delay(self.tries + 1)
        if self.deadline is not None and self._clock() + delay > self.deadline:
            raise StopIteration
        self.tries += 1
        return delay

    def reset(self) -> None:
        """A try succeeded: the next delay is ``base_s`` again (the deadline stays)."""
        self.tries = 0
