"""Multi-node replicas as a LeaderWorkerSet (``leaderworkerset.x-k8s.io/v1``), pure.

A plan with ``nodes_per_replica`` P > 1 (its ``pipeline_parallel_size`` stages outnumber one
node's GPUs) needs P nodes per replica (tensor parallel inside each node, one pipeline stage a
node, Ray actors as the ranks: vLLM's multi-node recipe).
Each replica is one LeaderWorkerSet group of P pods:

- the **leader** (worker index 0) runs ``kvpilot ray-node leader``: a Ray head, then, once the
  group's P nodes have joined, ``kvpilot serve ... --distributed-executor-backend ray
  --pipeline-parallel-size P``. It carries the LLMDeployment's selector labels, so the
  Service, the PodDisruptionBudget, the metrics scraper and the autoscaler see leaders only;
- the **workers** (indexes 1..P-1) run ``kvpilot ray-node worker --address
  $(LWS_LEADER_ADDRESS)`` (the variable the LWS webhook injects; Kubernetes expands it in
  ``args``): a Ray node joining the leader's head. They carry ``WORKER_OF_LABEL`` instead of
  the selector label.

``restartPolicy: RecreateGroupOnPodRestart``: a failed pod recreates its whole group (a Ray
cluster does not survive the loss of a rank). ``startupPolicy: LeaderCreated``: the workers
start with the leader, not after it is Ready (it is Ready only once they have joined). Updates
roll one group at a time without a surge group (GPUs are scarce). Live tuning canaries are not
rendered for multi-node replicas.
"""

from __future__ import annotations

import copy
from typing import Any

from kvpilot.operator.manifests import (
    LLMDEPLOYMENT_LABEL,
    TEMPLATE_HASH_ANNOTATION,
    labels,
    pod_template,
    template_hash,
)
from kvpilot.operator.planner import Plan
from kvpilot.operator.spec import LLMDeploymentSpec

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
GROUP_VERSION_PATH = "/apis/leaderworkerset.x-k8s.io/v1"
"""Discovery path that answers 404 while the LeaderWorkerSet CRD is not installed."""
WORKER_OF_LABEL = "kvpilot.dev/worker-of"
"""Label of an LLMDeployment's worker pods (value: the LLMDeployment's name)."""
RAY_PORT = 6379
"""The Ray head's GCS port on the leader (Ray's default)."""


def is_multi_node(plan: Plan) -> bool:
    """Whether ``plan`` needs more than one node per replica (a LeaderWorkerSet)."""
    return plan.nodes_per_replica > 1


def worker_labels(name: str) -> dict[str, str]:
    """Labels of the worker pods: the recommended labels without the selector label."""
    out = {k: v for k, v in labels(name).items() if k != LLMDEPLOYMENT_LABEL}
    out["app.kubernetes.io/component"] = "engine-worker"
    out[WORKER_OF_LABEL] = name
    return out


def leader_worker_set(
    name: str, namespace: str, spec: LLMDeploymentSpec, plan: Plan
) -> dict[str, Any]:
    """The LeaderWorkerSet of a multi-node ``plan``: ``spec.replicas`` groups of
    ``plan.nodes_per_replica`` pods, each pod with ``plan.tensor_parallel_size`` GPUs.

    Raises:
        ValueError: ``plan`` fits one node (render a Deployment instead).
    """
    if not is_multi_node(plan):
        raise ValueError("a single-node plan is rendered as a Deployment, not a LeaderWorkerSet")
    nodes = plan.nodes_per_replica
    leader = pod_template(name, spec, plan)
    engine = leader["spec"]["containers"][0]
    engine["args"] = ["ray-node", "leader", "--nodes", str(nodes), "--", *engine["args"]]
    engine["ports"].append({"name": "ray", "containerPort": RAY_PORT, "protocol": "TCP"})

    worker = copy.deepcopy(leader)
    worker["metadata"] = {"labels": worker_labels(name), "annotations": {}}
    ray_node = worker["spec"]["containers"][0]
    ray_node["name"] = "ray-worker"
    ray_node["args"] = ["ray-node", "worker", "--address", "$(LWS_LEADER_ADDRESS)"]
    ray_node["ports"] = []
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        ray_node.pop(probe, None)

    for template in (leader, worker):
        template["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION] = template_hash(template)
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name)},
        "spec": {
            "replicas": spec.replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
            },
            "leaderWorkerTemplate": {
                "size": nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }
