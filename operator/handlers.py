"""kopf handlers for ``LLMDeployment``: thin wrappers around one level-triggered reconcile.

Every trigger runs the same :func:`reconcile`, which reads the object as it is now and makes
the world match it: create, update and resume of an LLMDeployment, the periodic resync
(:mod:`kvpilot.operator.periodic`: repairs drift of the children), and changes of a child
Deployment or of an engine pod's scheduling or readiness (they feed the parent's status).
Running it twice changes nothing the second time.

One reconcile:

1. :func:`plan_deployment` (pure, given the model loader; the autoscaler calls it too): :func:`plan_user_spec`
   validates the spec (``spec.parse_spec``), reads the model's config.json (``model_source``,
   cached) and plans it (``planner.plan_for_spec``); :func:`with_chosen_shape` then plans the replica
   shape the autoscaler chose, if any.
2. Apply the children (``manifests.children``, owned by the LLMDeployment) with server-side
   apply (:func:`kvpilot.operator.apply.apply_child`); one child's failure does not stop the
   others. The model cache claim's spec is immutable once created: only its size grows
   (``manifests.claim_update``). The live tuning the autoscaler recorded
   (:func:`tuning_rollout`) is rendered with them: a canary Deployment, or every pod on the
   tuned or rolled-back settings.
3. Observe the engine pods (by label) and the model cache claim.
4. :func:`desired_status` (pure): conditions ``Sized``, ``Progressing``, ``Ready``,
   ``Degraded`` with ``observedGeneration``, plus ``plan``, ``replicas``, ``readyReplicas``,
   ``selector``, ``endpoint``, ``model``; written to the status subresource only if it differs.
   ``Degraded`` names the first failure: the spec or the plan, a child the API server refused,
   a claim nothing binds, pods the scheduler cannot place, a container that cannot start or
   keeps crashing, the Deployment controller's ``ReplicaFailure`` (e.g. a ResourceQuota) or
   ``ProgressDeadlineExceeded``.
5. Kubernetes Events for decisions and errors: :func:`transition_events` (a condition that
   changed) and one per child created or updated; none when nothing changed.

An invalid spec or a model that does not fit is reported in the conditions (and an Event) and
creates nothing; the handler still succeeds, so there is no retry loop. A plan that needs more
than one node per replica (pipeline parallel) is rendered as a LeaderWorkerSet
(:mod:`kvpilot.operator.leaderworkerset`); on a cluster without the LeaderWorkerSet CRD it gets
``Degraded`` with reason ``LeaderWorkerSetNotInstalled`` and no engine pods. API conflicts and
outages are retried inside the reconcile, then handed to kopf as ``TemporaryError``.

No handler needs a finalizer, and the operator sets none: an LLMDeployment deleted while the
operator is down (or uninstalled) goes at once, and the garbage collector removes its children.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import kopf
import urllib3

from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME
from kvpilot.engine.model_shape import ModelShape
from kvpilot.operator import (
    conditions,
    leaderworkerset,
    manifests,
    router_manifests,
    scale_down,
)
from kvpilot.operator.apply import (
    ApplyResult,
    KubeApiError,
    KubeClient,
    OwnershipConflict,
    StaleOwner,
    TransientApiError,
    apply_child,
    patch_status,
)
from kvpilot.operator.autoscaler import apply_shape
from kvpilot.operator.events import Event, EventSink
from kvpilot.operator.model_source import load_model_shape
from kvpilot.operator.operator_metrics import OperatorMetrics
from kvpilot.operator.planner import Plan, PlanError, plan_for_spec
from kvpilot.operator.pods import claim_failure, pod_failure
from kvpilot.operator.pods import condition as pod_condition
from kvpilot.operator.spec import (
    LLMDeploymentSpec,
    ModelSource,
    SpecError,
    parse_spec,
    validate_name,
)
from kvpilot.operator.tuning import TUNING_ANNOTATION, Rollout

GROUP, VERSION, PLURAL = "kvpilot.dev", "v1alpha1", "llmdeployments"
API_VERSION = f"{GROUP}/{VERSION}"
WORKLOAD_KINDS = ("Deployment", leaderworkerset.KIND)
"""Children whose status is the replicas' progress (``_rollout_progress`` reads either)."""
KIND = "LLMDeployment"
"""Condition reason of a plan with pipeline parallel size > 1 (replicas spanning nodes), which
the operator plans but does not render yet."""

