"""The autoscaling decision: a window of engine metrics -> desired replicas and a reason.

Pure: no clock, no I/O. The caller (``autoscaling_handlers``) scrapes, keeps the window and the
:class:`AutoscalerMemory` between calls, and writes the result back.

How it decides, in order (docs/autoscaling.md explains each rule):

1. **Load in replica units** from a window's :class:`~kvpilot.operator.signals.Signals`: the
   KV demand is the KV load (sum of the pods' usage) plus, for the requests waiting beyond
   ``targetWaitingRequests`` per ready replica, the KV share a running request holds; the slot
   demand is running plus those waiting requests over ``max_num_seqs`` (short requests fill the
   slots before the cache); the token demand is the fleet's token rate over the most one
   replica did while the fleet was saturated (learned online), plus the rise of the token rate
   over a pod's start-up time when it grows. ``ceil(max(KV, slots, tokens) /
   targetKVCacheUsage)`` replicas.
2. **Stable and panic windows** (Knative KPA): the stable window's answer is used normally; when
   the short panic window asks for at least ``PANIC_THRESHOLD`` times the ready replicas, panic
   mode starts for one stable window, in which it scales up at once and never down.
3. **Stabilization** (Kubernetes HPA ``behavior``): scale up to the smallest recommendation
   of the last ``scaleUpStabilizationSeconds``, down to the largest of the last
   ``scaleDownStabilizationSeconds``, so a noisy signal does not flap. Until a replica's
   capacity has been learned, scale-down probes one replica per stable window.
4. **Rate limits** (KPA's, on the replicas asked for): at most ``ceil(maxScaleUpRate *
   replicas)`` and at least ``floor(replicas / maxScaleDownRate)`` per decision.
5. **Pending and starting pods**: no scale-up while pods asked for earlier are Pending, i.e.
   the scheduler found no node for them (no free GPU): more of them would only wait too; nor
   while placed pods are still starting (not Ready, younger than
   :func:`starting_hold_seconds`): they are capacity on its way, and meanwhile the ready pods
   look overloaded, so asking for more on top would overshoot (the Kubernetes HPA, too, is
   conservative about not-yet-ready pods on scale-up). A pod not Ready after that bound (crash
   loop, failed model load) no longer holds the fleet. Starting pods do not hold the
   replicas a forecast (rule 9) asks for; Pending ones do.
6. **Scale to zero** after ``idleSeconds`` without traffic when ``minReplicas`` is 0; **wake from
   zero** when a wake request (annotation ``kvpilot.dev/wake``) is newer than the last scaling
   (to the stamp's resolution: a whole-second stamp counts as the end of its second).
   Requests a router holds for the deployment (``kvpilot.dev/held-requests``, reported with
   the wake time) are demand: a wake starts enough replicas to give each a sequence slot, and
   while pods are starting and none is Ready, more are asked for when the held requests
   outgrow the replicas' slots (not while pods are Pending).
7. **Bounds**: ``[minReplicas, maxReplicas]``, then the namespace's GPU budget, which wins.
8. **Bigger, not more**: when the pressure comes from long contexts (a running request holds at
   least ``LONG_CONTEXT_SHARE`` of a replica's KV cache, the cache is above target, and requests
   wait or get preempted), a larger shape from the planner is chosen instead of more replicas,
   unless the user fixed ``tensorParallelSize``.
9. **Recurring bursts** (``predictiveScaling``, :mod:`kvpilot.operator.forecast`): the load of
   each scrape interval goes into a history; when it shows bursts that recur with a period,
   the replicas the last period needed one pod start-up time (plus a tick) ahead are asked
   for now, not rate-limited, so they are ready when the burst comes. While the forecast
   holds, it replaces the scale-down stabilization: replicas follow the latest interval's
   load down to what the forecast needs within a start-up time. A reactive scale-up during a
   forecast burst that ends before the new pods would be ready is held at the forecast for
   when they would be (not below the current replicas), unless the load seen now is above the
   forecast. A forecast burst that does not come (the load stays at or below half the
   forecast) is a miss: the history before it stops counting for the forecast, so a changed
   period is learned again from the new bursts. Without a period: rules 1-8 unchanged.
10. **Unscraped pods**: no scale-down, nor scale to zero, in a decision where a Ready pod's
    metrics could not be read, or a pod that was Ready stopped answering its readiness probe
    (:func:`~kvpilot.operator.pods.stalled`): its load is missing from the window (a busy
    engine can miss the scrape or probe timeout, and its clients keep waiting on it); the
    replicas stay (``Unscraped``) until every such pod answers again, or restarts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace

from kvpilot.operator.crd import default, field_schema, python_name
from kvpilot.operator.forecast import (
    BUCKET_SECONDS,
    DemandHistory,
    ForecastMemory,
    Prediction,
    burst_ceiling,
    verified_predict,
)
from kvpilot.operator.signals import MetricSample, Signals, summarize
from kvpilot.operator.spec import (
    AutoscalingSpec,
    LLMDeploymentSpec,
    SpecError,
    parse_autoscaling,
)

SHAPE_ANNOTATION = "kvpilot.dev/shape"
"""Annotation on the LLMDeployment holding the shape the autoscaler chose (JSON)."""

PANIC_THRESHOLD = 2.0
"""Panic when the panic window asks for this many times the ready replicas (KPA's 200%)."""

SATURATED_KV = 0.9
"""KV-cache usage at which a replica counts as saturated (its throughput is its capacity)."""

LONG_CONTEXT_SHARE = 0.25
"""A running request holding this fraction of a replica's KV cache (4 fill it) is long."""

WAKE_STAMP_RESOLUTION_SECONDS = 1.0
"""A wake request's time is often whole seconds (``date +%s``): a stamp ``s`` stands for some
moment in ``[s, s + 1)``, so it is newer than a scaling at ``t`` when ``s + 1 > t``. Read as the
moment ``s`` itself, a wake written in the same second as a scale to zero (after it) would be
taken for an older one and ignored."""

STARTING_HOLD_FLOOR_SECONDS = 300.0
"""A placed, not-yet-Ready pod counts as starting for at least this long (the Kubernetes HPA's
default ``--horizontal-pod-autoscaler-cpu-initialization-period``), whatever the start-up
time learned so far: a pod on a fresh node pulls its image and weights first."""


def starting_hold_seconds(startup_seconds: float) -> float:
    """How long after its creation a placed, not-yet-Ready pod counts as starting, and so holds
    scale-ups (rule 5): twice the start-up time, at least ``STARTING_HOLD_FLOOR_SECONDS``.
    Older than that it is stuck (crash loop, failed model load), not capacity on its way."""
    return max(STARTING_HOLD_FLOOR_SECONDS, 2.0 * startup_seconds)


@dataclass(frozen=True)
class AutoscalingPolicy:
    """The ``spec.autoscaling`` knobs the decision reads (units: replicas, seconds, ratios;
    ``predictive_scaling`` turns rule 9 on).

    Each field is the ``spec.autoscaling`` field of the same name in camelCase, and stated
    there once (``crd.SPEC_SCHEMA``): its range, the rules between fields and, where the CRD
    has one, its default. The other defaults are the autoscaler's own, applied to a knob the
    spec leaves unset; they are not CRD defaults, so that the API server does not store them
    in every object and a later operator may change them.

    Raises:
        ValueError: from ``__post_init__``, naming the first field out of range or against a
            rule between fields, as spec.py's reader of ``spec.autoscaling`` finds it.
    """

    min_replicas: int = default("autoscaling.minReplicas")
    max_replicas: int = 1
    target_kv_cache_usage: float = 0.7
    target_waiting_requests: float = 2.0
    idle_seconds: float = 300.0
    scale_up_stabilization_seconds: float = 0.0
    scale_down_stabilization_seconds: float = 300.0
    panic_window_seconds: float = 6.0
    stable_window_seconds: float = 60.0
    max_scale_up_rate: float = 2.0
    max_scale_down_rate: float = 2.0
    gpu_budget: int | None = None
    predictive_scaling: bool = default("autoscaling.predictiveScaling")

    def __post_init__(self) -> None:
        knobs = {f.name: getattr(self, f.name) for f in fields(self)}
        try:
            parse_autoscaling(
                {_SPEC_NAMES[name]: value for name, value in knobs.items() if value is not None},
                path="autoscaling",
            )
        except SpecError as error:
            name = _POLICY_NAMES[error.field.removeprefix("autoscaling.")]
            raise ValueError(f"autoscaling.{name} is out of range: {error.message}") from error

    @classmethod
    def from_spec(cls, spec: AutoscalingSpec) -> AutoscalingPolicy:
        """The policy of a parsed ``spec.autoscaling``; its unset (None) knobs take the
        defaults above."""
        given = {
            f.name: getattr(spec, f.name)
            for f in fields(cls)
            if getattr(spec, f.name, None) is not None
        }
        return cls(**given)


_SPEC_NAMES = {python_name(key): key for key in field_schema("autoscaling")["properties"]}
"""``spec.autoscaling``'s camelCase field of each snake_case name (``AutoscalingPolicy``'s and
``AutoscalingSpec``'s fields)."""
_POLICY_NAMES = {key: name for name, key in _SPEC_NAMES.items()}


@dataclass(frozen=True)
class Shape:
    """One replica's shape as the planner sized it.

    Attributes:
        tensor_parallel_size: GPUs per replica.
        gpu_type: the GPU product name, as in ``spec.resources``.
        kv_cache_capacity_tokens: tokens of KV cache one replica holds in this shape.
    """

    tensor_parallel_size: int
    gpu_type: str
    kv_cache_capacity_tokens: int

    def to_annotation(self) -> str:
        """The value of ``SHAPE_ANNOTATION`` that makes the reconciler roll this shape out."""
        return json.dumps(
            {"tensorParallelSize": self.tensor_parallel_size, "gpuType": self.gpu_type}
        )


def apply_shape(spec: LLMDeploymentSpec, annotations: Mapping[str, str]) -> LLMDeploymentSpec:
    """``spec`` with the autoscaler's chosen shape (``SHAPE_ANNOTATION``) applied.

    The shape only fills what the user left to the planner: a spec with ``tensorParallelSize``
    set, or in CPU mode, is returned unchanged. The reconciler plans the result, so the
    planner stays the one source of the sizing arithmetic.

    Raises:
        SpecError: the annotation is not a JSON object with a positive ``tensorParallelSize``
            and a ``gpuType`` from ``spec.autoscaling.allowedGpuTypes`` (or the spec's own).
    """
    raw = annotations.get(SHAPE_ANNOTATION)
    if raw is None or spec.tensor_parallel_size is not None or spec.gpu is None:
        return spec
    where = f"metadata.annotations[{SHAPE_ANNOTATION}]"
    try:
        shape = json.loads(raw)
        tp, gpu_type = int(shape["tensorParallelSize"]), str(shape["gpuType"])
    except (ValueError, KeyError, TypeError) as error:
        raise SpecError(where, f"not a shape ({error}): {raw!r}") from error
    allowed = {spec.gpu.type, *(spec.autoscaling.allowed_gpu_types if spec.autoscaling else ())}
    if tp < 1 or gpu_type not in allowed:
        raise SpecError(where, f"{raw!r}: GPU type must be one of {sorted(allowed)}, TP >= 1")
    if gpu_type == "custom" and spec.gpu.type != "custom":
        raise SpecError(where, "a custom GPU's memory is unknown: it cannot be a new shape")
    gpu = (
        spec.gpu if gpu_type == spec.gpu.type else replace(spec.gpu, type=gpu_type, memory_gib=None)
    )
    return replace(spec, tensor_parallel_size=tp, gpu=gpu)


@dataclass(frozen=True)
class FleetState:
    """What the cluster looks like now, read by the caller before each decision.

    Attributes:
        replicas: ``spec.replicas`` now.
        ready_replicas: pods ready to serve.
        pending_replicas: pods the scheduler has not placed yet (``PodScheduled`` False).
        starting_replicas: pods placed (``PodScheduled`` True) but not ``Ready`` yet, created
            less than ``starting_hold_seconds(startup_seconds)`` ago: capacity on its way.
        gpus_per_replica: GPUs one replica uses (its tensor parallel size).
        gpus_used_elsewhere: GPUs other ``LLMDeployment``s of the namespace hold, counted
            against ``gpuBudget``.
        tensor_parallel_fixed: the user set ``tensorParallelSize``; never re-planned.
        larger_shape: the planner's next bigger shape (more KV capacity per replica), or None.
        max_num_seqs: the engine's sequence slots per replica (the plan's), or None.
        startup_seconds: how long a new replica takes from being asked for to ready; the
            token rate's rise over that time, and a recurring burst due within it (plus a
            tick), are provisioned ahead (0: unknown; the forecast looks one tick ahead).
        wake_requested_at: time (seconds) of the newest wake request, or None.
        held_requests: requests a router holds for the deployment (no replica ready to take
            them), as reported with that wake request; 0 when none or the report is stale.
        unscraped_replicas: pods whose load the window lacks, so no scale-down follows it:
            ready pods whose metrics could not be read this time (a scrape timed out or
            failed), and pods that were Ready and stopped answering their readiness probe.
    """

    replicas: int
    ready_replicas: int
    pending_replicas: int = 0
    starting_replicas: int = 0
    gpus_per_replica: int = 1
    gpus_used_elsewhere: int = 0
    tensor_parallel_fixed: bool = False
    larger_shape: Shape | None = None
    max_num_seqs: int | None = None
    startup_seconds: float = 0.0
    wake_requested_at: float | None = None
    held_requests: int = 0
    unscraped_replicas: int = 0


@dataclass(frozen=True)
class AutoscalerMemory:
    """What the decision remembers between calls; start from ``AutoscalerMemory()``.

    Attributes:
        recommendations: ``(time, replicas)`` raw recommendations, for stabilization.
        panic_until: panic mode lasts until this time (seconds), or None.
        last_active: last time traffic was seen, or None before the first decision.
        last_scale_time: last time the desired replicas changed, or None.
        last_replan_time: last time a larger shape was chosen, or None.
        replica_tokens_per_second: the most one replica processed (prompt + generated
            tokens/s) while the fleet was saturated: its learned capacity, or None until then.
        first_decision: time of the first decision; until a scale-down stabilization window
            has passed since, replicas are not lowered (after an operator restart the history
            that would justify it is gone).
        demand: the replicas each scrape interval's load needed, downsampled and bounded
            (:class:`~kvpilot.operator.forecast.DemandHistory`), for the burst forecast.
        forecast: the burst forecast and not yet checked, and since when the history counts
            for the forecast (:class:`~kvpilot.operator.forecast.ForecastMemory`).
    """

    recommendations: tuple[tuple[float, int], ...] = ()
    panic_until: float | None = None
    last_active: float | None = None
    last_scale_time: float | None = None
    last_replan_time: float | None = None
    replica_tokens_per_second: float | None = None
    first_decision: float | None = None
    demand: DemandHistory = field(default_factory=DemandHistory)
    forecast: ForecastMemory = field(default_factory=ForecastMemory)


@dataclass(frozen=True)
class Decision:
    """The outcome of :func:`decide`.

    Attributes:
        desired_replicas: what ``spec.replicas`` should be.
        reason: CamelCase reason for status and the Event (``ScaleUp``, ``ScaleDown``,
            ``Panic``, ``Stable``, ``PendingPods``, ``StartingPods``, ``ScaleToZero``,
            ``WakeFromZero``, ``HeldRequests``, ``Idle``, ``NoMetrics``, ``BelowMinimum``,
            ``AboveMaximum``, ``GPUBudget``, ``LongContext``, ``PredictedBurst``, ``BurstEndsFirst``,
            ``Unscraped``).
        message: one human sentence with the numbers behind the reason.
        signals: the stable window's signals, or None without metrics.
        replan: the larger shape to roll out instead of adding replicas, or None.
        memory: what to pass to the next call.
    """

    desired_replicas: int
    reason: str
    message: str
    signals: Signals | None
    replan: Shape | None = None
    memory: AutoscalerMemory = field(default_factory=AutoscalerMemory)


def replicas_for_load(
    signals: Signals,
    policy: AutoscalingPolicy,
    ready_replicas: int,
    max_num_seqs: int | None = None,
    replica_tokens_per_second: float | None = None,
    rising_tokens_per_second: float = 0.0,
) -> int:
    """Replicas the load in ``signals`` needs (rule 1 of the module docstring).

    Args:
        signals: one window's signals.
        policy: targets.
        ready_replicas: replicas that produced the signals.
        max_num_seqs: the engine's sequence slots per replica, when known: running requests
            over the slots is a second load in replica units, the one that binds when short
            requests fill the slots before the KV cache.
        replica_tokens_per_second: a replica's learned capacity, when known: the fleet's
            token rate over it is a third load in replica units, the one that stays honest
            when fewer replicas would each batch more (KV and slot use grow faster than the
            load as a replica nears saturation, so they alone would scale down too far).
        rising_tokens_per_second: how much the token rate will have grown by the time a new
            replica is ready; added to the token load.

    Returns:
        Replicas, >= 0; 0 only when the window saw no load at all.
    """
    target = policy.target_kv_cache_usage
    tolerated = policy.target_waiting_requests * max(ready_replicas, 1)
    excess = max(0.0, signals.num_requests_waiting - tolerated)
    share = signals.kv_share_per_request
    if excess > 0 and share is None:
        # Requests wait yet nothing runs: their size is unknown, so ask for one more replica.
        return max(math.ceil(signals.kv_load / target), ready_replicas + 1)
    demand = signals.kv_load + excess * (share or 0.0)
    if max_num_seqs:
        demand = max(demand, (signals.num_requests_running + excess) / max_num_seqs)
    if replica_tokens_per_second:
        tokens = signals.tokens_per_second + rising_tokens_per_second
        demand = max(demand, tokens / replica_tokens_per_second)
    by_load = math.ceil(demand / target - 1e-9)
    if excess == 0 or max_num_seqs:
        return by_load
    # Slots unknown: run the waiting requests at today's per-replica concurrency.
    per_replica = signals.num_requests_running / max(signals.num_pods, 1.0)
    return max(by_load, math.ceil((signals.num_requests_running + excess) / per_replica - 1e-9))


def _rise(samples: Sequence[MetricSample], policy: AutoscalingPolicy, now: float) -> float:
    """How fast the token rate grows, tokens/s per second, from the stable window's two halves
    (0 when it falls or either half has too few rounds for a rate)."""
    half = policy.stable_window_seconds / 2
    early = summarize(samples, start=now - 2 * half, end=now - half)
    late = summarize(samples, start=now - half)
    if early is None or late is None or early.num_rounds < 2 or late.num_rounds < 2:
        return 0.0
    return max(0.0, (late.tokens_per_second - early.tokens_per_second) / half)


def _latest_interval(samples: Sequence[MetricSample], now: float) -> Signals | None:
    """The signals of the last two scrape rounds up to ``now``: the load as it is now, which
    the demand history records (the stable window would lag a burst by its length)."""
    rounds = sorted({s.timestamp for s in samples if s.timestamp <= now})
    return summarize(samples, start=rounds[-2], end=now + 1e-9) if len(rounds) >= 2 else None


def is_saturated(signals: Signals, policy: AutoscalingPolicy, max_num_seqs: int | None) -> bool:
    """Whether the window's replicas ran at capacity: requests waiting beyond the target, the
    KV cache at ``SATURATED_KV`` or more, or every sequence slot taken. Their token rate is
    then what a replica can do."""
    pods = max(signals.num_pods, 1.0)
    return (
        signals.num_requests_waiting > policy.target_waiting_requests * pods
        or signals.kv_cache_usage >= SATURATED_KV
        or (max_num_seqs is not None and signals.num_requests_running >= max_num_seqs * pods)
    )


def is_long_context(signals: Signals, policy: AutoscalingPolicy) -> bool:
    """Whether the pressure in ``signals`` comes from long contexts (rule 8).

    True when the KV cache is above target, requests wait or get preempted, and a running
    request holds on average at least ``LONG_CONTEXT_SHARE`` of a replica's KV cache.
    """
    share = signals.kv_share_per_request
    return (
        share is not None
        and share >= LONG_CONTEXT_SHARE
        and signals.kv_cache_usage >= policy.target_kv_cache_usage
        and (signals.num_requests_waiting > 0 or signals.preemptions_per_second > 0)
    )


@dataclass(frozen=True)
class _Moment:
    """What one decision sees: its inputs and the load estimates derived from them.

    ``stable`` is None without metrics (then only ``woken`` and ``last_active`` are set).
    ``raw``, ``panic_raw`` and ``load_now`` are the replicas the stable window, the panic
    window and the last scrape interval ask for; ``observed`` the last one, capped at
    ``maxReplicas``; ``predicted`` the forecast's replicas (0 without a prediction).
    """

    policy: AutoscalingPolicy
    fleet: FleetState
    now: float
    woken: bool
    last_active: float
    first_decision: float
    stable: Signals | None = None
    panic: Signals | None = None
    raw: int = 0
    panic_raw: int = 0
    load_now: int = 0
    observed: int = 0
    prediction: Prediction | None = None
    predicted: int = 0


@dataclass(frozen=True)
class _Verdict:
    """A decision in the making: each rule takes one and returns one."""

    desired: int
    reason: str
    message: str
    memory: AutoscalerMemory
    replan: Shape | None = None


def decide(
    samples: Sequence[MetricSample],
    policy: AutoscalingPolicy,
    fleet: FleetState,
    memory: AutoscalerMemory,
    now: float,
) -> Decision:
    """Decide the desired replicas from a window of metric samples.

    The rules of docs/autoscaling.md, in order: activity and wake requests
    (:func:`_activity`); without metrics, the zero and minimum rules
    (:func:`_without_metrics`); else the load estimates (:func:`_estimates`), the reactive
    recommendation with panic mode and stabilization (:func:`_reactive`), then each of
    ``RULES`` in turn, and the bounds and GPU budget (:func:`_finish`).

    Args:
        samples: the ready pods' samples of at least the last ``stable_window_seconds``
            (older ones are ignored), timestamps in seconds on the same clock as ``now``.
        policy: the ``spec.autoscaling`` knobs.
        fleet: the cluster as it is now.
        memory: the previous decision's ``memory`` (``AutoscalerMemory()`` the first time).
        now: the current time, seconds.

    Returns:
        The decision; its ``memory`` goes into the next call.
    """
    moment, memory = _activity(samples, policy, fleet, memory, now)
    if fleet.replicas == 0 or moment.stable is None or fleet.ready_replicas == 0:
        desired, reason, message = _without_metrics(policy, fleet, moment.woken)
        return _finish(moment, _Verdict(desired, reason, message, memory))
    moment, memory = _estimates(samples, moment, memory)
    verdict = _reactive(moment, memory)
    for rule in RULES:
        verdict = rule(moment, verdict)
    return _finish(moment, verdict)


def _activity(
    samples: Sequence[MetricSample],
    policy: AutoscalingPolicy,
    fleet: FleetState,
    memory: AutoscalerMemory,
    now: float,
) -> tuple[_Moment, AutoscalerMemory]:
    """The windows' signals, the last time of activity and whether a wake request is new."""
    stable = summarize(samples, start=now - policy.stable_window_seconds)
    panic = summarize(samples, start=now - policy.panic_window_seconds)
    last_active = memory.last_active if memory.last_active is not None else now
    if panic is not None and panic.active:
        last_active = now
    if fleet.replicas > 0 and (stable is None or fleet.ready_replicas == 0):
        # A fleet no client can reach yet (its pods still loading the model) is not idle:
        # idleSeconds runs from its first report, however long the start took.
        last_active = now
    woken = fleet.wake_requested_at is not None and (
        fleet.wake_requested_at + WAKE_STAMP_RESOLUTION_SECONDS
        > (memory.last_scale_time if memory.last_scale_time is not None else -math.inf)
    )
    if woken:  # a wake request is activity at its own time (renewals while requests wait)
        last_active = max(last_active, min(fleet.wake_requested_at, now))
    first = memory.first_decision if memory.first_decision is not None else now
    memory = replace(memory, last_active=last_active, first_decision=first)
    moment = _Moment(policy, fleet, now, woken, last_active, first, stable, panic)
    return moment, memory


def _estimates(
    samples: Sequence[MetricSample], moment: _Moment, memory: AutoscalerMemory
) -> tuple[_Moment, AutoscalerMemory]:
    """Rules 1-3 and 9's inputs: the learned replica capacity, the replicas each window asks
    for, the demand history and the recurring-burst forecast."""
    policy, fleet, now, stable, panic = (
        moment.policy, moment.fleet, moment.now, moment.stable, moment.panic,
    )  # fmt: skip
    assert stable is not None
    if stable.num_rounds >= 2 and is_saturated(stable, policy, fleet.max_num_seqs):
        # The highest saturated rate: a window that saturated only part of the time, or with
        # pods that had just started, understates what a replica can do.
        observed = stable.tokens_per_second / max(stable.num_pods, 1.0)
        if observed > (memory.replica_tokens_per_second or 0.0):
            memory = replace(memory, replica_tokens_per_second=observed)
    capacity = memory.replica_tokens_per_second
    rising = _rise(samples, policy, now) * fleet.startup_seconds
    raw = replicas_for_load(
        stable, policy, fleet.ready_replicas, fleet.max_num_seqs, capacity, rising
    )
    panic_raw = (
        replicas_for_load(panic, policy, fleet.ready_replicas, fleet.max_num_seqs, capacity, rising)
        if panic
        else raw
    )
    load_now = replicas_for_load(
        _latest_interval(samples, now) or stable,
        policy,
        fleet.ready_replicas,
        fleet.max_num_seqs,
        capacity,
    )
    observed = min(load_now, policy.max_replicas)
    memory = replace(memory, demand=memory.demand.record(now, observed))
    prediction = None
    if policy.predictive_scaling:
        prediction, forecast = verified_predict(
            memory.demand, memory.forecast, now, fleet.startup_seconds + BUCKET_SECONDS
        )
        memory = replace(memory, forecast=forecast)
    predicted = math.ceil(prediction.replicas - 1e-9) if prediction else 0
    moment = replace(
        moment,
        raw=raw,
        panic_raw=panic_raw,
        load_now=load_now,
        observed=observed,
        prediction=prediction,
        predicted=predicted,
    )
    return moment, memory


def _reactive(moment: _Moment, memory: AutoscalerMemory) -> _Verdict:
    """Rules 2-4: panic mode (the short window asks for ``PANIC_THRESHOLD`` x the ready
    replicas), else the stable window's recommendation stabilized up and down (the forecast,
    when there is one, stands in for the scale-down stabilization), and the capacity probe."""
    policy, fleet, now = moment.policy, moment.fleet, moment.now
    raw, panic_raw, stable = moment.raw, moment.panic_raw, moment.stable
    assert stable is not None
    panicking = memory.panic_until is not None and now < memory.panic_until
    if panic_raw >= PANIC_THRESHOLD * fleet.ready_replicas:
        memory = replace(memory, panic_until=now + policy.stable_window_seconds)
        panicking = True

    horizon = now - max(
        policy.scale_up_stabilization_seconds, policy.scale_down_stabilization_seconds
    )
    history = tuple((t, r) for t, r in memory.recommendations if t >= horizon) + ((now, raw),)
    memory = replace(memory, recommendations=history)

    current = fleet.replicas
    if panicking:
        desired = max(current, raw, panic_raw)
        message = f"panic: the last {policy.panic_window_seconds:g}s ask for {panic_raw} replicas"
        return _Verdict(desired, "Panic", message, memory)
    up = min(r for t, r in history if t >= now - policy.scale_up_stabilization_seconds)
    if moment.prediction is None:
        down = max(r for t, r in history if t >= now - policy.scale_down_stabilization_seconds)
    else:
        # The forecast covers what stabilization guards against (load that comes back
        # before a new pod could start), so scale down to the load of the last interval.
        down = max(up, moment.load_now, moment.predicted)
    if now - moment.first_decision < policy.scale_down_stabilization_seconds:
        down = max(down, current)
    if memory.replica_tokens_per_second is None:
        # Capacity not learned yet: KV and slot use understate what fewer replicas would
        # carry, so probe down one replica per stable window until a saturation teaches it.
        recent = memory.last_scale_time is not None and (
            now - memory.last_scale_time < policy.stable_window_seconds
        )
        down = max(down, current if recent else current - 1)
    desired = min(max(current, up), down)
    reason = "ScaleUp" if desired > current else "ScaleDown" if desired < current else "Stable"
    message = (
        f"KV load {stable.kv_load:.2f} replicas at target {policy.target_kv_cache_usage:g}, "
        f"{stable.num_requests_waiting:.1f} waiting: {raw} replicas needed"
    )
    if moment.prediction is not None:
        message += (
            f"; recurring bursts every {moment.prediction.period_seconds:.0f}s: "
            f"{moment.predicted} replicas forecast for the next "
            f"{fleet.startup_seconds + BUCKET_SECONDS:.0f}s"
        )
    return _Verdict(desired, reason, message, memory)


def _rate_limits(moment: _Moment, verdict: _Verdict) -> _Verdict:
    """Rule 4: at most ``maxScaleUpRate`` x up and ``1 / maxScaleDownRate`` down per decision."""
    policy, current = moment.policy, moment.fleet.replicas
    desired, message = verdict.desired, verdict.message
    up_limit = math.ceil(policy.max_scale_up_rate * max(current, 1))
    down_limit = math.floor(current / policy.max_scale_down_rate)
    if desired > up_limit:
        desired = up_limit
        message += f", limited to {up_limit} by maxScaleUpRate"
    if desired < down_limit:
        desired = down_limit
        message += f", limited to {down_limit} by maxScaleDownRate"
    return replace(verdict, desired=desired, message=message)


def _burst_ends_first(moment: _Moment, verdict: _Verdict) -> _Verdict:
    """Rule 9 (``BurstEndsFirst``): a reactive scale-up whose pods would be ready only after a
    predicted burst ends is held at the forecast for that time."""
    fleet, current = moment.fleet, moment.fleet.replicas
    if moment.prediction is None or verdict.desired <= current:
        return verdict
    ceiling = burst_ceiling(
        verdict.memory.demand,
        moment.prediction.period_seconds,
        moment.now,
        fleet.startup_seconds,
        moment.observed,
    )
    limit = max(current, math.ceil(ceiling - 1e-9)) if ceiling is not None else verdict.desired
    if verdict.desired <= limit:
        return verdict
    # Pods asked for now would be ready after the burst they were asked for.
    message = verdict.message + (
        f"; holding at {limit}: the predicted burst ends before new pods are ready "
        f"(in {fleet.startup_seconds:.0f}s)"
    )
    return replace(verdict, desired=limit, reason="BurstEndsFirst", message=message)


def _predicted_burst(moment: _Moment, verdict: _Verdict) -> _Verdict:
    """Rule 9 (``PredictedBurst``): the forecast's replicas, asked for a start-up time ahead.

    Not rate-limited: the limits damp a reaction to a noisy window, and a pod asked for later
    than now is not ready for the burst."""
    prediction = moment.prediction
    if prediction is None or moment.predicted <= verdict.desired:
        return verdict
    message = (
        f"predicted recurring burst in {prediction.eta_seconds:.0f}s "
        f"(period {prediction.period_seconds:.0f}s): {moment.predicted} replicas"
    )
    return replace(verdict, desired=moment.predicted, reason="PredictedBurst", message=message)


def _keep_one(moment: _Moment, verdict: _Verdict) -> _Verdict:
    """Only the idle rule may take the last replica away."""
    return replace(verdict, desired=max(verdict.desired, 1))


def _hold_for_pods(moment: _Moment, verdict: _Verdict) -> _Verdict:
    """Rule 5: pods still starting hold reactive scale-ups (not the forecast's: those pods were
    asked for the same burst); unschedulable pods hold every scale-up (more would only wait)."""
    hold = _scale_up_hold(moment.fleet)
    if hold is None:
        return verdict
    held_reason, why = hold
    current = moment.fleet.replicas
    limit = current if held_reason == "PendingPods" else max(current, moment.predicted)
    if verdict.desired <= limit:
        return verdict
    message = verdict.message + f"; holding at {limit}: {why}"
    return replace(verdict, desired=limit, reason=held_reason, message=message)


def _scale_to_zero(moment: _Moment, verdict: _Verdict) -> _Verdict:
    """Rule 6: no traffic (nor wake request) for ``idleSeconds`` with ``minReplicas`` 0: zero
    replicas."""
    policy, now, panic = moment.policy, moment.now, moment.panic
    if (
        policy.min_replicas == 0
        and now - moment.last_active >= policy.idle_seconds
        and not (panic and panic.active)
    ):
        idle = now - moment.last_active
        message = f"no traffic for {idle:.0f}s (idleSeconds {policy.idle_seconds:g})"
        return replace(verdict, desired=0, reason="ScaleToZero", message=message)
    return verdict


def _long_context(moment: _Moment, verdict: _Verdict) -> _Verdict:
    """Rule 8: a scale-up driven by long contexts becomes a larger shape when one fits."""
    assert moment.stable is not None
    if verdict.desired <= moment.fleet.replicas or not is_long_context(
        moment.stable, moment.policy
    ):
        return verdict
    replan, desired, reason, message, memory = _bigger_not_more(
        moment.stable,
        moment.policy,
        moment.fleet,
        verdict.memory,
        moment.now,
        verdict.desired,
        verdict.reason,
        verdict.message,
    )
    return _Verdict(desired, reason, message, memory, replan)


def _hold_for_unscraped(moment: _Moment, verdict: _Verdict) -> _Verdict:
    """Rule 10: no scale-down (nor to zero) while a ready pod's metrics are missing: its load
    is not in the window (a busy engine can miss a scrape timeout), so the window
    understates the fleet's load."""
    fleet = moment.fleet
    if fleet.unscraped_replicas == 0 or verdict.desired >= fleet.replicas:
        return verdict
    why = f"{fleet.unscraped_replicas} serving pods not scraped"
    message = verdict.message + f"; holding at {fleet.replicas}: {why}"
    return replace(verdict, desired=fleet.replicas, reason="Unscraped", message=message)


RULES = (
    _rate_limits,
    _burst_ends_first,
    _predicted_burst,
    _keep_one,
    _hold_for_pods,
    _scale_to_zero,
    _long_context,
    _hold_for_unscraped,
)
"""The rules after the reactive recommendation, in the order they apply (docs/autoscaling.md)."""


def _scale_up_hold(fleet: FleetState) -> tuple[str, str] | None:
    """Rule 5: why a scale-up waits, as (reason, what holds it), or None when nothing does.
    Unschedulable pods come first: starting ones will be Ready, those may never be."""
    if fleet.pending_replicas > 0:
        return "PendingPods", f"{fleet.pending_replicas} pods not scheduled yet"
    if fleet.starting_replicas > 0:
        bound = starting_hold_seconds(fleet.startup_seconds)
        return "StartingPods", f"{fleet.starting_replicas} pods still starting (up to {bound:.0f}s)"
    return None


def _without_metrics(
    policy: AutoscalingPolicy, fleet: FleetState, woken: bool
) -> tuple[int, str, str]:
    """(replicas, reason, message) at zero replicas or before any pod reported (rule 6)."""
    held = replicas_for_held(fleet) if woken else 0
    held_note = f" for {fleet.held_requests} held requests" if held > 1 else ""
    if fleet.replicas == 0:
        if woken:
            target = max(1, policy.min_replicas, held)
            return target, "WakeFromZero", f"wake requested: starting {target} replicas{held_note}"
        if policy.min_replicas == 0:
            return 0, "Idle", "scaled to zero; waiting for a wake request"
        return policy.min_replicas, "BelowMinimum", "below minReplicas"
    if held > fleet.replicas and fleet.ready_replicas == 0 and fleet.pending_replicas == 0:
        return held, "HeldRequests", f"no pod ready yet; {held} replicas{held_note}"
    return fleet.replicas, "NoMetrics", "no ready pod reported metrics yet; holding"


def replicas_for_held(fleet: FleetState) -> int:
    """The replicas whose sequence slots (``max_num_seqs`` each; one without a plan) take
    every request a router holds at once: ``ceil(held_requests / max_num_seqs)``."""
    return math.ceil(fleet.held_requests / max(fleet.max_num_seqs or 1, 1))


def _bigger_not_more(
    stable: Signals,
    policy: AutoscalingPolicy,
    fleet: FleetState,
    memory: AutoscalerMemory,
    now: float,
    desired: int,
    reason: str,
    message: str,
) -> tuple[Shape | None, int, str, str, AutoscalerMemory]:
    """Rule 8: trade the scale-up for a larger shape when the pressure is long contexts."""
    share = stable.kv_share_per_request or 0.0
    context = f"long contexts: a running request holds {share:.0%} of a replica's KV cache"
    if fleet.tensor_parallel_fixed:
        return None, desired, reason, f"{message}; {context}, but tensorParallelSize is set", memory
    shape = fleet.larger_shape
    if shape is None:
        return None, desired, reason, f"{message}; {context}, but no larger shape fits", memory
    cooling = (
        memory.last_replan_time is not None
        and now - memory.last_replan_time < policy.stable_window_seconds
    )
    budget_left = _gpus_available(policy, fleet)
    if cooling or (budget_left is not None and budget_left < shape.tensor_parallel_size):
        return None, desired, reason, f"{message}; {context}, waiting for the last re-plan", memory
    replicas = fleet.replicas
    if budget_left is not None:
        replicas = max(1, min(replicas, budget_left // shape.tensor_parallel_size))
    message = (
        f"{context}: re-planning to tensorParallelSize {shape.tensor_parallel_size} on "
        f"{shape.gpu_type} ({shape.kv_cache_capacity_tokens} KV tokens per replica) "
        f"instead of {desired} replicas"
    )
    return shape, replicas, "LongContext", message, replace(memory, last_replan_time=now)


def _gpus_available(policy: AutoscalingPolicy, fleet: FleetState) -> int | None:
    """GPUs this deployment may hold under the namespace budget, or None without a budget."""
    if policy.gpu_budget is None:
        return None
    return max(0, policy.gpu_budget - fleet.gpus_used_elsewhere)


def _finish(moment: _Moment, verdict: _Verdict) -> Decision:
    """Rule 7: the bounds and the GPU budget; and the scale time stamped."""
    policy, fleet = moment.policy, moment.fleet
    desired, reason, message = verdict.desired, verdict.reason, verdict.message
    replan, memory = verdict.replan, verdict.memory
    if desired < policy.min_replicas:
        desired, reason = policy.min_replicas, "BelowMinimum"
        message += f"; raised to minReplicas {policy.min_replicas}"
    if desired > policy.max_replicas:
        desired, reason = policy.max_replicas, "AboveMaximum"
        message += f"; capped at maxReplicas {policy.max_replicas}"
    available = _gpus_available(policy, fleet)
    gpus = replan.tensor_parallel_size if replan else fleet.gpus_per_replica
    if available is not None and desired * gpus > available:
        desired, reason = available // gpus, "GPUBudget"
        message += f"; capped at {desired} by gpuBudget ({available} GPUs left)"
    if desired != fleet.replicas or replan is not None:
        memory = replace(memory, last_scale_time=moment.now)
    return Decision(desired, reason, message, moment.stable, replan, memory)
