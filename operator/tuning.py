"""Live tuning: recommend ``gpu_memory_utilization`` and ``max_num_seqs`` from what the engines
did, and decide when a tuned rollout must roll back. Pure functions.

The rules follow vLLM's own tuning advice (docs "Optimization and Tuning": preemption means
the KV cache is too small for the batch; give it more memory, or admit fewer sequences), made
conditional on what was measured:

- **Preempting** (preemptions in the window, or the KV cache at ``FULL_KV`` or more): raise
  ``gpu_memory_utilization`` by up to ``UTILIZATION_STEP``, never past ``max_utilization`` or
  past the measured peak device memory plus ``MEMORY_MARGIN``; if there is no room left, the
  pressure is sustained: with ``allow_kv_cache_dtype`` (``autoscaling.allowKvCacheDtype``) and
  a 16-bit cache, switch ``kv_cache_dtype`` to ``fp8`` (one byte per element: twice the tokens
  in the same memory, as vLLM's docs "Quantized KV Cache" describe, at a small accuracy cost,
  hence the user's consent); otherwise lower ``max_num_seqs`` to ``SEQS_BACKOFF`` of the peak
  running requests.
- **Sequence-bound** (no preemption, requests waiting, running at ``max_num_seqs``, KV cache
  under ``ROOMY_KV``): raise ``max_num_seqs`` in proportion to the free KV cache, at most 2x.
- Otherwise: keep the settings.

Rollback (:func:`rollback_reason`): a canary is worse when its TTFT p90 or its preemption
rate exceeds the baseline's by more than ``tolerance``.

Applying (``autoscaling.tuneEngine: true``) is a :class:`Rollout` that :func:`next_rollout`
moves along ``Canary`` (one replica runs the new settings) -> ``Applied`` (all do) or
``RolledBack`` (all run the previous settings; the rejected ones are not tried again). The
loop records it in the annotation ``TUNING_ANNOTATION``; the reconciler renders it: for
``Canary`` one replica with the label ``CANARY_LABEL`` and ``settings``, the rest as before;
for ``Applied`` every replica with ``settings``; for ``RolledBack`` every replica with
``previous`` (the plan's when None).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvpilot.engine.model_shape import KV_CACHE_DTYPE_BYTES
from kvpilot.operator.signals import MetricSample, summarize

FULL_KV = 0.98
ROOMY_KV = 0.7
UTILIZATION_STEP = 0.05
MEMORY_MARGIN = 0.03
SEQS_BACKOFF = 0.75

TUNING_ANNOTATION = "kvpilot.dev/engine-tuning"
"""Annotation on the LLMDeployment holding the tuning :class:`Rollout` (JSON)."""

CANARY_LABEL = "kvpilot.dev/canary"
"""Label (value ``"true"``) of the pod that runs the canary settings."""

PHASES = ("Canary", "Applied", "RolledBack")

FP8_KV_CACHE_DTYPE = "fp8"
"""The ``kv_cache_dtype`` the tuner proposes under sustained KV pressure (when allowed)."""


@dataclass(frozen=True)
class EngineSettings:
    """The engine flags live tuning touches.

    Attributes:
        gpu_memory_utilization: fraction of device memory the engine may use, 0..1.
        max_num_seqs: most sequences in one step.
        kv_cache_dtype: ``--kv-cache-dtype`` (``auto``: the plan's).
    """

    gpu_memory_utilization: float
    max_num_seqs: int
    kv_cache_dtype: str = "auto"

    def as_dict(self) -> dict[str, float | int | str]:
        """camelCase, as in ``status.recommendations``; ``kvCacheDtype`` only when not
        ``auto``."""
        settings: dict[str, float | int | str] = {
            "gpuMemoryUtilization": round(self.gpu_memory_utilization, 3),
            "maxNumSeqs": self.max_num_seqs,
        }
        if self.kv_cache_dtype != "auto":
            settings["kvCacheDtype"] = self.kv_cache_dtype
        return settings

    @classmethod
    def from_dict(cls, raw: dict) -> EngineSettings:
        """Inverse of :meth:`as_dict`.

        Raises:
            ValueError: a missing key or a value out of range.
        """
        try:
            settings = cls(
                float(raw["gpuMemoryUtilization"]),
                int(raw["maxNumSeqs"]),
                str(raw.get("kvCacheDtype", "auto")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"not engine settings: {raw!r}") from error
        if not 0.0 < settings.gpu_memory_utilization <= 1.0 or settings.max_num_seqs < 1:
            raise ValueError(f"engine settings out of range: {raw!r}")
        if settings.kv_cache_dtype not in KV_CACHE_DTYPE_BYTES:
            raise ValueError(f"engine settings: unknown kvCacheDtype in {raw!r}")
        return settings


@dataclass(frozen=True)
class Observation:
    """What a fleet (or one canary replica) did over an observation window.

    Attributes:
        peak_kv_cache_usage: highest per-pod KV-cache usage seen, 0..1.
        peak_num_requests_running: highest running requests on one pod.
        num_requests_waiting: mean waiting requests per pod.
        preemptions_per_second: preemption rate per pod, 1/s.
        ttft_p90_seconds: TTFT p90 in seconds, or None without requests.
        peak_memory_fraction: highest device memory in use over total, 0..1, or None when the
            engine does not export it.
    """

    peak_kv_cache_usage: float
    peak_num_requests_running: float
    num_requests_waiting: float
    preemptions_per_second: float
    ttft_p90_seconds: float | None = None
    peak_memory_fraction: float | None = None


@dataclass(frozen=True)
class Recommendation:
    """Settings to apply (equal to the current ones when nothing should change) and why."""

    settings: EngineSettings
    reason: str

    def changes(self, current: EngineSettings) -> bool:
        return self.settings != current


def recommend(
    current: EngineSettings,
    observed: Observation,
    *,
    max_utilization: float = 0.95,
    allow_kv_cache_dtype: bool = False,
) -> Recommendation:
    """Recommend engine settings from ``observed`` (rules in the module docstring).

    Args:
        current: the settings the pods run with.
        observed: peaks and rates over the observation window.
        max_utilization: never recommend a ``gpu_memory_utilization`` above this.
        allow_kv_cache_dtype: the user allowed a fp8 KV cache (``allowKvCacheDtype``).

    Raises:
        ValueError: ``current`` is out of range (utilization outside (0, 1], seqs < 1).
    """
    if not 0.0 < current.gpu_memory_utilization <= 1.0 or current.max_num_seqs < 1:
        raise ValueError(f"engine settings out of range: {current}")
    preempting = observed.preemptions_per_second > 0 or observed.peak_kv_cache_usage >= FULL_KV
    if preempting:
        ceiling = max_utilization
        if observed.peak_memory_fraction is not None:
            # Memory the engine uses beyond its budget (activations, graphs) stays in use.
            overhead = max(0.0, observed.peak_memory_fraction - current.gpu_memory_utilization)
            ceiling = min(ceiling, 1.0 - MEMORY_MARGIN - overhead)
        room = ceiling - current.gpu_memory_utilization
        if room >= 0.01:
            utilization = current.gpu_memory_utilization + min(UTILIZATION_STEP, room)
            return Recommendation(
                dataclasses.replace(current, gpu_memory_utilization=round(utilization, 3)),
                f"preempting at peak KV usage {observed.peak_kv_cache_usage:.0%}: give the "
                f"KV cache more memory",
            )
        if allow_kv_cache_dtype and current.kv_cache_dtype == "auto":
            return Recommendation(
                dataclasses.replace(current, kv_cache_dtype=FP8_KV_CACHE_DTYPE),
                f"preempting at peak KV usage {observed.peak_kv_cache_usage:.0%} with no memory "
                "left: a fp8 KV cache holds twice the tokens",
            )
        seqs = max(1, math.floor(SEQS_BACKOFF * observed.peak_num_requests_running))
        if seqs < current.max_num_seqs:
            return Recommendation(
                dataclasses.replace(current, max_num_seqs=seqs),
                "preempting with no memory left: admit fewer sequences",
            )
        return Recommendation(current, "preempting, but nothing left to tune")
    sequence_bound = (
        observed.num_requests_waiting > 0
        and observed.peak_num_requests_running >= current.max_num_seqs
        and observed.peak_kv_cache_usage < ROOMY_KV
    )
    if sequence_bound:
        factor = min(2.0, ROOMY_KV / max(observed.peak_kv_cache_usage, ROOMY_KV / 2))
        seqs = math.ceil(current.max_num_seqs * factor)
        return Recommendation(
            dataclasses.replace(current, max_num_seqs=seqs),
            f"requests wait at max_num_seqs {current.max_num_seqs} with KV usage "
            f"{observed.peak_kv_cache_usage:.0%}: admit more sequences",
        )
    return Recommendation(current, "settings fit the observed load")


def rollback_reason(
    baseline: Observation, canary: Observation, *, tolerance: float = 0.1
) -> str | None:
    """Why the canary (tuned) replica is worse than the baseline, or None if it is not.

    Args:
        baseline: the untouched replicas over the same window.
        canary: the tuned replica.
        tolerance: relative slack before "worse", e.g. 0.1 for 10%.
    """
    if (
        baseline.ttft_p90_seconds is not None
        and canary.ttft_p90_seconds is not None
        and canary.ttft_p90_seconds > baseline.ttft_p90_seconds * (1 + tolerance)
    ):
        return (
            f"TTFT p90 went from {baseline.ttft_p90_seconds:.3f}s to {canary.ttft_p90_seconds:.3f}s"
        )
    if canary.preemptions_per_second > baseline.preemptions_per_second * (1 + tolerance) + 1e-9:
        return (
            f"preemptions went from {baseline.preemptions_per_second:.3f}/s to "
            f"{canary.preemptions_per_second:.3f}/s"
        )
    return None


def observe(samples: Sequence[MetricSample], *, start: float | None = None) -> Observation | None:
    """Per-pod peaks and rates of ``samples`` stamped at or after ``start`` (seconds), or None
    when there are none."""
    window = [s for s in samples if start is None or s.timestamp >= start]
    signals = summarize(window)
    if signals is None:
        return None
    pods = max(signals.num_pods, 1.0)
    return Observation(
        peak_kv_cache_usage=max(s.kv_cache_usage for s in window),
        peak_num_requests_running=max(s.num_requests_running for s in window),
        num_requests_waiting=signals.num_requests_waiting / pods,
        preemptions_per_second=signals.preemptions_per_second / pods,
        ttft_p90_seconds=signals.ttft_seconds.get(0.9),
    )


@dataclass(frozen=True)
class Rollout:
    """Tuned engine settings on their way out (see the module docstring).

    Attributes:
        phase: ``Canary``, ``Applied`` or ``RolledBack``.
        settings: the tuned settings (for ``RolledBack``: the rejected ones).
        previous: what ran before (None: the plan's settings).
        started: when this phase began, seconds.
        reason: why it is in this phase, for people.
    """

    phase: str
    settings: EngineSettings
    previous: EngineSettings | None
    started: float
    reason: str = ""

    def in_force(self) -> EngineSettings | None:
        """The settings most replicas run; None for the plan's."""
        return self.settings if self.phase == "Applied" else self.previous

    def to_annotation(self) -> str:
        return json.dumps(
            {
                "phase": self.phase,
                "settings": self.settings.as_dict(),
                "previous": self.previous.as_dict() if self.previous else None,
                "started": self.started,
                "reason": self.reason,
            }
        )

    @classmethod
    def from_annotation(cls, raw: str) -> Rollout:
        """Inverse of :meth:`to_annotation`.

        Raises:
            ValueError: not a rollout (bad JSON, unknown phase, bad settings).
        """
        try:
            data = json.loads(raw)
            phase = data["phase"]
            previous = data.get("previous")
            rollout = cls(
                phase,
                EngineSettings.from_dict(data["settings"]),
                EngineSettings.from_dict(previous) if previous else None,
                float(data["started"]),
                str(data.get("reason", "")),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{TUNING_ANNOTATION} is not a rollout: {error}") from error
        if phase not in PHASES:
            raise ValueError(f"{TUNING_ANNOTATION}: phase {phase!r} is not one of {PHASES}")
        return rollout


def next_rollout(
    current: Rollout | None,
    recommendation: Recommendation,
    plan_settings: EngineSettings,
    baseline: Observation | None,
    canary: Observation | None,
    now: float,
    *,
    canary_seconds: float,
) -> Rollout | None:
    """The rollout after this observation (the same object when nothing changes).

    Args:
        current: the rollout in the annotation, or None.
        recommendation: what :func:`recommend` says for the settings in force.
        plan_settings: the planner's settings, in force when no rollout says otherwise.
        baseline: the replicas without the canary label over the canary's time.
        canary: the canary replica over the same time.
        now: seconds.
        canary_seconds: how long a canary runs before it is judged.
    """
    if current is not None and current.phase == "Canary":
        if now - current.started < canary_seconds or baseline is None or canary is None:
            return current
        worse = rollback_reason(baseline, canary)
        if worse is not None:
            return Rollout("RolledBack", current.settings, current.previous, now, worse)
        return Rollout("Applied", current.settings, current.previous, now, "canary held up")
    in_force = (current.in_force() if current else None) or plan_settings
    rejected = current.settings if current and current.phase == "RolledBack" else None
    if not recommendation.changes(in_force) or recommendation.settings == rejected:
        return current
    previous = current.in_force() if current else None
    return Rollout("Canary", recommendation.settings, previous, now, recommendation.reason)
