"""An LLMDeployment's router children as plain dicts (pure): the router Deployment and Service,
its ServiceAccount, and the Role and RoleBinding of exactly what it calls.

One router per LLMDeployment (docs/architecture.md says why): ``<name>-router`` runs
``kvpilot router --kubernetes --namespace NS --llmdeployment NAME`` (router/kubernetes.py), in
the operator's engine image (the router is part of kvpilot), behind the ClusterIP Service
``<name>-router`` on port ``HTTP_PORT``; ``status.endpoint`` points at that Service. Its pods
carry ``ROUTER_LABEL``, never ``LLMDEPLOYMENT_LABEL``: the engine Deployment's selector, its
Service and its PodDisruptionBudget must not select them.

The router's Role: ``list`` and ``watch`` on pods (a Role cannot narrow pods by label; the
router asks for its engine pods' label only), and ``list``, ``watch`` and ``patch`` on its own
LLMDeployment, by name (the watch's field selector ``metadata.name``, and the wake request).
The operator can grant these because it holds them itself (RBAC's escalation check).

The router's tokenizer (prefix affinity) is the model's own where the router pod can read it
without the engine's volumes: a Hub id (``hf://``, with the spec's token Secret) or a path in
the image (``file://``). The built-in model (its tokenizer comes from a GGUF conversion that
would cost the router pod a model's worth of memory) and ``pvc://`` models (a ReadWriteOnce
claim cannot follow the router to another node) are routed by consistent hashing.
"""

from __future__ import annotations

import hashlib
from typing import Any

from kvpilot.operator import manifests
from kvpilot.operator.manifests import HTTP_PORT, RUN_AS_USER
from kvpilot.operator.spec import LLMDeploymentSpec

ROUTER_LABEL = "kvpilot.dev/router"
"""Selects an LLMDeployment's router pods (value: the LLMDeployment's name)."""
ROUTER_SUFFIX = "-router"
NAME_MAX_LENGTH = 63
"""A Service name is a DNS-1035 label."""
RESOURCES = {
    "requests": {"cpu": "100m", "memory": "256Mi"},
    # A Hub tokenizer (tokenizer.json of a 150k vocabulary) and aiohttp's buffers.
    "limits": {"memory": "1Gi"},
}
RBAC_API = "rbac.authorization.k8s.io/v1"


def router_name(name: str) -> str:
    """``<name>-router``; a name too long for a Service keeps a hash of the rest instead."""
    full = f"{name}{ROUTER_SUFFIX}"
    if len(full) <= NAME_MAX_LENGTH:
        return full
    digest = hashlib.sha256(name.encode()).hexdigest()[:6]
    keep = NAME_MAX_LENGTH - len(ROUTER_SUFFIX) - len(digest) - 1
    return f"{name[:keep].rstrip('-')}-{digest}{ROUTER_SUFFIX}"


def router_enabled(spec: LLMDeploymentSpec, operator_default: bool) -> bool:
    """Whether ``spec`` gets a router: ``spec.router.enabled`` false turns it off, and so does
    an operator started with ``--no-router`` (the chart's ``router.enabled: false``)."""
    return operator_default and spec.router.enabled


def endpoint(name: str, namespace: str) -> str:
    """``status.endpoint`` with the router: its Service's OpenAI base URL."""
    return f"http://{router_name(name)}.{namespace}.svc.cluster.local:{HTTP_PORT}/v1"


def selector_labels(name: str) -> dict[str, str]:
    """The labels that select the router pods of the LLMDeployment ``name``."""
    return {ROUTER_LABEL: name}


def labels(name: str) -> dict[str, str]:
    """Labels of every router object and pod: the engine's (``manifests.labels``) as the
    router component, without the engine pods' selector label."""
    engine = manifests.labels(name)
    del engine[manifests.LLMDEPLOYMENT_LABEL]
    return {
        **engine,
        "app.kubernetes.io/name": "kvpilot-router",
        "app.kubernetes.io/component": "router",
        **selector_labels(name),
    }


