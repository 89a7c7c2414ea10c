"""An LLMDeployment's children as plain dicts: spec + plan -> Deployment, Service, PDB, and the
model cache claim (pure).

The handlers add the owner reference and server-side apply them. Every object carries the
same labels; the pods are selected by ``LLMDEPLOYMENT_LABEL`` alone, which never changes,
because a Deployment's selector is immutable.

The pod template carries ``TEMPLATE_HASH_ANNOTATION``, a hash of the template itself, so
``kubectl describe`` shows at a glance whether two ReplicaSets run the same pods.

GPU pods ask for the GPU count and for nodes of the planned GPU type: a required node affinity
on GPU Feature Discovery's ``nvidia.com/gpu.product`` label (the type's products), so an
H100 plan never lands on an L4 node. A ``spec.nodeSelector`` on that label replaces it.

Live engine tuning (:class:`kvpilot.operator.tuning.Rollout`, recorded by the autoscaler) is
rendered here too. ``Canary``: a second Deployment ``<name>-canary`` runs one of the replicas
with the tuned ``settings`` (pods labelled ``CANARY_LABEL``), the main Deployment the rest with
``previous``; the Service and the PodDisruptionBudget select both. ``Applied``: every replica
runs ``settings``; ``RolledBack``: every replica runs ``previous`` (the plan's when None). Once
a rollout exists the canary Deployment stays, at 0 replicas outside ``Canary``, so no verb
beyond create and patch is needed to retire it.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from kvpilot.argv import flag_name
from kvpilot.operator.gpus import PRODUCT_LABEL
from kvpilot.operator.planner import Plan
from kvpilot.operator.spec import Adapter, LLMDeploymentSpec
from kvpilot.operator.tuning import CANARY_LABEL, EngineSettings, Rollout

LLMDEPLOYMENT_LABEL = "kvpilot.dev/llmdeployment"
# app.kubernetes.io/managed-by names the tool that manages an object (Kubernetes' recommended
# labels: "helm" for what Helm installs). The operator's children are managed by the operator,
# whose name is kvpilot-operator; part-of names the application both halves belong to.
MANAGED_BY = "kvpilot-operator"
PART_OF = "kvpilot"
CANARY_SUFFIX = "-canary"
TEMPLATE_HASH_ANNOTATION = "kvpilot.dev/template-hash"
HTTP_PORT = 8000
MODEL_CACHE_PATH = "/models/cache"
PVC_MODELS_PATH = "/models/pvc"
RUN_AS_USER = 1000
# NCCL exchanges tensors through /dev/shm between the ranks of one pod; Docker's 64 MiB default
# is too small (vLLM's Kubernetes guide mounts a memory emptyDir).
SHM_SIZE = "2Gi"
# Model downloads and GGUF conversions can take long: the startup probe allows an hour.
STARTUP_PERIOD_SECONDS = 10
STARTUP_FAILURE_THRESHOLD = 360
# The Deployment controller reports ProgressDeadlineExceeded after this long without progress
# (default 600 s): longer than the startup probe allows, or every slow start would be reported
# as a failure while the kubelet still waits for it.
PROGRESS_DEADLINE_SECONDS = STARTUP_PERIOD_SECONDS * STARTUP_FAILURE_THRESHOLD + 600
# Adapters resident in the engine at once (--max-loras): each slot holds one adapter's weights
# on the device; more adapters than slots are swapped in least-recently-used order, from host
# copies of them all (--max-cpu-loras: the number of adapters). The LoRA
# flags are not reserved: engine.extraArgs (which come last) may override them, e.g.
# --max-lora-rank for adapters above the engine's default rank 16.
MAX_RESIDENT_ADAPTERS = 8
# A scale-down or rollout deletes an engine pod: its preStop hook (kvpilot drain) waits until its
# requests are done, then SIGTERM; the grace period bounds both, so it must cover a long
# generation (a few thousand tokens at tens of tokens per second).
TERMINATION_GRACE_SECONDS = 300
DRAIN_MARGIN_SECONDS = 10
"""The drain gives up this long before the grace period ends: SIGTERM still comes early
enough for the engine to close its connections itself."""
ENGINE_SHUTDOWN_SECONDS = DRAIN_MARGIN_SECONDS // 2
"""The engine's ``--shutdown-timeout``: after SIGTERM it aborts what the drain left running
this soon (each stream ends with an error event), and exits before the kubelet's SIGKILL."""


