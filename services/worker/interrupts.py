"""An event that also calls back: what interrupts a running turn, without a task per wait.

A running attempt stops for a cancel, a lost lease or the worker's grace period running
out. Waiting on three :class:`asyncio.Event` objects takes a task each, per turn;
a :class:`Signal` is an ``asyncio.Event`` that also calls the functions registered on
it when it is set, so the engine resolves one future instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["CancelSignal", "Signal"]


class Signal(asyncio.Event):
    """An ``asyncio.Event`` whose :meth:`set` also calls the registered callbacks."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []

    def set(self) -> None:
        if self.is_set():
            return
        super().set()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def on_set(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` when the signal is set (at once if it is); returns a
        function that unregisters it."""
        if self.is_set():
            callback()
            return _nothing
        self._callbacks.append(callback)

        def remove() -> None:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

        return remove


class CancelSignal(Signal):
    """A turn's cancel; ``by`` names the turn that interrupted it, for an interrupt."""

    def __init__(self) -> None:
        super().__init__()
        self.by: str | None = None

    def interrupt(self, by: str | None) -> None:
        """Set, naming the interrupting turn (the first one named stays)."""
        if by and self.by is None:
            self.by = by
        self.set()


def _nothing() -> None:
    return None