INVALID_SPEC = "InvalidSpec"
# A reconcile re-reads its object and tries again this often when its status write conflicts.
STATUS_CONFLICT_ATTEMPTS = 5
STALE_OWNER_DELAY = 2.0
"""Seconds before retrying a reconcile whose children still belong to a deleted namesake."""
WATCH_TIMEOUT = 300
"""Seconds the API server keeps each of the operator's watches open (then kopf re-watches)."""

logger = logging.getLogger("kvpilot.operator.handlers")


@dataclasses.dataclass(frozen=True)
class HandlerConfig:
    """Operator-wide settings of the handlers.

    Attributes:
        engine_image: image for LLMDeployments without ``spec.image``.
        resync_interval: seconds between timer-driven reconciles of each object.
        retry_delay: seconds kopf waits before retrying a reconcile that hit API trouble.
        model_config_ttl: seconds a model's config.json is reused before it is read again.
        watch_leader_worker_sets: watch LeaderWorkerSets (multi-node replicas) for changes;
            set when their CRD was installed at start (a watch on a missing kind fails).
        router: deploy a router per LLMDeployment (``router_manifests.py``) unless its
            ``spec.router.enabled`` is false; it runs in ``engine_image``.
    """

    engine_image: str
    resync_interval: float = 300.0
    retry_delay: float = 10.0
    model_config_ttl: float = 600.0
    watch_leader_worker_sets: bool = False
    router: bool = True


@dataclasses.dataclass(frozen=True)
class PlanOutcome:
    """A spec read and planned: ``spec`` and ``plan``, or a failure ``reason`` and ``message``.

    ``spec`` is set whenever the spec itself is valid (even if planning failed). ``as_written`` is
    the spec as the user wrote it when :func:`with_chosen_shape` replaced ``spec``'s shape, else None.
    """

    spec: LLMDeploymentSpec | None = None
    plan: Plan | None = None
    reason: str | None = None
    message: str = ""
    as_written: LLMDeploymentSpec | None = None

    @property
    def user_spec(self) -> LLMDeploymentSpec | None:
        """The spec as the user wrote it (before the autoscaler's shape)."""
        return self.as_written or self.spec

    @property
    def ok(self) -> bool:
        """Whether there is a plan."""
        return self.plan is not None


# ---- pure decisions ---------------------------------------------------------------------------


def plan_user_spec(
    body: dict[str, Any], load_model: Callable[[ModelSource], ModelShape], engine_image: str
) -> PlanOutcome:
    """Validate ``body``'s name and spec and plan it; never raises for bad input.

    ``load_model`` reads the model's config (``model_source.load_model_shape``); it may raise
    ``PlanError`` (e.g. ``ConfigUnavailable``), which becomes the failure reason.
    """
    raw_spec = body.get("spec") or {}
    try:
        validate_name(body["metadata"]["name"])
        spec = parse_spec(raw_spec)
    except SpecError as exc:
        return PlanOutcome(reason=INVALID_SPEC, message=str(exc))
    if "image" not in raw_spec:
        spec = dataclasses.replace(spec, image=engine_image)
    try:
        plan = plan_for_spec(spec, load_model(spec.model))
    except PlanError as exc:
        return PlanOutcome(spec=spec, reason=exc.reason, message=exc.message)
    return PlanOutcome(spec=spec, plan=plan)


def with_chosen_shape(
    planned: PlanOutcome, body: dict[str, Any], load_model: Callable[[ModelSource], ModelShape]
) -> PlanOutcome:
    """``planned`` with the autoscaler's chosen shape (``autoscaler.SHAPE_ANNOTATION``) planned.

    The autoscaler's "bigger, not more" decision records a larger replica shape in that
    annotation; the reconciler rolls it out. Specs that fix ``tensorParallelSize``, and CPU
    mode, keep their own shape. A malformed annotation is reported as ``InvalidShape``.
    """
    if planned.spec is None:
        return planned
    try:
        spec = apply_shape(planned.spec, body["metadata"].get("annotations") or {})
    except SpecError as exc:
        return PlanOutcome(spec=planned.spec, reason="InvalidShape", message=str(exc))
    if spec is planned.spec:
        return planned
    try:
        plan = plan_for_spec(spec, load_model(spec.model))
    except PlanError as exc:
        return PlanOutcome(
            spec=spec, reason=exc.reason, message=exc.message, as_written=planned.spec
        )
    return PlanOutcome(spec=spec, plan=plan, as_written=planned.spec)


def plan_deployment(
    body: dict[str, Any], load_model: Callable[[ModelSource], ModelShape], engine_image: str
) -> PlanOutcome:
    """What the reconciler deploys for ``body``: :func:`plan_user_spec`, then :func:`with_chosen_shape`.

    The autoscaler sizes with this same function, so both see the same plan.
    """
    return with_chosen_shape(plan_user_spec(body, load_model, engine_image), body, load_model)


def tuning_rollout(body: dict[str, Any], planned: PlanOutcome) -> Rollout | None:
    """The live tuning to render: the autoscaler's ``TUNING_ANNOTATION``, or None without one.

    With ``spec.autoscaling`` no longer ``mode: kvpilot`` with ``tuneEngine: true`` (or a CPU
    plan), or a rollout that changes the KV cache dtype once ``allowKvCacheDtype`` is off, a
    recorded rollout is rendered as rolled back to the plan's settings: every pod runs
    the plan and the canary Deployment keeps 0 replicas. A malformed annotation is ignored
    (logged); the autoscaler writes a well-formed one with its next tuning decision.
    """
    raw = (body["metadata"].get("annotations") or {}).get(TUNING_ANNOTATION)
    if raw is None or planned.spec is None:
        return None
    try:
        rollout = Rollout.from_annotation(raw)
    except ValueError as exc:
        logger.warning("%s/%s: %s", body["metadata"]["namespace"], body["metadata"]["name"], exc)
        return None
    autoscaling = planned.spec.autoscaling
    enabled = (
        autoscaling is not None
        and autoscaling.mode == "kvpilot"
        and autoscaling.tune_engine
        and planned.plan is not None
        and planned.plan.gpu_memory_utilization is not None
        and (autoscaling.allow_kv_cache_dtype or not _changes_kv_cache_dtype(rollout, planned.plan))
    )
    if enabled:
        return rollout
    return dataclasses.replace(rollout, phase="RolledBack", previous=None)


def _changes_kv_cache_dtype(rollout: Rollout, plan: Plan) -> bool:
    """Whether ``rollout`` runs a KV cache dtype other than the plan's."""
    recorded = (rollout.settings, rollout.previous)
    return any(
        s is not None and s.kv_cache_dtype not in ("auto", plan.kv_cache_dtype) for s in recorded
    )


def plan_summary(plan: Plan) -> str:
    """One line for people: the shape of a replica and what its KV cache holds."""
    device = "CPU" if plan.gpus_per_replica == 0 else f"{plan.gpus_per_replica} x {plan.gpu_type}"
    utilization = (
        ""
        if plan.gpu_memory_utilization is None
        else f", gpu_memory_utilization {plan.gpu_memory_utilization:g}"
    )
    pipeline = (
        ""
        if plan.pipeline_parallel_size == 1
        else f" x pipeline_parallel_size {plan.pipeline_parallel_size}"
    )
    return (
        f"{device} per replica (tensor_parallel_size {plan.tensor_parallel_size}{pipeline}{utilization}, {plan.dtype}); "
        f"KV cache {plan.kv_capacity_tokens} tokens = {plan.max_concurrency} sequences of {plan.max_model_len}"
    )


def _model_name(spec: LLMDeploymentSpec) -> str:
    model = spec.model
    return model.served_model_name or model.location or model.source or DEFAULT_MODEL_NAME


def _rollout_progress(deployment: dict[str, Any] | None) -> tuple[int, int, int, bool]:
    """(desired, existing, ready replicas, rollout finished) of a live Deployment."""
    if deployment is None:
        return 0, 0, 0, False
    status = deployment.get("status") or {}
    desired = (deployment.get("spec") or {}).get("replicas", 1)
    existing, ready = status.get("replicas", 0), status.get("readyReplicas", 0)
    observed = status.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 1)
    finished = (
        observed
        and status.get("updatedReplicas", 0) >= desired
        and ready >= desired
        and existing <= desired
    )
    return desired, existing, ready, finished


def _fleet_progress(
    deployment: dict[str, Any] | None, canary: dict[str, Any] | None
) -> tuple[int, int, int, bool]:
    """:func:`_rollout_progress` of the main Deployment and the tuning canary together."""
    main = _rollout_progress(deployment)
    if canary is None:
        return main
    extra = _rollout_progress(canary)
    return (main[0] + extra[0], main[1] + extra[1], main[2] + extra[2], main[3] and extra[3])


