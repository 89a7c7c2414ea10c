"""The time-bounded window behind the autoscaler's moving averages."""

import pytest

from kvpilot.operator.window import TimeWindow


def test_keeps_only_the_last_max_age_seconds():
    window = TimeWindow(10.0)
    for t in range(0, 25, 5):
        window.append(float(t), t)
    # Newest at 20 s: 10, 15 and 20 are within 10 s of it.
    assert list(window) == [10, 15, 20] and len(window) == 3
    window.extend(31.0, ["a", "b"])
    assert list(window) == ["a", "b"]


def test_rejects_a_clock_going_backwards_and_a_bad_age():
    window = TimeWindow(10.0)
    window.append(5.0, "x")
    with pytest.raises(ValueError, match="older than the newest"):
        window.append(4.0, "y")
    assert list(window) == ["x"]
    with pytest.raises(ValueError, match="max_age_seconds"):
        TimeWindow(0)
