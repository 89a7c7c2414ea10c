"""An LLMDeployment's children as plain dicts: spec + plan -> Deployment, Service, PDB (pure).

The handlers adopt these (``kopf.adopt`` adds the owner reference) and create or patch them.
Every object carries the same labels; the pods are selected by ``LLMDEPLOYMENT_LABEL`` alone,
which never changes, because a Deployment's selector is immutable.

The pod template carries ``TEMPLATE_HASH_ANNOTATION``, a hash of the template itself: any spec or
plan change that alters the pods changes it, which rolls the Deployment, and the handlers compare
it with the live object's to skip a patch when nothing changed.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kvpilot.operator.planner import Plan
from kvpilot.operator.spec import LLMDeploymentSpec

LLMDEPLOYMENT_LABEL = "kvpilot.dev/llmdeployment"
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


def selector_labels(name: str) -> dict[str, str]:
    """The labels that select an LLMDeployment's pods (Deployment, Service, PDB selectors)."""
    return {LLMDEPLOYMENT_LABEL: name}


def labels(name: str) -> dict[str, str]:
    """Labels of every child object and pod (recommended ``app.kubernetes.io`` labels)."""
    return {
        "app.kubernetes.io/name": "kvpilot-engine",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/managed-by": "kvpilot-operator",
        **selector_labels(name),
    }


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


def engine_args(spec: LLMDeploymentSpec, plan: Plan) -> list[str]:
    """The ``kvpilot serve`` arguments (vLLM's flag names) from the spec and the plan.

    The plan's numbers are passed explicitly (not left to the engine's defaults), so the engine
    sizes itself as the planner did. ``engine.extraArgs`` come last.
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
        "--max-model-len", str(plan.max_model_len),
        "--max-num-seqs", str(plan.max_num_seqs),
        "--max-num-batched-tokens", str(plan.max_num_batched_tokens),
        "--block-size", str(plan.block_size),
    ]  # fmt: skip
    if plan.gpu_memory_utilization is None:
        args += ["--kv-cache-memory", str(plan.kv_cache_bytes_per_gpu)]
    else:
        args += ["--gpu-memory-utilization", f"{plan.gpu_memory_utilization:g}"]
    engine = spec.engine
    for flag, value in (
        ("enable-prefix-caching", engine.enable_prefix_caching),
        ("enable-chunked-prefill", engine.enable_chunked_prefill),
    ):
        if value is not None:
            args.append(f"--{flag}" if value else f"--no-{flag}")
    if engine.speculative_config is not None:
        args += ["--speculative-config", json.dumps(engine.speculative_config, sort_keys=True)]
    return args + list(engine.extra_args)


def deployment(name: str, namespace: str, spec: LLMDeploymentSpec, plan: Plan) -> dict[str, Any]:
    """The engine Deployment (``apps/v1``): ``spec.replicas`` pods of ``plan``'s shape.

    GPU mode rolls one pod at a time without a surge pod (GPUs are scarce: a surge pod would
    often stay Pending); CPU mode surges one pod so there is no gap in service.
    """
    template = pod_template(name, spec, plan)
    template_hash = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]
    template["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION] = template_hash
    rolling = (
        {"maxSurge": 1, "maxUnavailable": 0}
        if spec.gpu is None
        else {"maxSurge": 0, "maxUnavailable": 1}
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": labels(name),
            "annotations": {TEMPLATE_HASH_ANNOTATION: template_hash},
        },
        "spec": {
            "replicas": spec.replicas,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector_labels(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling},
            "template": template,
        },
    }


def pod_template(name: str, spec: LLMDeploymentSpec, plan: Plan) -> dict[str, Any]:
    """The engine pod template (without the template hash annotation)."""
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
        "terminationGracePeriodSeconds": 60,
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
    if spec.affinity:
        pod_spec["affinity"] = spec.affinity
    return {
        "metadata": {
            "labels": labels(name),
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(HTTP_PORT),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": pod_spec,
    }


def service(name: str, namespace: str) -> dict[str, Any]:
    """The ClusterIP Service in front of the engine pods, port ``HTTP_PORT``."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name)},
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name),
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

    ReadWriteMany, because every replica mounts it: the first pod downloads, the others reuse.
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
            "accessModes": ["ReadWriteMany"],
            "storageClassName": cache.storage_class_name,
            "volumeMode": "Filesystem",
            "resources": {"requests": {"storage": cache.size}},
        },
    }


def children(
    name: str, namespace: str, spec: LLMDeploymentSpec, plan: Plan
) -> list[dict[str, Any]]:
    """Every child object, in the order to create them (the claim before the pods using it)."""
    objects = [model_cache_claim(name, namespace, spec)]
    objects += [deployment(name, namespace, spec, plan), service(name, namespace)]
    objects.append(pod_disruption_budget(name, namespace))
    return [obj for obj in objects if obj is not None]


def _engine_container(
    spec: LLMDeploymentSpec, plan: Plan, mounts: list[dict[str, Any]]
) -> dict[str, Any]:
    resources = {part: dict(values) for part, values in (spec.resources or {}).items()}
    if spec.gpu is not None:
        # Extended resources must have requests == limits; setting the limit implies it.
        resources.setdefault("limits", {})[spec.gpu.resource_name] = str(plan.gpus_per_replica)
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
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }


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
    if spec.model.hf_token_secret_name:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {
                    "secretKeyRef": {
                        "name": spec.model.hf_token_secret_name,
                        "key": spec.model.hf_token_secret_key,
                    }
                },
            }
        )
    user_names = {item["name"] for item in spec.env}
    return [item for item in env if item["name"] not in user_names] + list(spec.env)


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
    if plan.tensor_parallel_size > 1:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts
