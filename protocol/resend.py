# When a message that waits for an answer goes out again: after a first wait, then twice the previous, up to a cap.
from __future__ import annotations

import time
from typing import Generic, TypeVar

MAX_RESEND_SECONDS = 3600.0

K = TypeVar("K")


def doubled_wait(previous: float | None, first: float, cap: float = MAX_RESEND_SECONDS) -> float:
    """Seconds until the next send: `first` after the first send, then twice the previous wait, at most `cap`."""
    return first if previous is None else min(previous * 2, cap)


class ResendSchedule(Generic[K]):
    """Per key (an update, a query, an answer), when its unanswered message goes out again: `first` seconds after it
    was sent, then twice as long each time up to `cap` (a peer away for hours finds a few copies queued, not one a
    minute); a key never sent is due at once (all of them after a start)."""

    def __init__(self, first: float, cap: float = MAX_RESEND_SECONDS) -> None:
        self.first = first
        self.cap = cap
        self._next: dict[K, tuple[float, float]] = {}

    def sent(self, key: K) -> None:
        """Notes a send of `key`'s message now and schedules the next one."""
        previous = self._next.get(key)
        wait = doubled_wait(None if previous is None else previous[1], self.first, self.cap)
        self._next[key] = (time.monotonic() + wait, wait)

    def due(self, key: K, now: float) -> bool:
        """Whether `key`'s message should go out again at `now` (time.monotonic())."""
        return now >= self._next.get(key, (now, 0.0))[0]

    def next_due(self) -> float:
        """When (time.monotonic()) the first message it schedules goes out again (infinity: none scheduled)."""
        return min((due for due, _ in self._next.values()), default=float("inf"))

    def settle(self, key: K) -> None:
        """Forgets `key`: its answer came."""
        self._next.pop(key, None)
