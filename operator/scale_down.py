"""Safe scale-down: which engine pod the ReplicaSet controller removes when the replicas go down.

Before the reconciler lowers an engine Deployment's ``spec.replicas`` (the autoscaler's
decision, ``kubectl scale``, HPA or KEDA through the scale subresource: every path ends in that
write), it scrapes the ready pods' ``/metrics`` and writes each pod's
``controller.kubernetes.io/pod-deletion-cost``: the ReplicaSet controller deletes pods of
lower cost first (after the unscheduled, pending and unready ones, which go first anyway).
The cost is the pod's rank by (requests in flight: ``vllm:num_requests_running`` +
``vllm:num_requests_waiting``; then prompt tokens its prefix cache has served,
``vllm:prefix_cache_hits_total``): the idlest replica with the least cached traffic goes, so
the fewest streams wait on a drain and the least prefix cache is lost. A pod that was not
scraped (not ready, or no answer) gets 0, below every scraped one. Ranks, not raw counts:
the annotation is an int32, and only the order matters.

What follows the choice: the router stops sending to the pod once it has a
``deletionTimestamp``, the engine container's preStop hook (``kvpilot drain``) waits until its
requests are done, then the kubelet sends SIGTERM (``manifests.TERMINATION_GRACE_SECONDS``
bounds the whole).
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

from kvpilot.operator import manifests
from kvpilot.operator.apply import KubeClient
from kvpilot.operator.scraper import AddressMap, ready_targets, scrape_pods
from kvpilot.operator.signals import MetricSample

logger = logging.getLogger("kvpilot.operator.scale_down")

DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
SCRAPE_TIMEOUT_S = 2.0


def deletion_costs(pods: Sequence[str], samples: Sequence[MetricSample]) -> dict[str, int]:
    """Pod name -> deletion cost (pure): 0 for pods without a sample, else 1 + the pod's rank
    by (in-flight requests, prefix cache hits, name), the idlest first.

    Args:
        pods: the names of the pods to annotate (every live pod of the deployment).
        samples: one scrape of some of them (``MetricSample.pod`` names the pod).
    """
    by_pod = {s.pod: s for s in samples if s.pod in pods}
    ranked = sorted(
        by_pod.values(),
        key=lambda s: (
            s.num_requests_running + s.num_requests_waiting,
            s.prefix_cache_hits_total,
            s.pod,
        ),
    )
    costs = dict.fromkeys(pods, 0)
    costs.update({s.pod: rank + 1 for rank, s in enumerate(ranked)})
    return costs


def mark_for_scale_down(
    client: KubeClient,
    namespace: str,
    name: str,
    address_map: AddressMap | None = None,
) -> dict[str, int]:
    """Scrape the LLMDeployment ``name``'s ready engine pods and write their deletion costs
    (only where the annotation changes); returns the costs.

    Raises:
        KubeApiError: listing or patching the pods was refused.
    """
    query = urllib.parse.urlencode({"labelSelector": manifests.selector(name)})
    items = client.request("GET", f"/api/v1/namespaces/{namespace}/pods?{query}").get("items")
    pods = [p for p in items or [] if not p["metadata"].get("deletionTimestamp")]
    result = asyncio.run(
        scrape_pods(
            ready_targets(pods),
            time.time(),
            address_map=address_map,
            timeout_seconds=SCRAPE_TIMEOUT_S,
        )
    )
    costs = deletion_costs([p["metadata"]["name"] for p in pods], result.samples)
    for pod in pods:
        meta = pod["metadata"]
        cost = str(costs[meta["name"]])
        if (meta.get("annotations") or {}).get(DELETION_COST_ANNOTATION) == cost:
            continue
        ref = {"apiVersion": "v1", "kind": "Pod", "metadata": meta}
        client.patch(ref, {"metadata": {"annotations": {DELETION_COST_ANNOTATION: cost}}})
    logger.info("%s/%s: scale-down deletion costs %s", namespace, name, costs)
    return costs


def lowers_replicas(live: dict[str, Any] | None, desired: dict[str, Any]) -> bool:
    """Whether applying the Deployment ``desired`` over ``live`` lowers its replicas."""
    if live is None:
        return False
    current = (live.get("spec") or {}).get("replicas", 1)
    return desired["spec"]["replicas"] < current
