"""The autoscaling loop: a kopf timer per ``LLMDeployment`` that scrapes, decides and writes.

Every ``interval`` seconds, for each LLMDeployment with ``spec.autoscaling.mode: kvpilot``:

1. read the spec and plan it with the reconciler's own function
   (:func:`kvpilot.operator.handlers.sized`, with the autoscaler's chosen shape);
2. list the engine pods (label ``kvpilot.dev/llmdeployment=<name>``), scrape the ready ones
   (:mod:`kvpilot.operator.scraper`; a Prometheus server instead when configured) and count
   the unschedulable and the starting ones (:func:`unschedulable`, :func:`starting_pods`);
3. decide (:func:`kvpilot.operator.autoscaler.decide`) from the object's window of samples;
4. write ``spec.replicas`` through the ``scale`` subresource when it changes, post an Event
   for every scaling decision, record a larger shape in ``kvpilot.dev/shape`` when the
   decision says "bigger, not more", and write ``status.desiredReplicas``,
   ``status.lastScaleTime``, ``status.lastDecision``, ``status.kvCacheUsage`` and
   ``status.recommendations`` (:mod:`kvpilot.operator.tuning`), only when they changed:
   ``lastDecision.time`` is when that decision was first made, and a steady fleet costs no
   writes;
5. with ``tuneEngine: true``, move the tuning rollout along (canary, applied, rolled back) in
   the annotation ``kvpilot.dev/engine-tuning``, with an Event for each phase.

``mode: external`` objects are never touched: HPA, KEDA or ``kubectl scale`` own the replicas.

Waking from zero: ``kubectl annotate llmd NAME kvpilot.dev/wake="$(date +%s)" --overwrite``
(any client with ``patch`` on llmdeployments can do it; docs/autoscaling.md shows an activator
pattern). A change of that annotation wakes the deployment at once; the timer also honours it.

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

from kvpilot.engine.model_spec import ModelSpec
from kvpilot.operator import manifests
from kvpilot.operator.apply import KubeApiError, KubeClient
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
from kvpilot.operator.gpus import CUSTOM, gpu_type
from kvpilot.operator.handlers import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    ModelCache,
    Sizing,
    sized,
)
from kvpilot.operator.images import ENGINE_IMAGE
from kvpilot.operator.planner import Plan, PlanError, plan_for_spec
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

logger = logging.getLogger("kvpilot.operator.autoscaling")


@dataclasses.dataclass(frozen=True)
class AutoscalerConfig:
    """Operator-wide settings of the autoscaling loop.

    Attributes:
        interval: seconds between decisions for each LLMDeployment.
        scrape_timeout: seconds allowed per pod scrape (or per Prometheus query).
        prometheus_url: read metrics from this Prometheus instead of the pods, or None.
        engine_image: image for specs without ``spec.image`` (as the reconciler's).
        model_config_ttl: seconds a model's config.json is reused.
    """

    interval: float = 15.0
    scrape_timeout: float = 2.0
    prometheus_url: str | None = None
    engine_image: str = ENGINE_IMAGE
    model_config_ttl: float = 600.0


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


def _condition(pod: dict[str, Any], kind: str) -> dict[str, Any]:
    """The pod's status condition of type ``kind`` (``{}`` when it has none)."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind:
            return condition
    return {}


def unschedulable(pod: dict[str, Any]) -> bool:
    """Whether the scheduler could not place ``pod`` (condition ``PodScheduled`` False)."""
    return _condition(pod, "PodScheduled").get("status") == "False"


def starting_pods(pods: list[dict[str, Any]], now: float, hold_seconds: float) -> int:
    """How many of ``pods`` are starting: placed (``PodScheduled`` True), not ``Ready``, not
    being deleted, and created less than ``hold_seconds`` before ``now`` (Unix seconds; see
    :func:`kvpilot.operator.autoscaler.starting_hold_seconds`). An older one is stuck (crash
    loop, failed model load) and counts no more; one without a creation time neither."""
    count = 0
    for pod in pods:
        metadata = pod.get("metadata") or {}
        created = metadata.get("creationTimestamp")
        if (
            created
            and not metadata.get("deletionTimestamp")
            and _condition(pod, "PodScheduled").get("status") == "True"
            and _condition(pod, "Ready").get("status") != "True"
            and now - _parse_time(created) < hold_seconds
        ):
            count += 1
    return count


def startup_seconds(pods: list[dict[str, Any]]) -> float:
    """How long the ready pods took from creation to Ready (the longest, seconds; 0 when no
    pod says), so scale-ups can lead a rising load by that much."""
    longest = 0.0
    for pod in pods:
        created = (pod.get("metadata") or {}).get("creationTimestamp")
        ready = _condition(pod, "Ready")
        ready_at = ready.get("lastTransitionTime")
        if ready.get("status") == "True" and created and ready_at:
            longest = max(longest, _parse_time(ready_at) - _parse_time(created))
    return longest


def _parse_time(value: str) -> float:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def larger_shape(
    spec: LLMDeploymentSpec, plan: Plan, model: ModelSpec, allowed_gpu_types: tuple[str, ...]
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


def _plan_or_none(spec: LLMDeploymentSpec, model: ModelSpec) -> Plan | None:
    try:
        return plan_for_spec(spec, model)
    except PlanError:
        return None


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
) -> TuningStep:
    """Recommend engine settings from the window and, with ``apply`` (``tuneEngine``), move the
    rollout along (:func:`kvpilot.operator.tuning.next_rollout`), judging the canary pod
    (label ``CANARY_LABEL``) against the others over the canary's time."""
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
    plan_settings = EngineSettings(plan.gpu_memory_utilization, plan.max_num_seqs)
    in_force = (current.in_force() if current else None) or plan_settings
    recommendation = recommend(in_force, observed)
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


def status_changed(previous: dict[str, Any], status: dict[str, Any]) -> bool:
    """Whether merge-patching ``status`` onto ``previous`` would change any field."""
    return any(without_nulls(previous.get(key)) != without_nulls(v) for key, v in status.items())


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


class AutoscalingLoop:
    """The side effects of one LLMDeployment's tick; the kopf handlers are thin wrappers."""

    def __init__(self, config: AutoscalerConfig, client: KubeClient | None = None) -> None:
        self.config = config
        self._client = client
        self._models: ModelCache | None = None
        self.address_map = AddressMap.from_env()
        self.states: dict[tuple[str, str], ObjectState] = {}

    def state(self, namespace: str, name: str) -> ObjectState:
        """The window and memory of one LLMDeployment (created empty on first use)."""
        return self.states.setdefault((namespace, name), ObjectState(TimeWindow(60.0)))

    @property
    def client(self) -> KubeClient:
        # Created on first use: the kubernetes configuration is loaded by then.
        if self._client is None:
            self._client = KubeClient()
        return self._client

    @property
    def models(self) -> ModelCache:
        if self._models is None:
            self._models = ModelCache(self.client, self.config.model_config_ttl)
        return self._models

    def sizing(self, body: dict[str, Any]) -> Sizing:
        """The sizing the reconciler deploys (:func:`kvpilot.operator.handlers.sized`)."""
        namespace = body["metadata"]["namespace"]

        def load(source: ModelSource) -> ModelSpec:
            return self.models.load(source, namespace)

        return sized(body, load, self.config.engine_image)

    async def tick(self, body: dict[str, Any]) -> Decision | None:
        """One scrape-decide-write round for ``body``; None when it is not ours to scale."""
        meta = body["metadata"]
        state = self.state(meta["namespace"], meta["name"])
        async with state.lock:
            return await self._tick(body, state)

    async def _tick(self, body: dict[str, Any], state: ObjectState) -> Decision | None:
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        if state.memory == AutoscalerMemory():
            state.memory = remembered(body)
        sizing = await asyncio.to_thread(self.sizing, body)
        spec, user_spec = sizing.spec, sizing.user_spec
        if spec is None or spec.autoscaling is None or spec.autoscaling.mode != "kvpilot":
            return None
        if not sizing.ok or user_spec is None:
            logger.info(
                "%s/%s: not autoscaled until it is sized: %s: %s",
                namespace,
                name,
                sizing.reason,
                sizing.message,
            )
            return None
        assert sizing.plan is not None
        policy = AutoscalingPolicy.from_spec(spec.autoscaling)
        if state.window.max_age_seconds != policy.stable_window_seconds:
            state.window = TimeWindow(policy.stable_window_seconds)

        pods = await asyncio.to_thread(self._pods, namespace, name)
        targets = ready_targets(pods)
        now = time.time()
        result = await self._scrape(namespace, targets, now)
        for pod, error in result.errors.items():
            logger.warning("%s/%s: pod %s not scraped: %s", namespace, name, pod, error)
        try:
            state.window.extend(now, result.samples)
        except ValueError:
            # The wall clock stepped back (NTP): the old samples cannot be ordered with new ones.
            state.window = TimeWindow(policy.stable_window_seconds)
            state.window.extend(now, result.samples)

        replicas = (body.get("spec") or {}).get("replicas", spec.replicas)
        shape = None
        if user_spec.tensor_parallel_size is None:
            model = await asyncio.to_thread(self.models.load, spec.model, namespace)
            # From the shape in force (maybe one chosen earlier), the next larger one.
            current = dataclasses.replace(spec, tensor_parallel_size=None)
            allowed = spec.autoscaling.allowed_gpu_types
            shape = larger_shape(current, sizing.plan, model, allowed)
        startup = startup_seconds(pods)
        fleet = FleetState(
            replicas=replicas,
            ready_replicas=len(targets),
            pending_replicas=sum(1 for pod in pods if unschedulable(pod)),
            starting_replicas=starting_pods(pods, now, starting_hold_seconds(startup)),
            gpus_per_replica=sizing.plan.gpus_per_replica,
            gpus_used_elsewhere=await asyncio.to_thread(self._gpus_elsewhere, namespace, name),
            tensor_parallel_fixed=user_spec.tensor_parallel_size is not None,
            larger_shape=shape,
            max_num_seqs=sizing.plan.max_num_seqs,
            startup_seconds=startup,
            wake_requested_at=wake_time(meta.get("annotations") or {}),
        )
        decision = decide(list(state.window), policy, fleet, state.memory, now)
        state.memory = decision.memory
        tuning = tuning_step(
            meta.get("annotations") or {},
            pods,
            list(state.window),
            sizing.plan,
            apply=spec.autoscaling.tune_engine,
            now=now,
            canary_seconds=CANARY_WINDOWS * policy.stable_window_seconds,
        )
        await asyncio.to_thread(self._write, body, decision, replicas, tuning)
        return decision

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
        selector = ",".join(f"{k}={v}" for k, v in manifests.selector_labels(name).items())
        query = urllib.parse.urlencode({"labelSelector": selector})
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

    def _write(
        self, body: dict[str, Any], decision: Decision, replicas: int, tuning: TuningStep
    ) -> None:
        ref = {"apiVersion": API_VERSION, "kind": KIND, "metadata": body["metadata"]}
        if decision.desired_replicas != replicas:
            self.client.patch(ref, {"spec": {"replicas": decision.desired_replicas}}, "scale")
        annotations = {}
        if decision.replan is not None:
            annotations[SHAPE_ANNOTATION] = decision.replan.to_annotation()
        if tuning.changed and tuning.rollout is not None:
            annotations[TUNING_ANNOTATION] = tuning.rollout.to_annotation()
        if annotations:
            self.client.patch(ref, {"metadata": {"annotations": annotations}})
        previous = body.get("status") or {}
        status = decision_status(decision, previous, datetime.datetime.now(datetime.UTC))
        status["recommendations"] = tuning.status
        if status_changed(previous, status):
            self.client.patch(ref, {"status": status}, "status")
        if tuning.changed and tuning.rollout is not None:
            rollout = tuning.rollout
            kopf.event(
                body,
                type="Warning" if rollout.phase == "RolledBack" else "Normal",
                reason=f"Tuning{rollout.phase}",
                message=f"engine settings {rollout.settings.as_dict()}: {rollout.reason}",
            )
        if decision.desired_replicas != replicas or decision.replan is not None:
            kopf.event(
                body,
                type="Normal",
                reason=decision.reason,
                message=f"replicas {replicas} -> {decision.desired_replicas}: {decision.message}",
            )


def register(registry: kopf.OperatorRegistry, config: AutoscalerConfig) -> AutoscalingLoop:
    """Add the autoscaling timer and the wake handler to ``registry``; returns the loop."""
    loop = AutoscalingLoop(config)

    @kopf.timer(GROUP, VERSION, PLURAL, id="autoscale", interval=config.interval, registry=registry)
    async def autoscale(body: kopf.Body, **_: Any) -> None:
        plain = dict(body)
        try:
            await loop.tick(plain)
        except KubeApiError as error:
            raise kopf.TemporaryError(f"autoscaling write failed: {error}", delay=5) from error

    # The annotation's key has dots, so the field is given as a path of keys.
    @kopf.on.field(
        GROUP, VERSION, PLURAL, id="wake", field=("metadata", "annotations", WAKE_ANNOTATION),
        registry=registry,
    )  # fmt: skip
    async def wake(body: kopf.Body, **_: Any) -> None:
        plain = dict(body)
        if (plain.get("spec") or {}).get("replicas", 1) == 0:
            await loop.tick(plain)

    @kopf.on.delete(GROUP, VERSION, PLURAL, id="forget-autoscaling", registry=registry,
                    optional=True)  # fmt: skip
    def forget(meta: kopf.Meta, **_: Any) -> None:
        loop.states.pop((meta["namespace"], meta["name"]), None)

    return loop
