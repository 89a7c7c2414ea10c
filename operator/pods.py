"""What an LLMDeployment's pods and model cache claim say about it (pure).

The reconciler reports it in the ``Degraded`` condition, so that a user who runs ``kubectl get
llmd`` sees why replicas are missing (a pod the scheduler cannot place, a claim nothing binds,
an engine that keeps crashing) without reading pods and events; the autoscaler counts pending
and starting replicas from the same fields.
"""

from __future__ import annotations

import datetime
from typing import Any

CONTAINER_FAILURES = (
    "CrashLoopBackOff",
    "CreateContainerConfigError",
    "CreateContainerError",
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "RunContainerError",
)
"""Waiting reasons of a container the kubelet cannot start or keep running."""


def condition(pod: dict[str, Any], kind: str) -> dict[str, Any]:
    """The pod's status condition of type ``kind`` (``{}`` when it has none)."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return cond
    return {}


def unschedulable(pod: dict[str, Any]) -> bool:
    """Whether the scheduler could not place ``pod`` (condition ``PodScheduled`` False)."""
    return condition(pod, "PodScheduled").get("status") == "False"


def is_ready(pod: dict[str, Any]) -> bool:
    """Whether ``pod`` is Ready and not being deleted."""
    deleting = (pod.get("metadata") or {}).get("deletionTimestamp")
    return not deleting and condition(pod, "Ready").get("status") == "True"


def parse_time(value: str) -> float:
    """A Kubernetes timestamp (RFC 3339) as Unix seconds."""
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def stalled(pod: dict[str, Any]) -> bool:
    """Whether ``pod`` served and then stopped answering its readiness probe: not being
    deleted, ``Ready`` False, and every container running since before ``Ready`` last turned
    False (so it was Ready in this run of its containers: an engine too busy to answer its
    probe in time, or hung). Its load is missing from the metrics window, as a Ready pod's is
    when its scrape fails. A container that restarted runs since after: that pod is starting
    again, not stalled."""
    metadata = pod.get("metadata") or {}
    ready = condition(pod, "Ready")
    turned = ready.get("lastTransitionTime")
    if metadata.get("deletionTimestamp") or ready.get("status") != "False" or not turned:
        return False
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    started = [((s.get("state") or {}).get("running") or {}).get("startedAt") for s in statuses]
    return bool(started) and all(at and parse_time(at) < parse_time(turned) for at in started)


def starting_pods(pods: list[dict[str, Any]], now: float, hold_seconds: float) -> int:
    """How many of ``pods`` are starting: placed (``PodScheduled`` True), not ``Ready``, not
    :func:`stalled`, not being deleted, and created less than ``hold_seconds`` before ``now``
    (Unix seconds). An older one is stuck (crash loop, failed model load) and counts no more;
    one without a creation time neither."""
    count = 0
    for pod in pods:
        metadata = pod.get("metadata") or {}
        created = metadata.get("creationTimestamp")
        if (
            created
            and not metadata.get("deletionTimestamp")
            and not stalled(pod)
            and condition(pod, "PodScheduled").get("status") == "True"
            and condition(pod, "Ready").get("status") != "True"
            and now - parse_time(created) < hold_seconds
        ):
            count += 1
    return count


def startup_seconds(pods: list[dict[str, Any]]) -> float:
    """How long the ready pods took from creation to Ready (the longest, seconds; 0 when no
    pod says)."""
    longest = 0.0
    for pod in pods:
        created = (pod.get("metadata") or {}).get("creationTimestamp")
        ready = condition(pod, "Ready")
        ready_at = ready.get("lastTransitionTime")
        if ready.get("status") == "True" and created and ready_at:
            longest = max(longest, parse_time(ready_at) - parse_time(created))
    return longest


def claim_failure(
    claim: dict[str, Any] | None, pods: list[dict[str, Any]]
) -> tuple[str, str] | None:
    """``("ModelCacheClaimPending", message)`` when the model cache claim is not bound and an
    engine pod cannot be scheduled because of it, else None.

    A claim is Pending for a while after creation, and a ``WaitForFirstConsumer`` class binds
    it only once a pod is scheduled: only a pod the scheduler refused makes it a failure.
    """
    if claim is None or (claim.get("status") or {}).get("phase", "Pending") != "Pending":
        return None
    waiting = [pod for pod in pods if unschedulable(pod)]
    if not waiting:
        return None
    name = claim["metadata"]["name"]
    storage_class = (claim.get("spec") or {}).get("storageClassName")
    where = f"storage class {storage_class!r}" if storage_class else "no storage class"
    scheduler = condition(waiting[0], "PodScheduled").get("message", "")
    return (
        "ModelCacheClaimPending",
        f"PersistentVolumeClaim {name} ({where}) is Pending: nothing provisions or binds a "
        f"volume for it, so {len(waiting)} pod(s) cannot be scheduled: {scheduler}",
    )


def pod_failure(pods: list[dict[str, Any]]) -> tuple[str, str] | None:
    """``(reason, message)`` for the first problem the pods show, or None.

    ``Unschedulable`` (with the scheduler's message: no node with enough GPUs, none of the
    requested GPU type, a quota...) before a container that cannot start or keeps crashing
    (its waiting reason, e.g. ``CrashLoopBackOff``, with the last exit code).
    """
    waiting = [
        pod for pod in pods if unschedulable(pod) and not pod["metadata"].get("deletionTimestamp")
    ]
    if waiting:
        message = condition(waiting[0], "PodScheduled").get("message", "")
        return "Unschedulable", f"{len(waiting)} pod(s) cannot be scheduled: {message}"
    for pod in pods:
        if pod["metadata"].get("deletionTimestamp"):
            continue
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting_state = (status.get("state") or {}).get("waiting") or {}
            reason = waiting_state.get("reason")
            failed_before = ((status.get("lastState") or {}).get("terminated") or {}).get(
                "exitCode"
            )
            if reason is None and failed_before and not status.get("ready"):
                # Running again after a failure, not ready yet: still crash-looping (a
                # transient "running" between two back-offs must not read as recovered).
                reason = "CrashLoopBackOff"
            if reason in CONTAINER_FAILURES:
                last = ((status.get("lastState") or {}).get("terminated")) or {}
                exit_code = f", last exit code {last['exitCode']}" if "exitCode" in last else ""
                detail = waiting_state.get("message") or ""
                return (
                    reason,
                    f"pod {pod['metadata']['name']} container {status.get('name')}: {reason}"
                    f"{exit_code}{': ' + detail if detail else ''} (restarts: "
                    f"{status.get('restartCount', 0)})",
                )
    return None
