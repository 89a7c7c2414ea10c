"""Multi-node replicas on a real control plane with the real LeaderWorkerSet controller
(``sigs.k8s.io/lws``, built from its Go module with its webhooks; tests/cluster/lws.py).

The pods use an image the kubelet stand-in runs no process for (they are Running and Ready at
once): what is shown here is the Kubernetes side (admission by the LWS CRD's schema and
webhooks, scheduling of a group over two GPU nodes, leader-only selection, recreation of the
group). The Ray cluster the pods would form is tested in the engine's suite.
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from kvpilot.operator import leaderworkerset, manifests
from tests.cluster import Cluster, dump, wait_for
from tests.cluster.specs import NO_ENGINE
from tests.operator.test_leaderworkerset import two_node_plan

pytestmark = pytest.mark.slow


def group_pods(kube: Cluster, namespace: str) -> dict[str, dict]:
    """The LeaderWorkerSet's live pods by name."""
    return {
        p["metadata"]["name"]: p
        for p in kube.items(
            f"/api/v1/namespaces/{namespace}/pods",
            labelSelector="leaderworkerset.sigs.k8s.io/name=big",
        )
        if not p["metadata"].get("deletionTimestamp")
    }


def scheduled(kube: Cluster, namespace: str) -> dict[str, dict] | None:
    pods = group_pods(kube, namespace)
    running = [p for p in pods.values() if p["status"].get("phase") == "Running"]
    return pods if len(pods) == 2 and len(running) == 2 else None


def test_a_two_node_replica_is_scheduled_selected_and_recreated_as_a_group(
    kube: Cluster, namespace: str
):
    spec, plan = two_node_plan()
    spec = dataclasses.replace(spec, image=NO_ENGINE, replicas=1)
    lws = leaderworkerset.leader_worker_set("big", namespace, spec, plan)
    service = manifests.service("big", namespace)
    # Strict field validation: a field the LWS CRD's schema does not know is an error, not
    # silently pruned.
    kube.kubectl("apply", "--validate=strict", "-f", "-", input=yaml.safe_dump_all([lws, service]))

    pods = wait_for(lambda: scheduled(kube, namespace), "the group's two pods Running")
    leader, worker = pods["big-0"], pods["big-0-1"]
    # One group spans two H100 nodes, 8 GPUs each.
    nodes = {leader["spec"]["nodeName"], worker["spec"]["nodeName"]}
    assert len(nodes) == 2 and all(n.startswith("kwok-h100-") for n in nodes), dump(pods)
    # The LWS pod webhook ran: the worker knows its leader (what its args expand).
    env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
    assert env["LWS_LEADER_ADDRESS"] == f"big-0.big.{namespace}"
    assert env["LWS_GROUP_SIZE"] == "2" and env["LWS_WORKER_INDEX"] == "1"

    # The Service (and the PDB and the scraper, which use the same selector) select leaders.
    selector = ",".join(f"{k}={v}" for k, v in service["spec"]["selector"].items())
    selected = kube.items(f"/api/v1/namespaces/{namespace}/pods", labelSelector=selector)
    assert [p["metadata"]["name"] for p in selected] == ["big-0"]

    # Deleting the worker recreates the whole group (RecreateGroupOnPodRestart): a new leader.
    old_leader = leader["metadata"]["uid"]
    kube.kubectl("delete", "pod", "big-0-1", "-n", namespace, "--wait=false")

    def recreated() -> dict | None:
        now = scheduled(kube, namespace)
        return now if now and now["big-0"]["metadata"]["uid"] != old_leader else None

    wait_for(recreated, "the group recreated with a new leader")
