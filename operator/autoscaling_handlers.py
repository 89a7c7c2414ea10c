"""The autoscaling loop: every ``interval`` seconds, for each LLMDeployment, observe, decide,
write.

For each LLMDeployment with ``spec.autoscaling.mode: kvpilot``, one tick
(:meth:`AutoscalingLoop.tick`, run by :mod:`kvpilot.operator.periodic`):

1. observe (:meth:`AutoscalingLoop.observe`, the only part that reads the API and the pods):
   the spec planned with the reconciler's own function (:func:`kvpilot.operator.handlers.plan_deployment`,
   with the autoscaler's chosen shape), the engine pods (label ``kvpilot.dev/llmdeployment``),
   the ready ones' metrics (:mod:`kvpilot.operator.scraper`; a Prometheus server instead when
   configured), the GPUs the namespace's other LLMDeployments hold, and the model for a larger
   shape;
2. decide (:func:`plan_writes`, pure): :func:`kvpilot.operator.autoscaler.decide` over the
   object's window of samples, live tuning (:func:`tuning_step`), and the writes that follow:
   ``spec.replicas`` through the ``scale`` subresource when it changes, a larger shape in
   ``kvpilot.dev/shape`` when the decision says "bigger, not more", the tuning rollout in
   ``kvpilot.dev/engine-tuning``, the autoscaler's status fields (``desiredReplicas``,
   ``lastScaleTime``, ``lastDecision``, ``kvCacheUsage``, ``recommendations``) only when they
   changed, and an Event per scaling decision and tuning phase;
3. execute (:meth:`AutoscalingLoop.execute`): those writes, through the same client and
   event sink as the reconciler.

``mode: external`` objects are never touched: HPA, KEDA or ``kubectl scale`` own the replicas.

Waking from zero: ``kubectl annotate llmd NAME kvpilot.dev/wake="$(date +%s)" --overwrite``
(any client with ``patch`` on llmdeployments can do it; docs/autoscaling.md shows an activator
pattern). A change of that annotation wakes the deployment at once; every tick honours it too.

The window and the decision memory live in the loop object, per LLMDeployment. An operator
restart starts them afresh except for the learned replica capacity, read back from
``status.lastDecision``; the first scale-down then waits a full stabilization window.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import time
import urllib.parse
from typing import Any

import kopf

from kvpilot.engine.model_shape import ModelShape
from kvpilot.operator import manifests
from kvpilot.operator.apply import KubeClient, status_changed
from kvpilot.operator.autoscaler import (
    SHAPE_ANNOTATION,
    AutoscalerMemory,
    AutoscalingPolicy,
    Decision,
    FleetState,
    Shape,
    decide,
    starting_hold_seconds,
)
from kvpilot.operator.conditions import format_time
from kvpilot.operator.events import Event
from kvpilot.operator.gpus import CUSTOM, gpu_type
from kvpilot.operator.handlers import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    PlanOutcome,
    Runtime,
    plan_deployment,
)
from kvpilot.operator.planner import Plan, PlanError, plan_for_spec
from kvpilot.operator.pods import stalled, starting_pods, startup_seconds, unschedulable
from kvpilot.operator.scraper import (
    AddressMap,
    PodTarget,
    PrometheusSource,
    ScrapeResult,
    ready_targets,
)
from kvpilot.operator.scraper import scrape_pods as scrape_direct
from kvpilot.operator.signals import MetricSample
from kvpilot.operator.spec import LLMDeploymentSpec, ModelSource
from kvpilot.operator.tuning import (
    CANARY_LABEL,
    TUNING_ANNOTATION,
    EngineSettings,
    Rollout,
    next_rollout,
    observe,
    recommend,
)
from kvpilot.operator.window import TimeWindow

CANARY_WINDOWS = 2
"""A tuning canary runs this many stable windows before it is judged."""

WAKE_ANNOTATION = "kvpilot.dev/wake"
"""Set it to the current time (Unix seconds or RFC 3339) to wake a deployment from zero."""

HELD_REQUESTS_ANNOTATION = "kvpilot.dev/held-requests"
"""Requests a router holds for the deployment, written with a fresh wake time (the router's
``report_held``): demand for the autoscaler while no replica is ready to take them."""

HELD_REQUESTS_TTL_S = 60.0
"""A held count is current while its wake time is at most this old (s): the router renews it
every few seconds while requests wait, so an older one is from a router that is gone."""

logger = logging.getLogger("kvpilot.operator.autoscaling")


@dataclasses.dataclass(frozen=True)
class AutoscalerConfig:
    """Operator-wide settings of the autoscaling loop.

    Attributes:
        interval: seconds between decisions for each LLMDeployment.
        scrape_timeout: seconds allowed per pod scrape (or per Prometheus query).
        prometheus_url: read metrics from this Prometheus instead of the pods, or None.

    The engine image and the model config cache are the reconciler's (``Runtime``).
    """

    interval: float = 15.0
    scrape_timeout: float = 2.0
    prometheus_url: str | None = None


@dataclasses.dataclass
class ObjectState:
    """What the loop keeps per LLMDeployment between ticks (in ``AutoscalingLoop.states``)."""

    window: TimeWindow
    memory: AutoscalerMemory = dataclasses.field(default_factory=AutoscalerMemory)
    # The timer and the wake handler may fire together; one tick at a time per object.
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)


def wake_time(annotations: dict[str, str]) -> float | None:
    """The time (Unix seconds) of the wake request in ``annotations``, or None.

    Accepts Unix seconds (``date +%s``) or RFC 3339 with a zone (``date -u +%FT%TZ``). Anything
    else is logged and ignored: a request without a time could never be told from an old one.
    """
    raw = annotations.get(WAKE_ANNOTATION)
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        pass
    try:
        moment = datetime.datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        logger.warning("ignoring %s=%r: not Unix seconds or RFC 3339 time", WAKE_ANNOTATION, raw)
        return None
    return moment.timestamp()


def held_requests(annotations: dict[str, str], now: float) -> int:
    """The requests a router reports holding (``kvpilot.dev/held-requests``), 0 when absent,
    not a whole number >= 0 (logged), or older than ``HELD_REQUESTS_TTL_S`` by the wake time
    on the same clock as ``now`` (Unix seconds)."""
    raw, at = annotations.get(HELD_REQUESTS_ANNOTATION), wake_time(annotations)
    if raw is None or at is None or now - at > HELD_REQUESTS_TTL_S:
        return 0
    try:
        held = int(raw)
    except ValueError:
        held = -1
    if held < 0:
        logger.warning("ignoring %s=%r: not a count", HELD_REQUESTS_ANNOTATION, raw)
        return 0
    return held


def larger_shape(
    spec: LLMDeploymentSpec, plan: Plan, model: ModelShape, allowed_gpu_types: tuple[str, ...]
) -> Shape | None:
    """The next shape with more KV cache per replica, as the planner sizes it, or None.

    First a larger tensor parallel size on the same GPU type, then the smallest-memory allowed
    GPU type with more memory per GPU than the current one. Never for a user-set
    ``tensorParallelSize`` or CPU mode.
    """
    if spec.tensor_parallel_size is not None or spec.gpu is None:
        return None
    gpu = spec.gpu.gpu_type()
    for tp in range(plan.tensor_parallel_size + 1, gpu.per_node + 1):
        bigger = _plan_or_none(dataclasses.replace(spec, tensor_parallel_size=tp), model)
        if bigger is not None and bigger.kv_capacity_tokens > plan.kv_capacity_tokens:
            return Shape(tp, gpu.name, bigger.kv_capacity_tokens)
    candidates = sorted(
        (gpu_type(name) for name in allowed_gpu_types if name != CUSTOM),
        key=lambda candidate: candidate.memory_bytes,
    )
    for candidate in candidates:
        if candidate.memory_bytes <= gpu.memory_bytes:
            continue
        moved = dataclasses.replace(
            spec, gpu=dataclasses.replace(spec.gpu, type=candidate.name, memory_gib=None)
        )
        bigger = _plan_or_none(moved, model)
        if bigger is not None and bigger.kv_capacity_tokens > plan.kv_capacity_tokens:
            return Shape(bigger.tensor_parallel_size, candidate.name, bigger.kv_capacity_tokens)
    return None


def _plan_or_none(spec: LLMDeploymentSpec, model: ModelShape) -> Plan | None:
    """The plan of ``spec``, or None when it has none or is pipelined (a ``Shape`` moves the
    tensor parallel size and the GPU type, not a pipeline)."""
    try:
        plan = plan_for_spec(spec, model)
    except PlanError:
        return None
    return plan if plan.pipeline_parallel_size == 1 else None


def remembered(body: dict[str, Any]) -> AutoscalerMemory:
    """A fresh memory that keeps what a previous operator learned and wrote to status: the
    replica capacity (``status.lastDecision.replicaTokensPerSecond``)."""
    last = (body.get("status") or {}).get("lastDecision") or {}
    capacity = last.get("replicaTokensPerSecond")
    valid = isinstance(capacity, int | float) and capacity > 0
    return AutoscalerMemory(replica_tokens_per_second=float(capacity) if valid else None)


@dataclasses.dataclass(frozen=True)
class TuningStep:
    """What live tuning concluded this tick: ``status.recommendations``, the rollout to record
    in the ``TUNING_ANNOTATION`` annotation, and whether that changed."""

    status: dict[str, Any]
    rollout: Rollout | None = None
    changed: bool = False


def tuning_step(
    annotations: dict[str, str],
    pods: list[dict[str, Any]],
    window: list[MetricSample],
    plan: Plan,
    *,
    apply: bool,
    now: float,
    canary_seconds: float,
    allow_kv_cache_dtype: bool = False,
) -> TuningStep:
    """Recommend engine settings from the window and, with ``apply`` (``tuneEngine``), move the
    rollout along (:func:`kvpilot.operator.tuning.next_rollout`), judging the canary pod
    (label ``CANARY_LABEL``) against the others over the canary's time.
    ``allow_kv_cache_dtype`` (``allowKvCacheDtype``) lets the recommendation switch the KV
    cache to fp8."""
    if plan.gpu_memory_utilization is None:
        return TuningStep({"reason": "CPU mode: no GPU memory to tune"})
    try:
        raw = annotations.get(TUNING_ANNOTATION)
        current = Rollout.from_annotation(raw) if raw else None
    except ValueError as error:
        logger.warning("ignoring a malformed tuning annotation: %s", error)
        current = None
    canaries = {
        p["metadata"]["name"]
        for p in pods
        if (p["metadata"].get("labels") or {}).get(CANARY_LABEL) == "true"
    }
    baseline = [s for s in window if s.pod not in canaries]
    observed = observe(baseline)
    if observed is None:
        return TuningStep({"reason": "no metrics yet"}, current)
    plan_settings = EngineSettings(
        plan.gpu_memory_utilization, plan.max_num_seqs, plan.kv_cache_dtype
    )
    in_force = (current.in_force() if current else None) or plan_settings
    recommendation = recommend(in_force, observed, allow_kv_cache_dtype=allow_kv_cache_dtype)
    status: dict[str, Any] = {**recommendation.settings.as_dict(), "reason": recommendation.reason}
    if not apply:
        return TuningStep(status, current)
    since = current.started if current else None
    judged = [s for s in window if s.pod in canaries]
    new = next_rollout(
        current,
        recommendation,
        plan_settings,
        observe(baseline, start=since),
        observe(judged, start=since),
        now,
        canary_seconds=canary_seconds,
    )
    if new is not None:
        status["rollout"] = {"phase": new.phase, "reason": new.reason}
    return TuningStep(status, new, new is not current)


def without_nulls(value: Any) -> Any:
    """``value`` as the API server stores it after a JSON merge patch: keys whose value is null
    are removed, at every depth."""
    if isinstance(value, dict):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    return value


def decision_status(
    decision: Decision, previous: dict[str, Any], now: datetime.datetime
) -> dict[str, Any]:
    """The ``status`` fields the autoscaler owns, for ``decision`` made at ``now``.

    ``lastDecision.time`` stays ``previous``'s when the rest of the decision (signals included)
    is the same: it is when this decision was first made, so an unchanged decision changes no
    field and needs no write.
    """
    signals = decision.signals
    status: dict[str, Any] = {
        "desiredReplicas": decision.desired_replicas,
        "lastDecision": {
            "replicas": decision.desired_replicas,
            "reason": decision.reason,
            "message": decision.message,
            "signals": signals.as_dict() if signals else None,
            "replicaTokensPerSecond": decision.memory.replica_tokens_per_second,
            "replan": (
                {
                    "tensorParallelSize": decision.replan.tensor_parallel_size,
                    "gpuType": decision.replan.gpu_type,
                    "kvCacheCapacityTokens": decision.replan.kv_cache_capacity_tokens,
                }
                if decision.replan
                else None
            ),
        },
    }
    before = dict(previous.get("lastDecision") or {})
    made = before.pop("time", None)
    if made is None or without_nulls(before) != without_nulls(status["lastDecision"]):
        made = format_time(now)
    status["lastDecision"] = {"time": made, **status["lastDecision"]}
    if signals is not None:
        status["kvCacheUsage"] = round(signals.kv_cache_usage, 4)
    changed = decision.desired_replicas != previous.get("desiredReplicas") or decision.replan
    status["lastScaleTime"] = format_time(now) if changed else previous.get("lastScaleTime")
    return status


@dataclasses.dataclass(frozen=True)
class Observation:
    """What one tick read about an LLMDeployment, before deciding anything.

    Attributes:
        body: the LLMDeployment as read.
        planned: its spec planned as the reconciler plans it.
        pods: its engine pods.
        samples: metric samples scraped from the ready ones.
        replicas: ``spec.replicas`` now.
        gpus_elsewhere: GPUs the namespace's other LLMDeployments hold.
        larger_shape: the next larger replica shape, or None.
        now: when the samples were taken (Unix seconds).
        unscraped: ready pods whose scrape failed this tick (stalled pods are counted apart).
    """

    body: dict[str, Any]
    planned: PlanOutcome
    pods: list[dict[str, Any]]
    samples: list[MetricSample]
    replicas: int
    gpus_elsewhere: int
    larger_shape: Shape | None
    now: float
    unscraped: int = 0


@dataclasses.dataclass(frozen=True)
class Writes:
    """What a tick decided to write (empty fields: nothing to write).

    Attributes:
        decision: the scaling decision.
        replicas: ``spec.replicas`` to set through the scale subresource, or None.
        annotations: annotations to merge into the object's metadata.
        status: status fields to merge, or None when they are unchanged.
        events: Events to post, as (type, reason, message).
    """

    decision: Decision
    replicas: int | None = None
    annotations: dict[str, str] = dataclasses.field(default_factory=dict)
    status: dict[str, Any] | None = None
    events: tuple[Event, ...] = ()


def plan_writes(
    observation: Observation,
    policy: AutoscalingPolicy,
    window: list[MetricSample],
    memory: AutoscalerMemory,
    now: datetime.datetime,
) -> Writes:
    """Decide the replicas and the tuning for ``observation`` and what to write (pure).

    ``window`` holds the samples of the stable window (this tick's included); ``memory`` is the
    previous decision's. The returned ``decision.memory`` goes into the next tick.
    """
    body, planned = observation.body, observation.planned
    assert planned.spec is not None and planned.spec.autoscaling is not None
    assert planned.plan is not None and planned.user_spec is not None
    meta = body["metadata"]
    annotations = meta.get("annotations") or {}
    pods, t = observation.pods, observation.now
    startup = startup_seconds(pods)
    fleet = FleetState(
        replicas=observation.replicas,
        ready_replicas=len(ready_targets(pods)),
        pending_replicas=sum(1 for pod in pods if unschedulable(pod)),
        starting_replicas=starting_pods(pods, t, starting_hold_seconds(startup)),
        gpus_per_replica=planned.plan.gpus_per_replica,
        gpus_used_elsewhere=observation.gpus_elsewhere,
        tensor_parallel_fixed=planned.user_spec.tensor_parallel_size is not None,
        larger_shape=observation.larger_shape,
        max_num_seqs=planned.plan.max_num_seqs,
        startup_seconds=startup,
        wake_requested_at=wake_time(annotations),
        held_requests=held_requests(annotations, t),
        unscraped_replicas=observation.unscraped + sum(1 for pod in pods if stalled(pod)),
    )
    decision = decide(window, policy, fleet, memory, t)
    tuning = tuning_step(
        annotations,
        pods,
        window,
        planned.plan,
        apply=planned.spec.autoscaling.tune_engine,
        now=t,
        canary_seconds=CANARY_WINDOWS * policy.stable_window_seconds,
        allow_kv_cache_dtype=planned.spec.autoscaling.allow_kv_cache_dtype,
    )
    previous = body.get("status") or {}
    status = decision_status(decision, previous, now)
    status["recommendations"] = tuning.status
    new_annotations = {}
    if decision.replan is not None:
        new_annotations[SHAPE_ANNOTATION] = decision.replan.to_annotation()
    events = []
    if tuning.changed and tuning.rollout is not None:
        rollout = tuning.rollout
        new_annotations[TUNING_ANNOTATION] = rollout.to_annotation()
        events.append(
            Event(
                "Warning" if rollout.phase == "RolledBack" else "Normal",
                f"Tuning{rollout.phase}",
                f"engine settings {rollout.settings.as_dict()}: {rollout.reason}",
            )
        )
    scaled = decision.desired_replicas != observation.replicas
    if scaled or decision.replan is not None:
        events.append(
            Event(
                "Normal",
                decision.reason,
                f"replicas {observation.replicas} -> {decision.desired_replicas}: {decision.message}",
            )
        )
    return Writes(
        decision=decision,
        replicas=decision.desired_replicas if scaled else None,
        annotations=new_annotations,
        status=status if status_changed(previous, status) else None,
        events=tuple(events),
    )


class AutoscalingLoop:
    """The autoscaler's state and side effects; :mod:`kvpilot.operator.periodic` calls
    :meth:`tick` per LLMDeployment, the wake handler calls it at once."""

    def __init__(self, config: AutoscalerConfig, runtime: Runtime) -> None:
        self.config = config
        self.runtime = runtime
        self.address_map = AddressMap.from_env()
        self.states: dict[tuple[str, str], ObjectState] = {}

    def state(self, namespace: str, name: str) -> ObjectState:
        """The window and memory of one LLMDeployment (created empty on first use)."""
        return self.states.setdefault((namespace, name), ObjectState(TimeWindow(60.0)))

    def forget(self, namespace: str, name: str) -> None:
        """Drop the state of a deleted LLMDeployment."""
        self.states.pop((namespace, name), None)

    @property
    def client(self) -> KubeClient:
        return self.runtime.client

    def planned(self, body: dict[str, Any]) -> PlanOutcome:
        """The planned the reconciler deploys (:func:`kvpilot.operator.handlers.plan_deployment`)."""
        namespace = body["metadata"]["namespace"]

        def load(source: ModelSource) -> ModelShape:
            return self.runtime.models.load(source, namespace)

        return plan_deployment(body, load, self.runtime.config.engine_image)

    async def tick(self, body: dict[str, Any]) -> Decision | None:
        """One observe-decide-write round for ``body``; None when it is not ours to scale.

        Raises:
            KubeApiError: an API read or write was refused.
        """
        meta = body["metadata"]
        state = self.state(meta["namespace"], meta["name"])
        async with state.lock:
            observation = await self.observe(body)
            if observation is None:
                return None
            assert observation.planned.spec is not None
            assert observation.planned.spec.autoscaling is not None
            if state.memory == AutoscalerMemory():
                state.memory = remembered(body)
            policy = AutoscalingPolicy.from_spec(observation.planned.spec.autoscaling)
            if state.window.max_age_seconds != policy.stable_window_seconds:
                state.window = TimeWindow(policy.stable_window_seconds)
            try:
                state.window.extend(observation.now, observation.samples)
            except ValueError:
                # The wall clock stepped back (NTP): old samples cannot be ordered with new ones.
                state.window = TimeWindow(policy.stable_window_seconds)
                state.window.extend(observation.now, observation.samples)
            writes = plan_writes(
                observation,
                policy,
                list(state.window),
                state.memory,
                datetime.datetime.now(datetime.UTC),
            )
            state.memory = writes.decision.memory
            await asyncio.to_thread(self.execute, body, writes)
            return writes.decision

    async def observe(self, body: dict[str, Any]) -> Observation | None:
        """Read what a decision needs (None: not autoscaled by kvpilot, or not plan_deployment)."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        planned = await asyncio.to_thread(self.planned, body)
        spec, user_spec = planned.spec, planned.user_spec
        if spec is None or spec.autoscaling is None or spec.autoscaling.mode != "kvpilot":
            return None
        if not planned.ok or user_spec is None:
            logger.info(
                "%s/%s: not autoscaled until it is sized: %s: %s",
                namespace,
                name,
                planned.reason,
                planned.message,
            )
            return None
        assert planned.plan is not None
        pods = await asyncio.to_thread(self._pods, namespace, name)
        now = time.time()
        result = await self._scrape(namespace, ready_targets(pods), now)
        for pod, error in result.errors.items():
            logger.warning("%s/%s: pod %s not scraped: %s", namespace, name, pod, error)
        shape = None
        if user_spec.tensor_parallel_size is None:
            model = await asyncio.to_thread(self.runtime.models.load, spec.model, namespace)
            # From the shape in force (maybe one chosen earlier), the next larger one.
            current = dataclasses.replace(spec, tensor_parallel_size=None)
            shape = larger_shape(current, planned.plan, model, spec.autoscaling.allowed_gpu_types)
        return Observation(
            body=body,
            planned=planned,
            pods=pods,
            samples=list(result.samples),
            replicas=(body.get("spec") or {}).get("replicas", spec.replicas),
            gpus_elsewhere=await asyncio.to_thread(self._gpus_elsewhere, namespace, name),
            larger_shape=shape,
            now=now,
            unscraped=len(result.errors),
        )

    def execute(self, body: dict[str, Any], writes: Writes) -> None:
        """Send ``writes`` (scale, annotations, status, Events) for ``body``."""
        ref = {"apiVersion": API_VERSION, "kind": KIND, "metadata": body["metadata"]}
        if writes.replicas is not None:
            self.client.patch(ref, {"spec": {"replicas": writes.replicas}}, "scale")
        if writes.annotations:
            self.client.patch(ref, {"metadata": {"annotations": writes.annotations}})
        if writes.status is not None:
            self.client.patch(ref, {"status": writes.status}, "status")
        for event in writes.events:
            self.runtime.post_event(body, event)

    async def _scrape(self, namespace: str, targets: list[PodTarget], now: float) -> ScrapeResult:
        if self.config.prometheus_url:
            source = PrometheusSource(self.config.prometheus_url)
            names = [t.name for t in targets]
            return await source.scrape(
                namespace, names, now, timeout_seconds=self.config.scrape_timeout
            )
        return await scrape_direct(
            targets,
            now,
            address_map=self.address_map,
            timeout_seconds=self.config.scrape_timeout,
        )

    def _pods(self, namespace: str, name: str) -> list[dict[str, Any]]:
        query = urllib.parse.urlencode({"labelSelector": manifests.selector(name)})
        answer = self.client.request("GET", f"/api/v1/namespaces/{namespace}/pods?{query}")
        return answer.get("items") or []

    def _gpus_elsewhere(self, namespace: str, name: str) -> int:
        """GPUs the namespace's other LLMDeployments hold: replicas x GPUs per replica."""
        answer = self.client.request("GET", f"/apis/{API_VERSION}/namespaces/{namespace}/{PLURAL}")
        total = 0
        for other in answer.get("items") or []:
            if other["metadata"]["name"] == name:
                continue
            per_replica = ((other.get("status") or {}).get("plan") or {}).get("gpusPerReplica", 0)
            total += per_replica * (other.get("spec") or {}).get("replicas", 1)
        return total


def register(registry: kopf.OperatorRegistry, loop: AutoscalingLoop) -> None:
    """Add the wake handler to ``registry``: a new wake request ticks a deployment at zero."""

    # The annotation's key has dots, so the field is given as a path of keys.
    @kopf.on.field(
        GROUP, VERSION, PLURAL, id="wake", field=("metadata", "annotations", WAKE_ANNOTATION),
        registry=registry,
    )  # fmt: skip
    async def wake(body: kopf.Body, **_: Any) -> None:
        plain = dict(body)
        if (plain.get("spec") or {}).get("replicas", 1) == 0:
            await loop.tick(plain)