def tokenizer_argument(spec: LLMDeploymentSpec) -> str | None:
    """``--tokenizer`` for the router: a Hub id or an image path, else None (see above)."""
    if spec.model.scheme in ("hf", "file"):
        return spec.model.location
    return None


def router_args(name: str, namespace: str, spec: LLMDeploymentSpec) -> list[str]:
    """The ``kvpilot router`` arguments of the LLMDeployment ``name``."""
    args = [
        "router",
        "--kubernetes",
        "--namespace", namespace,
        "--llmdeployment", name,
        "--host", "0.0.0.0",
        "--port", str(HTTP_PORT),
        "--wake-timeout", str(spec.router.wake_timeout_seconds),
    ]  # fmt: skip
    tokenizer = tokenizer_argument(spec)
    if tokenizer is not None:
        args += ["--tokenizer", tokenizer]
    return args


def _meta(name: str, namespace: str) -> dict[str, Any]:
    return {"name": router_name(name), "namespace": namespace, "labels": labels(name)}


def deployment(name: str, namespace: str, spec: LLMDeploymentSpec, image: str) -> dict[str, Any]:
    """The router Deployment: one pod running ``router_args`` in ``image``.

    Its readiness probe reads ``/metrics``, which answers as soon as the router serves: the
    router must stay reachable while its deployment is at zero replicas (it is what wakes
    it), so ``/health`` (503 without a replica) cannot be its probe.
    """
    env = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/tmp/huggingface"},
    ]
    if spec.model.scheme == "hf":
        env += manifests.hf_token_env(spec)
    probe = {
        "httpGet": {"path": "/metrics", "port": "http"},
        "periodSeconds": 10,
        "timeoutSeconds": 5,
        "failureThreshold": 3,
    }
    container = {
        "name": "router",
        "image": image,
        "command": ["kvpilot"],
        "args": router_args(name, namespace, spec),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "env": env,
        "resources": {part: dict(values) for part, values in RESOURCES.items()},
        "readinessProbe": probe,
        "livenessProbe": {**probe, "periodSeconds": 20},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, namespace),
        "spec": {
            "replicas": 1,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector_labels(name)},
            "template": {
                "metadata": {"labels": labels(name)},
                "spec": {
                    "serviceAccountName": router_name(name),
                    "enableServiceLinks": False,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": RUN_AS_USER,
                        "runAsGroup": RUN_AS_USER,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [container],
                    "volumes": [{"name": "tmp", "emptyDir": {}}],
                },
            },
        },
    }


def service(name: str, namespace: str) -> dict[str, Any]:
    """The router's ClusterIP Service, port ``HTTP_PORT`` (``status.endpoint``)."""
    return manifests.http_service(router_name(name), namespace, labels(name), selector_labels(name))


def service_account(name: str, namespace: str) -> dict[str, Any]:
    """The router pods' ServiceAccount."""
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(name, namespace)}


def role(name: str, namespace: str) -> dict[str, Any]:
    """What the router calls, and nothing more (see the module docstring)."""
    return {
        "apiVersion": RBAC_API,
        "kind": "Role",
        "metadata": _meta(name, namespace),
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
            {
                "apiGroups": ["kvpilot.dev"],
                "resources": ["llmdeployments"],
                "resourceNames": [name],
                "verbs": ["list", "watch", "patch"],
            },
        ],
    }


def role_binding(name: str, namespace: str) -> dict[str, Any]:
    """Binds ``role`` to ``service_account``."""
    return {
        "apiVersion": RBAC_API,
        "kind": "RoleBinding",
        "metadata": _meta(name, namespace),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": router_name(name),
        },
        "subjects": [{"kind": "ServiceAccount", "name": router_name(name), "namespace": namespace}],
    }


def children(
    name: str, namespace: str, spec: LLMDeploymentSpec, image: str
) -> list[dict[str, Any]]:
    """The router's objects, in the order to create them (the account and its rights before
    the pods that use them)."""
    return [
        service_account(name, namespace),
        role(name, namespace),
        role_binding(name, namespace),
        deployment(name, namespace, spec, image),
        service(name, namespace),
    ]