def selector_labels(name: str) -> dict[str, str]:
    """The labels that select an LLMDeployment's pods (Deployment, Service, PDB selectors)."""
    return {LLMDEPLOYMENT_LABEL: name}


def labels(name: str) -> dict[str, str]:
    """Labels of every child object and pod (recommended ``app.kubernetes.io`` labels)."""
    return {
        "app.kubernetes.io/name": "kvpilot-engine",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/part-of": PART_OF,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        **selector_labels(name),
    }


def canary_name(name: str) -> str:
    """The canary Deployment of the LLMDeployment ``name`` (live tuning)."""
    return f"{name}{CANARY_SUFFIX}"


def canary_selector_labels(name: str) -> dict[str, str]:
    """The labels that select the canary pods (they include ``selector_labels``)."""
    return {**selector_labels(name), CANARY_LABEL: "true"}


def selector(name: str) -> str:
    """``status.selector``: the pods' label selector as a string (for the scale subresource)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def endpoint(name: str, namespace: str) -> str:
    """``status.endpoint``: the OpenAI-compatible base URL inside the cluster."""
    return f"http://{name}.{namespace}.svc.cluster.local:{HTTP_PORT}/v1"


def model_argument(spec: LLMDeploymentSpec) -> str | None:
    """What ``kvpilot serve`` receives as MODEL: hub id, path in the pod, or None (default)."""
    source = spec.model
    if source.scheme == "pvc":
        return "/".join(filter(None, (PVC_MODELS_PATH, source.claim_name, source.location)))
    return source.location


def adapter_argument(adapter: Adapter) -> str:
    """Where ``kvpilot serve`` finds a LoRA adapter: a Hub id (hf://), a path in the pod (file://,
    or pvc://claim/path under the claim's read-only mount)."""
    scheme, _, rest = adapter.source.partition("://")
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        return "/".join(filter(None, (PVC_MODELS_PATH, claim, path.strip("/"))))
    return rest


def engine_args(spec: LLMDeploymentSpec, plan: Plan) -> list[str]:
    """The ``kvpilot serve`` arguments (vLLM's flag names) from the spec and the plan.

    The plan's numbers are passed explicitly (not left to the engine's defaults), so the engine
    sizes itself as the planner did. ``--kv-cache-dtype`` is passed when it is not ``auto``
    (the spec's, or the tuner's), ``--quantization`` when the spec forces one (else the engine
    reads the checkpoint's ``quantization_config``, as vLLM does). ``spec.adapters`` become
    ``--enable-lora --max-loras N --max-cpu-loras M --lora-modules name=path ...`` (M adapters,
    N of them resident at most). A pipelined plan adds ``--pipeline-parallel-size``, and
    ``--distributed-executor-backend ray`` when its replica spans nodes (on one node the stages
    are processes of the pod, vLLM's ``mp`` backend). ``engine.extraArgs`` come last.
    """
    args = ["serve"]
    model = model_argument(spec)
    if model is not None:
        args.append(model)
    if spec.model.revision:
        args += ["--revision", spec.model.revision]
    if spec.model.served_model_name:
        args += ["--served-model-name", spec.model.served_model_name]
    args += [
        "--host", "0.0.0.0",
        "--port", str(HTTP_PORT),
        "--device", "cpu" if spec.gpu is None else "cuda",
        "--dtype", plan.dtype,
        "--tensor-parallel-size", str(plan.tensor_parallel_size),
        *(
            ["--pipeline-parallel-size", str(plan.pipeline_parallel_size)]
            if plan.pipeline_parallel_size > 1 else []
        ),
        *(["--distributed-executor-backend", "ray"] if plan.nodes_per_replica > 1 else []),
        "--max-model-len", str(plan.max_model_len),
        "--max-num-seqs", str(plan.max_num_seqs),
        "--max-num-batched-tokens", str(plan.max_num_batched_tokens),
        "--block-size", str(plan.block_size),
        "--shutdown-timeout", str(ENGINE_SHUTDOWN_SECONDS),
    ]  # fmt: skip
    if plan.gpu_memory_utilization is None:
        args += ["--kv-cache-memory", str(plan.kv_cache_bytes_per_gpu)]
    else:
        args += ["--gpu-memory-utilization", f"{plan.gpu_memory_utilization:g}"]
    engine = spec.engine
    if plan.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", plan.kv_cache_dtype]
    if engine.quantization is not None:
        args += ["--quantization", engine.quantization]
    for flag, value in (
        ("enable-prefix-caching", engine.enable_prefix_caching),
        ("enable-chunked-prefill", engine.enable_chunked_prefill),
    ):
        if value is not None:
            args.append(f"--{flag}" if value else f"--no-{flag}")
    if engine.speculative_config is not None:
        args += ["--speculative-config", json.dumps(engine.speculative_config, sort_keys=True)]
    if spec.adapters:
        args += [
            "--enable-lora",
            "--max-loras",
            str(min(len(spec.adapters), MAX_RESIDENT_ADAPTERS)),
        ]
        # Every listed adapter's weights stay in host memory (vLLM's default keeps --max-loras
        # of them and reads the others from disk again), unless extraArgs size the slots or the
        # host copies themselves: the engine refuses fewer host copies than slots.
        if not _sets_flag(engine.extra_args, ("--max-loras", "--max-cpu-loras")):
            args += ["--max-cpu-loras", str(len(spec.adapters))]
        args += ["--lora-modules", *(f"{a.name}={adapter_argument(a)}" for a in spec.adapters)]
    return args + list(engine.extra_args)


def _sets_flag(args: tuple[str, ...], flags: tuple[str, ...]) -> bool:
    """Whether ``args`` set one of the long ``flags`` (dashes or underscores, ``=value`` or
    not)."""
    return any(flag_name(arg) in flags for arg in args)


def tuned(plan: Plan, settings: EngineSettings | None) -> Plan:
    """``plan`` running the engine ``settings`` live tuning chose (None: the plan's own).

    Only the flags the pods run change; the planner's figures (``status.plan``) stay as planned.
    A CPU plan has no GPU memory to tune and is returned unchanged. The KV cache dtype changes
    only when the settings name one (``auto`` keeps the plan's, e.g. the spec's ``fp8``).
    """
    if settings is None or plan.gpu_memory_utilization is None:
        return plan
    return dataclasses.replace(
        plan,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        max_num_seqs=settings.max_num_seqs,
        kv_cache_dtype=(
            plan.kv_cache_dtype if settings.kv_cache_dtype == "auto" else settings.kv_cache_dtype
        ),
    )


def canary_replicas(spec: LLMDeploymentSpec, rollout: Rollout | None) -> int:
    """Replicas of the canary Deployment: one during ``Canary``, else 0.

    Never the only replica: the canary is judged against the others over the same time, and a
    single replica stays on settings known to work until there are two.
    """
    canary = rollout is not None and rollout.phase == "Canary"
    return 1 if canary and spec.replicas >= 2 else 0


def deployment(
    name: str,
    namespace: str,
    spec: LLMDeploymentSpec,
    plan: Plan,
    rollout: Rollout | None = None,
) -> dict[str, Any]:
    """The engine Deployment (``apps/v1``): ``spec.replicas`` pods of ``plan``'s shape.

    With a tuning ``rollout`` its pods run the settings in force (``Rollout.in_force``), and
    during ``Canary`` one replica fewer (:func:`canary_replicas`). GPU mode rolls one pod at a
    time without a surge pod (GPUs are scarce: a surge pod would often stay Pending); CPU mode
    surges one pod so there is no gap in service.
    """
    settings = rollout.in_force() if rollout is not None else None
    return _deployment(
        name,
        namespace,
        spec,
        pod_template(name, spec, tuned(plan, settings)),
        spec.replicas - canary_replicas(spec, rollout),
        selector_labels(name),
    )


def canary_deployment(
    name: str, namespace: str, spec: LLMDeploymentSpec, plan: Plan, rollout: Rollout | None
) -> dict[str, Any] | None:
    """The canary Deployment ``<name>-canary`` of a tuning ``rollout``, or None without one.

    Its pods run ``rollout.settings`` and carry ``CANARY_LABEL``, so the autoscaler can judge
    them against the others; it has :func:`canary_replicas` replicas. Its selector includes
    the main Deployment's, which is immutable and so cannot exclude the canary pods: each
    ReplicaSet counts only the pods it owns (``ownerReferences``), so the two do not fight.
    """
    if rollout is None:
        return None
    return _deployment(
        canary_name(name),
        namespace,
        spec,
        pod_template(name, spec, tuned(plan, rollout.settings), canary=True),
        canary_replicas(spec, rollout),
        canary_selector_labels(name),
    )


def _deployment(
    deployment_name: str,
    namespace: str,
    spec: LLMDeploymentSpec,
    template: dict[str, Any],
    replicas: int,
    selector: dict[str, str],
) -> dict[str, Any]:
    template["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION] = template_hash(template)
    rolling = (
        {"maxSurge": 1, "maxUnavailable": 0}
        if spec.gpu is None
        else {"maxSurge": 0, "maxUnavailable": 1}
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": deployment_name,
            "namespace": namespace,
            "labels": dict(template["metadata"]["labels"]),
            "annotations": {
                TEMPLATE_HASH_ANNOTATION: template["metadata"]["annotations"][
                    TEMPLATE_HASH_ANNOTATION
                ]
            },
        },
        "spec": {
            "replicas": replicas,
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": PROGRESS_DEADLINE_SECONDS,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling},
            "template": template,
        },
    }


def template_hash(template: dict[str, Any]) -> str:
    """``TEMPLATE_HASH_ANNOTATION``'s value: 16 hex digits of the SHA-256 of the pod template
    (without that annotation)."""
    without = copy.deepcopy(template)
    without["metadata"].get("annotations", {}).pop(TEMPLATE_HASH_ANNOTATION, None)
    return hashlib.sha256(json.dumps(without, sort_keys=True).encode()).hexdigest()[:16]


def gpus_per_pod(plan: Plan) -> int:
    """GPUs one engine pod asks for: the whole replica's, or one node's share when the replica
    spans ``plan.nodes_per_replica`` nodes."""
    return plan.gpus_per_replica // plan.nodes_per_replica


def pod_template(
    name: str, spec: LLMDeploymentSpec, plan: Plan, *, canary: bool = False
) -> dict[str, Any]:
    """The engine pod template (without the template hash annotation); ``canary`` pods carry
    ``CANARY_LABEL``."""
    volumes, mounts = _volumes(name, spec, plan)
    tolerations = list(spec.tolerations)
    if spec.gpu is not None:
        # Clouds taint GPU nodes with the device plugin's resource name.
        tolerations.insert(
            0, {"key": spec.gpu.resource_name, "operator": "Exists", "effect": "NoSchedule"}
        )
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_engine_container(spec, plan, mounts)],
        "volumes": volumes,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    affinity = _affinity(spec)
    if affinity:
        pod_spec["affinity"] = affinity
    return {
        "metadata": {
            "labels": {**labels(name), CANARY_LABEL: "true"} if canary else labels(name),
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(HTTP_PORT),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": pod_spec,
    }


def gpu_node_requirement(spec: LLMDeploymentSpec) -> dict[str, Any] | None:
    """The node selector requirement that places a replica on its GPU type, or None (CPU mode,
    a ``custom`` type, or ``spec.nodeSelector`` already choosing the product)."""
    if spec.gpu is None or PRODUCT_LABEL in (spec.node_selector or {}):
        return None
    products = spec.gpu.gpu_type().products
    if not products:
        return None
    return {"key": PRODUCT_LABEL, "operator": "In", "values": list(products)}


def _affinity(spec: LLMDeploymentSpec) -> dict[str, Any] | None:
    """``spec.affinity`` with :func:`gpu_node_requirement` added to every required node
    selector term (terms are ORed, requirements within one ANDed)."""
    affinity = copy.deepcopy(spec.affinity) if spec.affinity else {}
    requirement = gpu_node_requirement(spec)
    if requirement is not None:
        node = affinity.setdefault("nodeAffinity", {})
        required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
        terms = required.setdefault("nodeSelectorTerms", [])
        if not terms:
            terms.append({})
        for term in terms:
            term.setdefault("matchExpressions", []).append(requirement)
    return affinity or None


def service(name: str, namespace: str) -> dict[str, Any]:
    """The ClusterIP Service in front of the engine pods, port ``HTTP_PORT``."""
    return http_service(name, namespace, labels(name), selector_labels(name))


def http_service(
    name: str, namespace: str, object_labels: dict[str, str], selector: dict[str, str]
) -> dict[str, Any]:
    """A ClusterIP Service ``name`` of port ``HTTP_PORT`` to the ``selector``'s pods' port
    named ``http`` (the engine's, the router's)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": object_labels},
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [
                {
                    "name": "http",
                    "port": HTTP_PORT,
                    "targetPort": "http",
                    "protocol": "TCP",
                    "appProtocol": "http",
                }
            ],
        },
    }


def pod_disruption_budget(name: str, namespace: str) -> dict[str, Any]:
    """A PodDisruptionBudget letting voluntary disruptions (drains) take one pod at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name)},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name)}},
    }


def model_cache_claim_name(name: str, spec: LLMDeploymentSpec) -> str | None:
    """The model cache's PersistentVolumeClaim: the user's, the one the operator creates, or None."""
    cache = spec.model_cache
    if cache is None:
        return None
    if cache.claim_name is not None:
        return cache.claim_name
    return f"{name}-model-cache" if cache.creates_claim else None


def model_cache_claim(name: str, namespace: str, spec: LLMDeploymentSpec) -> dict[str, Any] | None:
    """The PVC the operator creates for ``modelCache: {size, storageClassName}``, else None.

    Every replica mounts it (the first pod downloads, the others reuse): ``accessMode``
    ReadWriteOnce by default, which every block storage class binds (replicas then share it
    only on one node); ReadWriteMany for classes that can.
    """
    cache = spec.model_cache
    if cache is None or not cache.creates_claim:
        return None
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": model_cache_claim_name(name, spec),
            "namespace": namespace,
            "labels": labels(name),
        },
        "spec": {
            "accessModes": [cache.access_mode],
            "storageClassName": cache.storage_class_name,
            "volumeMode": "Filesystem",
            "resources": {"requests": {"storage": cache.size}},
        },
    }


@dataclasses.dataclass(frozen=True)
class ClaimUpdate:
    """The claim to apply over a live one, and what of the desired spec had to be left out."""

    desired: dict[str, Any]
    refused: str = ""


