"""A time-bounded window of timestamped items: the memory behind moving averages.

The autoscaler looks at the last ``stable_window_seconds`` (and the shorter panic window) of
scrapes; the timer keeps one :class:`TimeWindow` per ``LLMDeployment`` and hands its items to
the pure decision function. Items older than ``max_age_seconds`` are dropped on every append,
so memory stays bounded by the scrape rate times the window.

The idea follows KubeAI's ``movingaverage/simple.go`` (a fixed-size ring of samples), keyed by
time instead of by count so that a late or skipped scrape does not stretch the window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class TimeWindow(Generic[T]):
    """Items stamped with a time in seconds, oldest first, at most ``max_age_seconds`` old.

    Args:
        max_age_seconds: how far back, in seconds before the newest item, items are kept.

    Raises:
        ValueError: ``max_age_seconds`` is not positive.
    """

    def __init__(self, max_age_seconds: float) -> None:
        if not max_age_seconds > 0:
            raise ValueError(f"max_age_seconds must be > 0, got {max_age_seconds!r}")
        self.max_age_seconds = float(max_age_seconds)
        self._items: deque[tuple[float, T]] = deque()

    def append(self, timestamp: float, item: T) -> None:
        """Add ``item`` seen at ``timestamp`` (seconds) and drop what fell out of the window.

        Raises:
            ValueError: ``timestamp`` is older than the newest item (the clock went backwards).
        """
        if self._items and timestamp < self._items[-1][0]:
            raise ValueError(
                f"timestamp {timestamp} is older than the newest item ({self._items[-1][0]})"
            )
        self._items.append((timestamp, item))
        horizon = timestamp - self.max_age_seconds
        while self._items and self._items[0][0] < horizon:
            self._items.popleft()

    def extend(self, timestamp: float, items: list[T]) -> None:
        """Add several items seen at the same ``timestamp`` (one scrape round)."""
        for item in items:
            self.append(timestamp, item)

    def __iter__(self) -> Iterator[T]:
        return (item for _, item in self._items)

    def __len__(self) -> int:
        return len(self._items)