def _deployment_failure(deployment: dict[str, Any] | None) -> tuple[str, str] | None:
    """(reason, message) when the Deployment controller reports a failure."""
    for cond in ((deployment or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return cond.get("reason") or "ReplicaFailure", cond.get("message", "")
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return "ProgressDeadlineExceeded", cond.get("message", "")
    return None


def desired_status(
    body: dict[str, Any],
    planned: PlanOutcome,
    deployment: dict[str, Any] | None,
    *,
    now: datetime.datetime,
    apply_failure: tuple[str, str] | None = None,
    canary: dict[str, Any] | None = None,
    observed_failure: tuple[str, str] | None = None,
    router: bool = False,
) -> dict[str, Any]:
    """The status the LLMDeployment should have, from its planned and its live Deployment.

    Args:
        body: the LLMDeployment as read (its status supplies the previous conditions).
        planned: the result of :func:`plan_user_spec`.
        deployment: the live child Deployment, or None.
        now: the time of any condition transition.
        apply_failure: (reason, message) when the children could not be applied.
        canary: the live tuning canary Deployment, or None; its replicas count with the
            main Deployment's.
        observed_failure: (reason, message) from the pods and the model cache claim
            (:func:`kvpilot.operator.pods.claim_failure`, :func:`~kvpilot.operator.pods.pod_failure`).
        router: whether the router fronts the engines (``status.endpoint`` is its Service).

    Returns:
        A ``status`` with every field the operator owns (the autoscaler's are left out).
    """
    meta = body["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation", 1)
    previous = (body.get("status") or {}).get("conditions") or []
    desired, existing, ready, finished = _fleet_progress(deployment, canary)

    def put(
        conds: list[dict[str, Any]], type_: str, state: bool, reason: str, message: str
    ) -> list[dict[str, Any]]:
        return conditions.set_condition(
            conds,
            type_,
            state,
            reason=reason,
            message=message,
            observed_generation=generation,
            now=now,
        )

    status: dict[str, Any] = {
        "observedGeneration": generation,
        "replicas": existing,
        "readyReplicas": ready,
        "selector": manifests.selector(name),
        "endpoint": (router_manifests.endpoint if router else manifests.endpoint)(name, namespace),
    }
    if planned.spec is not None:
        status["model"] = _model_name(planned.spec)
    conds = previous
    if planned.ok:
        assert planned.plan is not None
        status["plan"] = planned.plan.to_status()
        conds = put(conds, conditions.SIZED, True, "Planned", plan_summary(planned.plan))
    else:
        conds = put(conds, conditions.SIZED, False, planned.reason or INVALID_SPEC, planned.message)

    if not planned.ok:
        conds = put(
            conds,
            conditions.PROGRESSING,
            False,
            "NotSized",
            "nothing is rolled out until the spec can be planned",
        )
    elif deployment is None or not finished:
        conds = put(
            conds, conditions.PROGRESSING, True, "RollingOut", f"{ready}/{desired} replicas ready"
        )
    else:
        conds = put(
            conds,
            conditions.PROGRESSING,
            False,
            "RolloutComplete",
            f"{ready}/{desired} replicas updated and ready",
        )

    if deployment is None:
        conds = put(
            conds, conditions.READY, False, "NoDeployment", "the engine Deployment does not exist"
        )
    elif desired == 0:
        conds = put(conds, conditions.READY, False, "ScaledToZero", "spec.replicas is 0")
    elif ready >= desired:
        conds = put(
            conds, conditions.READY, True, "ReplicasReady", f"{ready}/{desired} replicas ready"
        )
    else:
        conds = put(
            conds, conditions.READY, False, "ReplicasNotReady", f"{ready}/{desired} replicas ready"
        )

    failure = (
        (planned.reason or INVALID_SPEC, planned.message)
        if not planned.ok
        else apply_failure
        or observed_failure
        or _deployment_failure(deployment)
        or _deployment_failure(canary)
    )
    if failure is None:
        conds = put(conds, conditions.DEGRADED, False, "AsExpected", "no failures")
    else:
        conds = put(conds, conditions.DEGRADED, True, failure[0], failure[1])
    status["conditions"] = conds
    return status


def transition_events(previous: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[Event]:
    """Events for condition changes worth telling people; a steady state posts none.

    - ``Sized``: every new outcome (a new plan is a decision; a failure is a warning);
    - ``Degraded``: becoming true or failing differently (warning, unless ``Sized`` just
      reported the same reason), recovering (normal);
    - ``Ready``: becoming true (normal), or false after having been true (warning).
    """
    events = []
    for cond in current:
        before = conditions.get_condition(previous, cond["type"]) or {}
        is_true, was_true = cond["status"] == "True", before.get("status") == "True"
        message = f"{cond['type']}={cond['status']}: {cond['message']}"
        if cond["type"] == conditions.SIZED:
            if (before.get("status"), before.get("reason"), before.get("message")) != (
                cond["status"],
                cond["reason"],
                cond["message"],
            ):
                events.append(Event("Normal" if is_true else "Warning", cond["reason"], message))
        elif cond["type"] == conditions.DEGRADED:
            reported = any(e.reason == cond["reason"] for e in events)
            if (
                is_true
                and not reported
                and (not was_true or before.get("reason") != cond["reason"])
            ):
                events.append(Event("Warning", cond["reason"], message))
            elif was_true and not is_true:
                events.append(Event("Normal", "Recovered", message))
        elif cond["type"] == conditions.READY and is_true != was_true and (is_true or before):
            events.append(Event("Normal" if is_true else "Warning", cond["reason"], message))
    return events


# ---- side effects -----------------------------------------------------------------------------


class ModelConfigCache:
    """``load_model_shape`` results kept for ``ttl`` seconds (hub fetches are network calls).

    Keyed by the model source without inline configs (those are read directly, not cached).
    Safe to share between threads (``model_source`` is); two threads missing the same entry
    at once both read it.
    """

    def __init__(self, client: KubeClient, ttl: float) -> None:
        self._client = client
        self._ttl = ttl
        self._entries: dict[tuple[Any, ...], tuple[float, ModelShape]] = {}

    def load(self, source: ModelSource, namespace: str) -> ModelShape:
        """The model's sizes; reads the Hugging Face token Secret when the spec names one.

        Raises:
            PlanError: as ``model_source.load_model_shape``.
        """
        if source.config is not None:
            return load_model_shape(source)
        key = (
            source.scheme,
            source.location,
            source.revision,
            source.hf_token_secret_name,
            namespace,
        )
        hit = self._entries.get(key)
        if hit is not None and time.monotonic() - hit[0] < self._ttl:
            return hit[1]
        model = load_model_shape(source, token=self._token(source, namespace))
        self._entries[key] = (time.monotonic(), model)
        return model

    def _token(self, source: ModelSource, namespace: str) -> str | None:
        if source.scheme != "hf" or source.hf_token_secret_name is None:
            return None
        try:
            secret = self._client.request(
                "GET", f"/api/v1/namespaces/{namespace}/secrets/{source.hf_token_secret_name}"
            )
        except KubeApiError as exc:
            raise PlanError(
                "ConfigUnavailable",
                f"cannot read Secret {source.hf_token_secret_name} for the hub token: {exc.message}",
            ) from exc
        value = (secret.get("data") or {}).get(source.hf_token_secret_key)
        if value is None:
            raise PlanError(
                "ConfigUnavailable",
                f"Secret {source.hf_token_secret_name} has no key {source.hf_token_secret_key!r}",
            )
        return base64.b64decode(value).decode().strip()


_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def _object_lock(namespace: str, name: str) -> threading.Lock:
    # Triggers run in kopf's thread pool; one reconcile per object at a time avoids racing
    # creates and stale status writes.
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


@dataclasses.dataclass
class Runtime:
    """What every handler shares: the API client, the model cache, metrics, settings, poster."""

    client: KubeClient
    models: ModelConfigCache
    metrics: OperatorMetrics
    config: HandlerConfig
    post_event: Callable[[dict[str, Any], Event], None]


def _owned(child: dict[str, Any], owner: dict[str, Any]) -> dict[str, Any]:
    kopf.append_owner_reference(child, owner=owner, controller=True, block_owner_deletion=True)
    return child


@dataclasses.dataclass
class Applied:
    """What applying the children did: live Deployments by name, the model cache claim, child
    Events, and the first failure (reason, message)."""

    deployments: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    claim: dict[str, Any] | None = None
    events: list[Event] = dataclasses.field(default_factory=list)
    failure: tuple[str, str] | None = None


def _apply_one(rt: Runtime, desired: dict[str, Any]) -> ApplyResult:
    if desired["kind"] != "PersistentVolumeClaim":
        return apply_child(rt.client, desired)
    meta = desired["metadata"]
    live = rt.client.get("v1", "PersistentVolumeClaim", meta["namespace"], meta["name"])
    return apply_child(rt.client, manifests.claim_update(desired, live).desired)


def leader_worker_sets_installed(client: KubeClient) -> bool:
    """Whether the cluster serves ``leaderworkerset.x-k8s.io/v1`` (the LWS CRD is installed).

    Raises:
        KubeApiError: the API server answered anything but success or 404.
    """
    try:
        client.request("GET", leaderworkerset.GROUP_VERSION_PATH)
    except KubeApiError as exc:
        if exc.status == 404:
            return False
        raise
    return True


def leader_worker_sets_missing(plan: Plan) -> tuple[str, str]:
    """The Degraded condition's (reason, message) of a multi-node plan on a cluster without
    the LeaderWorkerSet CRD."""
    return (
        "LeaderWorkerSetNotInstalled",
        f"each replica needs {plan.nodes_per_replica} nodes (tensor parallel "
        f"{plan.tensor_parallel_size} x pipeline parallel {plan.pipeline_parallel_size}), "
        "which kvpilot runs as a LeaderWorkerSet; install the LeaderWorkerSet controller "
        "(sigs.k8s.io/lws) and restart the operator",
    )


def _apply_children(rt: Runtime, body: dict[str, Any], planned: PlanOutcome) -> Applied:
    """Apply every child (a refused one does not stop the others).

    Raises:
        StaleOwner: a child still belongs to a deleted LLMDeployment of the same name.
        TransientApiError: API conflicts or outages outlasted the retries.
    """
    meta = body["metadata"]
    applied = Applied()
    if not planned.ok:
        live = rt.client.get("apps/v1", "Deployment", meta["namespace"], meta["name"])
        if live is not None:
            applied.deployments[meta["name"]] = live
        return applied
    assert planned.spec is not None and planned.plan is not None
    rollout = tuning_rollout(body, planned)
    objects = manifests.children(
        meta["name"], meta["namespace"], planned.spec, planned.plan, rollout
    )
    if router_manifests.router_enabled(planned.spec, rt.config.router):
        objects += router_manifests.children(
            meta["name"], meta["namespace"], planned.spec, rt.config.engine_image
        )
    else:
        # A router turned off keeps its objects, at 0 replicas.
        router = router_manifests.router_name(meta["name"])
        _retire(rt, "apps/v1", "Deployment", meta["namespace"], router)
    _retire_other_workload(rt, meta["namespace"], meta["name"], planned.plan)
    for child in objects:
        where = f"{child['kind']} {child['metadata']['name']}"
        if child["kind"] == leaderworkerset.KIND and not leader_worker_sets_installed(rt.client):
            applied.failure = applied.failure or leader_worker_sets_missing(planned.plan)
            continue
        try:
            if child["kind"] == "Deployment" and child["metadata"]["name"] == meta["name"]:
                _before_scaling(rt, child)
            result = _apply_one(rt, _owned(child, body))
        except OwnershipConflict as exc:
            applied.failure = applied.failure or ("ChildConflict", str(exc))
            continue
        except KubeApiError as exc:
            applied.failure = applied.failure or ("ApplyFailed", f"{where}: {exc}")
            continue
        if result.action != "unchanged":
            verb = "Created" if result.action == "created" else "Updated"
            applied.events.append(
                Event(
                    "Normal",
                    verb,
                    f"{verb} {child['kind']} {meta['namespace']}/{child['metadata']['name']}",
                )
            )
        if child["kind"] in WORKLOAD_KINDS:
            applied.deployments[child["metadata"]["name"]] = result.obj
        elif child["kind"] == "PersistentVolumeClaim":
            applied.claim = result.obj
            refused = manifests.claim_update(child, result.obj).refused
            if refused and applied.failure is None:
                applied.failure = ("ModelCacheClaimUnchanged", refused)
    return applied


def _before_scaling(rt: Runtime, desired: dict[str, Any]) -> None:
    """Safe scale-down: before the engine Deployment's replicas go down, the pods' deletion
    costs name the ones to remove (``scale_down.py``)."""
    meta = desired["metadata"]
    live = rt.client.get("apps/v1", "Deployment", meta["namespace"], meta["name"])
    if scale_down.lowers_replicas(live, desired):
        owner = desired["spec"]["selector"]["matchLabels"][manifests.LLMDEPLOYMENT_LABEL]
        scale_down.mark_for_scale_down(rt.client, meta["namespace"], owner)


def _retire(rt: Runtime, api_version: str, kind: str, namespace: str, name: str) -> None:
    """Scale the workload ``kind`` ``namespace/name`` to 0 replicas if it exists: one the
    spec no longer renders keeps its object (the operator deletes nothing; the garbage
    collector does with the LLMDeployment)."""
    live = rt.client.get(api_version, kind, namespace, name)
    if live is not None and (live.get("spec") or {}).get("replicas") != 0:
        ref = {"apiVersion": api_version, "kind": kind, "metadata": live["metadata"]}
        rt.client.patch(ref, {"spec": {"replicas": 0}})


def _retire_other_workload(rt: Runtime, namespace: str, name: str, plan: Plan) -> None:
    """A plan that moved between one node and several keeps the workload of the other kind at
    0 replicas (a Deployment, or a LeaderWorkerSet where their CRD is installed)."""
    if leaderworkerset.is_multi_node(plan):
        _retire(rt, "apps/v1", "Deployment", namespace, name)
    elif rt.config.watch_leader_worker_sets:
        _retire(rt, leaderworkerset.API_VERSION, leaderworkerset.KIND, namespace, name)


def _observe(
    rt: Runtime, body: dict[str, Any], planned: PlanOutcome, applied: Applied
) -> tuple[str, str] | None:
    """What the engine pods and the model cache claim say (a failure, or None)."""
    meta = body["metadata"]
    query = urllib.parse.urlencode({"labelSelector": manifests.selector(meta["name"])})
    pods = (
        rt.client.request("GET", f"/api/v1/namespaces/{meta['namespace']}/pods?{query}").get(
            "items"
        )
        or []
    )
    claim = applied.claim
    if claim is None and planned.spec is not None:
        name = manifests.model_cache_claim_name(meta["name"], planned.spec)
        if name is not None:
            claim = rt.client.get("v1", "PersistentVolumeClaim", meta["namespace"], name)
    return claim_failure(claim, pods) or pod_failure(pods)


def _reconcile_once(rt: Runtime, body: dict[str, Any]) -> bool:
    meta = body["metadata"]

    def load(source: ModelSource) -> ModelShape:
        return rt.models.load(source, meta["namespace"])

    planned = plan_deployment(body, load, rt.config.engine_image)
    applied = _apply_children(rt, body, planned)
    for (
        event
    ) in applied.events:  # posted now: a conflicting status write below repeats no child write
        rt.post_event(body, event)
    status = desired_status(
        body,
        planned,
        applied.deployments.get(meta["name"]),
        now=datetime.datetime.now(datetime.UTC),
        apply_failure=applied.failure,
        canary=applied.deployments.get(manifests.canary_name(meta["name"])),
        observed_failure=_observe(rt, body, planned, applied) if planned.ok else None,
        router=planned.spec is not None
        and router_manifests.router_enabled(planned.spec, rt.config.router),
    )
    written = patch_status(rt.client, body, status)
    previous = (body.get("status") or {}).get("conditions") or []
    for event in transition_events(previous, status["conditions"]):
        rt.post_event(body, event)
    return written or bool(applied.events)


def reconcile(rt: Runtime, namespace: str, name: str, trigger: str, uid: str | None = None) -> None:
    """Make the children and status of the LLMDeployment ``namespace/name`` match its spec.

    The object is read once this reconcile holds the object's lock, never taken from the event
    that triggered it: a body that waited for the lock may be older than the one a reconcile
    before it wrote, and applying its children would roll the Deployment back until the next
    event. A ``uid`` (of a child's owner reference) limits it to that incarnation. Re-reads the
    object and starts over when its status write conflicts (the object changed meanwhile).

    Raises:
        kopf.TemporaryError: API conflicts or outages outlasted the retries (retried after
            ``retry_delay``), or a child still belongs to a deleted LLMDeployment of the same
            name (retried after ``STALE_OWNER_DELAY``).
    """
    current: dict[str, Any] | None = None
    with rt.metrics.track(trigger) as outcome, _object_lock(namespace, name):
        try:
            for _ in range(STATUS_CONFLICT_ATTEMPTS):
                current = rt.client.get(API_VERSION, KIND, namespace, name)
                if (
                    current is None
                    or current["metadata"].get("deletionTimestamp")
                    or uid not in (None, current["metadata"].get("uid"))
                ):
                    return
                try:
                    outcome.changed = _reconcile_once(rt, current)
                    return
                except KubeApiError as exc:
                    if exc.status != 409:
                        raise
            raise TransientApiError(f"status of {namespace}/{name} kept conflicting")
        except StaleOwner as exc:
            outcome.error_reason = "StaleOwner"
            raise kopf.TemporaryError(
                str(exc), delay=min(STALE_OWNER_DELAY, rt.config.retry_delay)
            ) from exc
        except (TransientApiError, KubeApiError, urllib3.exceptions.HTTPError) as exc:
            outcome.error_reason = "ApiError"
            if current is not None:
                rt.post_event(current, Event("Warning", "ReconcileFailed", str(exc)))
            raise kopf.TemporaryError(
                f"reconcile of {namespace}/{name} failed: {exc}",
                delay=rt.config.retry_delay,
            ) from exc


# ---- kopf wiring ------------------------------------------------------------------------------


def operator_settings(
    *, scanning: bool, watch_timeout: float = WATCH_TIMEOUT
) -> kopf.OperatorSettings:
    """kopf settings for the operator.

    Args:
        scanning: whether kopf scans the cluster for namespaces (globs) and the CRD; off when
            it watches listed namespaces only (a namespaced install has no ClusterRole for it).
        watch_timeout: whole seconds the API server keeps a watch open before it ends it
            (kopf then starts a new one; the API server refuses a fraction); the client gives
            up on a silent watch a little later, so a dropped connection is noticed.
    """
    settings = kopf.OperatorSettings()
    # kopf would post an Event for every handler run; the handlers post the meaningful ones.
    settings.posting.level = logging.WARNING
    settings.scanning.disabled = not scanning
    settings.watching.server_timeout = watch_timeout
    settings.watching.client_timeout = watch_timeout + 30
    settings.watching.connect_timeout = 30
    # Only the operator's own children and pods are listed and watched (server-side).
    for resource in (
        ("apps", "v1", "deployments"),
        ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),
        ("", "v1", "pods"),
    ):
        settings.watching.label_selectors[resource] = manifests.LLMDEPLOYMENT_LABEL
    return settings


def _owner(child: kopf.Body) -> tuple[str, str] | None:
    """The name and uid of the LLMDeployment that ``child``'s owner reference names, if any."""
    for ref in child.metadata.get("ownerReferences") or []:
        if ref.get("apiVersion") == API_VERSION and ref.get("kind") == KIND:
            return ref["name"], ref.get("uid", "")
    return None


def _pod_state(body: kopf.Body) -> tuple[Any, ...]:
    status = body.get("status") or {}
    waiting = tuple(
        ((c.get("state") or {}).get("waiting") or {}).get("reason")
        for c in status.get("containerStatuses") or []
    )
    return (
        status.get("phase"),
        pod_condition(dict(body), "PodScheduled").get("status"),
        pod_condition(dict(body), "Ready").get("status"),
        waiting,
    )


def register(registry: kopf.OperatorRegistry, rt: Runtime) -> None:
    """Add the reconcile handlers to ``registry`` (nothing registers at import time)."""

    def on_llmdeployment(trigger: str) -> Callable[..., None]:
        def handle(body: kopf.Body, **_: Any) -> None:
            reconcile(rt, body.metadata["namespace"], body.metadata["name"], trigger)

        return handle

    for trigger, decorator in (
        ("create", kopf.on.create),
        ("update", kopf.on.update),
        ("resume", kopf.on.resume),
    ):
        decorator(
            GROUP, VERSION, PLURAL, id="reconcile", backoff=rt.config.retry_delay, registry=registry
        )(on_llmdeployment(trigger))

    def child_changed(body: kopf.Body, **_: Any) -> None:
        owner = _owner(body)
        if owner is not None:
            reconcile(rt, body.metadata["namespace"], owner[0], "child", uid=owner[1])

    kopf.on.event("apps", "v1", "deployments", id="deployment", registry=registry)(child_changed)
    if rt.config.watch_leader_worker_sets:
        kopf.on.event(
            "leaderworkerset.x-k8s.io", "v1", "leaderworkersets", id="lws", registry=registry
        )(child_changed)

    seen: dict[str, tuple[Any, ...]] = {}

    @kopf.on.event("", "v1", "pods", registry=registry)
    def pod_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
        # Pods change often (every probe result); only scheduling and readiness matter here.
        uid = body.metadata.get("uid", "")
        if type == "DELETED":
            seen.pop(uid, None)
            return
        state = _pod_state(body)
        if seen.get(uid) == state:
            return
        seen[uid] = state
        for ref in body.metadata.get("ownerReferences") or []:
            # A Deployment's pods, or a LeaderWorkerSet's leaders (of its leader StatefulSet).
            if ref.get("kind") in ("ReplicaSet", "StatefulSet"):
                name = (body.metadata.get("labels") or {}).get(manifests.LLMDEPLOYMENT_LABEL)
                if name:
                    reconcile(rt, body.metadata["namespace"], name, "pod")

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)


def build_runtime(config: HandlerConfig, metrics: OperatorMetrics) -> Runtime:
    """The one runtime every handler and the autoscaler share.

    Call it after loading the Kubernetes configuration (kubeconfig or in-cluster): the API
    client is built here from it.
    """
    client = KubeClient()
    return Runtime(
        client=client,
        models=ModelConfigCache(client, config.model_config_ttl),
        metrics=metrics,
        config=config,
        post_event=EventSink(client).post,
    )
