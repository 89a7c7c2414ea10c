"""Condition helpers: lastTransitionTime moves only when the status changes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from kvpilot.operator.conditions import format_time, get_condition, is_true, set_condition

T0 = datetime(2026, 11, 30, 9, 0, 0, tzinfo=UTC)


def test_transition_time_changes_only_with_status():
    first = set_condition(
        [], "Ready", False, reason="Pending", message="0/1 ready", observed_generation=1, now=T0
    )
    assert first == [
        {
            "type": "Ready",
            "status": "False",
            "reason": "Pending",
            "message": "0/1 ready",
            "observedGeneration": 1,
            "lastTransitionTime": "2026-11-30T09:00:00Z",
        }
    ]
    later = T0 + timedelta(minutes=5)
    same = set_condition(
        first, "Ready", False, reason="Loading", message="loading", observed_generation=2, now=later
    )
    assert get_condition(same, "Ready")["lastTransitionTime"] == "2026-11-30T09:00:00Z"
    assert get_condition(same, "Ready")["reason"] == "Loading"
    assert get_condition(same, "Ready")["observedGeneration"] == 2
    flipped = set_condition(
        same, "Ready", True, reason="Ready", message="1/1", observed_generation=2, now=later
    )
    assert get_condition(flipped, "Ready")["lastTransitionTime"] == "2026-11-30T09:05:00Z"
    assert is_true(flipped, "Ready") and not is_true(first, "Ready")
    assert first[0]["status"] == "False"  # the input is not modified


def test_other_conditions_keep_their_order():
    conditions = set_condition(
        None, "Sized", True, reason="Planned", message="", observed_generation=1, now=T0
    )
    conditions = set_condition(
        conditions, "Ready", "Unknown", reason="Starting", message="", observed_generation=1, now=T0
    )
    conditions = set_condition(
        conditions,
        "Sized",
        False,
        reason="ModelTooLarge",
        message="",
        observed_generation=2,
        now=T0,
    )
    assert [c["type"] for c in conditions] == ["Sized", "Ready"]
    assert get_condition(conditions, "Degraded") is None


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="True, False or Unknown"):
        set_condition([], "Ready", "yes", reason="X", message="", observed_generation=1, now=T0)
    with pytest.raises(ValueError, match="CamelCase"):
        set_condition(
            [], "Ready", True, reason="not ready", message="", observed_generation=1, now=T0
        )
    with pytest.raises(ValueError, match="timezone"):
        format_time(datetime(2026, 1, 1))
    assert format_time(datetime(2026, 1, 1, 2, tzinfo=timezone(timedelta(hours=2)))) == (
        "2026-01-01T00:00:00Z"
    )