def claim_update(desired: dict[str, Any], live: dict[str, Any] | None) -> ClaimUpdate:
    """``desired`` (a :func:`model_cache_claim`) as it may be applied over the ``live`` claim.

    A claim's spec is immutable once created, except that a bound claim's storage request may
    grow (expansion, if its class allows it): the live access modes, class and volume mode are
    kept, and a smaller size, or a larger one before the claim is bound, keeps the live size.
    ``refused`` says which change was left out and how to get it (delete the claim), or is
    empty.
    """
    if live is None:
        return ClaimUpdate(desired)
    out = copy.deepcopy(desired)
    spec, live_spec = out["spec"], live.get("spec") or {}
    name = desired["metadata"]["name"]
    refused = []
    for key in ("accessModes", "storageClassName", "volumeMode"):
        if key in live_spec and spec.get(key) != live_spec[key]:
            refused.append(f"{key} {live_spec[key]!r} -> {spec.get(key)!r}")
            spec[key] = live_spec[key]
    wanted = spec["resources"]["requests"]["storage"]
    current = ((live_spec.get("resources") or {}).get("requests") or {}).get("storage")
    if current is not None and parse_quantity(wanted) != parse_quantity(current):
        bound = (live.get("status") or {}).get("phase") == "Bound"
        if parse_quantity(wanted) < parse_quantity(current) or not bound:
            why = "a claim cannot shrink" if bound else "the claim is not bound yet"
            refused.append(f"size {current} -> {wanted} ({why})")
            spec["resources"]["requests"]["storage"] = current
    message = ""
    if refused:
        message = (
            f"PersistentVolumeClaim {name} keeps its spec ({'; '.join(refused)}): a claim's spec is "
            f"immutable but for a bound claim's size; delete the claim to recreate it with the new one"
        )
    return ClaimUpdate(out, message)


