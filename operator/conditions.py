"""Status conditions, as Kubernetes API conventions define them (pure).

A condition is ``{type, status, reason, message, observedGeneration, lastTransitionTime}``;
``status`` is ``"True"``, ``"False"`` or ``"Unknown"``; ``lastTransitionTime`` changes only when
``status`` does, so it tells how long the resource has been in its current state.
LLMDeployment uses ``Sized``, ``Progressing``, ``Ready`` and ``Degraded``.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

SIZED = "Sized"
PROGRESSING = "Progressing"
READY = "Ready"
DEGRADED = "Degraded"

_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")


def format_time(moment: datetime) -> str:
    """RFC 3339 in UTC with second precision, as Kubernetes writes ``metav1.Time``.

    Raises:
        ValueError: a naive datetime (its time zone would be a guess).
    """
    if moment.tzinfo is None:
        raise ValueError("format_time needs a timezone-aware datetime")
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def get_condition(conditions: list[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    """The condition of type ``type_``, or None."""
    return next((c for c in conditions or [] if c.get("type") == type_), None)


def set_condition(
    conditions: list[dict[str, Any]] | None,
    type_: str,
    status: bool | str,
    *,
    reason: str,
    message: str,
    observed_generation: int,
    now: datetime,
) -> list[dict[str, Any]]:
    """A new list with condition ``type_`` set; the input is not modified.

    Args:
        conditions: the current ``status.conditions`` (None or empty for none).
        type_: e.g. ``"Ready"``.
        status: True/False, or ``"True"``, ``"False"``, ``"Unknown"``.
        reason: CamelCase, machine-readable (``"ModelTooLarge"``).
        message: for people.
        observed_generation: the ``metadata.generation`` this condition describes.
        now: the time used as ``lastTransitionTime`` if the status changes.

    Raises:
        ValueError: a status other than those three, or a reason that is not CamelCase
            (the API server's pattern).
    """
    text = (
        {True: "True", False: "False"}.get(status, status) if isinstance(status, bool) else status
    )
    if text not in ("True", "False", "Unknown"):
        raise ValueError(f"condition status must be True, False or Unknown, got {status!r}")
    if not _REASON.match(reason):
        raise ValueError(f"condition reason must be CamelCase, got {reason!r}")
    previous = get_condition(conditions, type_)
    unchanged = previous is not None and previous.get("status") == text
    condition = {
        "type": type_,
        "status": text,
        "reason": reason,
        "message": message,
        "observedGeneration": observed_generation,
        "lastTransitionTime": previous["lastTransitionTime"] if unchanged else format_time(now),
    }
    others = [c for c in conditions or [] if c.get("type") != type_]
    if previous is None:
        return [*others, condition]
    return [condition if c.get("type") == type_ else c for c in conditions]


def is_true(conditions: list[dict[str, Any]] | None, type_: str) -> bool:
    """Whether condition ``type_`` exists with status ``"True"``."""
    condition = get_condition(conditions, type_)
    return condition is not None and condition.get("status") == "True"