def children(
    name: str,
    namespace: str,
    spec: LLMDeploymentSpec,
    plan: Plan,
    rollout: Rollout | None = None,
) -> list[dict[str, Any]]:
    """Every child object, in the order to create them (the claim before the pods using it).

    ``rollout`` is the live tuning to render (see the module docstring), or None. A plan that
    spans several nodes per replica gets a LeaderWorkerSet instead of the Deployments
    (:mod:`kvpilot.operator.leaderworkerset`; no tuning canary).
    """
    from kvpilot.operator import leaderworkerset  # it builds on this module's pod template

    if leaderworkerset.is_multi_node(plan):
        workloads = [leaderworkerset.leader_worker_set(name, namespace, spec, plan)]
    else:
        workloads = [
            deployment(name, namespace, spec, plan, rollout),
            canary_deployment(name, namespace, spec, plan, rollout),
        ]
    objects = [
        model_cache_claim(name, namespace, spec),
        *workloads,
        service(name, namespace),
        pod_disruption_budget(name, namespace),
    ]
    return [obj for obj in objects if obj is not None]


def _engine_container(
    spec: LLMDeploymentSpec, plan: Plan, mounts: list[dict[str, Any]]
) -> dict[str, Any]:
    resources = {part: dict(values) for part, values in (spec.resources or {}).items()}
    if spec.gpu is not None:
        # Extended resources must have requests == limits; setting the limit implies it.
        resources.setdefault("limits", {})[spec.gpu.resource_name] = str(gpus_per_pod(plan))
    return {
        "name": "engine",
        "image": spec.image,
        "command": ["kvpilot"],
        "args": engine_args(spec, plan),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "env": _env(spec),
        "resources": resources,
        "volumeMounts": mounts,
        "startupProbe": _probe(STARTUP_PERIOD_SECONDS, STARTUP_FAILURE_THRESHOLD),
        "readinessProbe": _probe(5, 3),
        "livenessProbe": _probe(15, 4),
        "lifecycle": {"preStop": {"exec": {"command": drain_command()}}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def drain_command() -> list[str]:
    """The engine container's preStop hook: ``kvpilot drain`` (``operator/drain.py``) waits until
    the engine has no request left, within the grace period."""
    timeout = TERMINATION_GRACE_SECONDS - DRAIN_MARGIN_SECONDS
    return [
        "kvpilot", "drain", "--url", f"http://127.0.0.1:{HTTP_PORT}", "--timeout", str(timeout),
    ]  # fmt: skip


def _probe(period_seconds: int, failure_threshold: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": period_seconds,
        "timeoutSeconds": 5,
        "failureThreshold": failure_threshold,
    }


def _env(spec: LLMDeploymentSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        # The root filesystem is read-only: caches (Triton, torch) go to the /tmp emptyDir.
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": f"{MODEL_CACHE_PATH}/huggingface"},
        {"name": "KVPILOT_CACHE_DIR", "value": f"{MODEL_CACHE_PATH}/kvpilot"},
    ]
    env += hf_token_env(spec)
    user_names = {item["name"] for item in spec.env}
    return [item for item in env if item["name"] not in user_names] + list(spec.env)


def hf_token_env(spec: LLMDeploymentSpec) -> list[dict[str, Any]]:
    """``HF_TOKEN`` from the spec's token Secret (``spec.model.hfTokenSecretRef``), or nothing."""
    if not spec.model.hf_token_secret_name:
        return []
    ref = {"name": spec.model.hf_token_secret_name, "key": spec.model.hf_token_secret_key}
    return [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}}]


def _volumes(
    name: str, spec: LLMDeploymentSpec, plan: Plan
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    claim = model_cache_claim_name(name, spec)
    if claim is not None:
        cache: dict[str, Any] = {"persistentVolumeClaim": {"claimName": claim}}
    elif spec.model_cache is not None and spec.model_cache.size is not None:
        cache = {"emptyDir": {"sizeLimit": spec.model_cache.size}}
    else:
        cache = {"emptyDir": {}}
    volumes = [{"name": "model-cache", **cache}, {"name": "tmp", "emptyDir": {}}]
    mounts = [
        {"name": "model-cache", "mountPath": MODEL_CACHE_PATH},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if spec.model.scheme == "pvc":
        volumes.append(
            {
                "name": "model-source",
                "persistentVolumeClaim": {"claimName": spec.model.claim_name, "readOnly": True},
            }
        )
        mounts.append(
            {
                "name": "model-source",
                "mountPath": f"{PVC_MODELS_PATH}/{spec.model.claim_name}",
                "readOnly": True,
            }
        )
    for i, claim in enumerate(_adapter_claims(spec)):
        volumes.append(
            {
                "name": f"adapter-source-{i}",
                "persistentVolumeClaim": {"claimName": claim, "readOnly": True},
            }
        )
        mounts.append(
            {
                "name": f"adapter-source-{i}",
                "mountPath": f"{PVC_MODELS_PATH}/{claim}",
                "readOnly": True,
            }
        )
    if plan.tensor_parallel_size > 1 or plan.pipeline_parallel_size > 1:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts


def _adapter_claims(spec: LLMDeploymentSpec) -> list[str]:
    """Claims of pvc:// adapters not already mounted for the model, in order of appearance."""
    claims = [
        adapter.source.removeprefix("pvc://").partition("/")[0]
        for adapter in spec.adapters
        if adapter.source.startswith("pvc://")
    ]
    mounted = {spec.model.claim_name} if spec.model.scheme == "pvc" else set()
    return [c for c in dict.fromkeys(claims) if c not in mounted]
