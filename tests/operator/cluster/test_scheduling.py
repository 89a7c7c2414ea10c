"""Scheduling and admission on a real control plane: GPU types, quotas, the model cache claim,
the Deployment's progress deadline, and engine flags a real engine accepts.

Each test shows one of the bugs issue 15 found by reading the operator against Kubernetes; it
fails on the code before the fix. Engine-less pods use an image the kubelet stand-in runs no
process for (they are ready at once); the chunked-prefill test runs a real engine.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from kvpilot.engine.model_shape import ModelShape
from kvpilot.operator import leaderworkerset, manifests
from kvpilot.operator.planner import plan_for_spec
from kvpilot.operator.spec import parse_spec
from tests.cluster import Cluster, condition, dump, wait_for
from tests.cluster.fixtures import pod_visible_model
from tests.cluster.specs import NO_ENGINE, engineless

pytestmark = pytest.mark.slow
CONFIG_405B = pathlib.Path(__file__).parents[1] / "configs" / "Meta-Llama-3.1-405B.json"


def pods(kube: Cluster, namespace: str, name: str) -> list[dict]:
    return [
        p
        for p in kube.items(
            f"/api/v1/namespaces/{namespace}/pods",
            labelSelector=f"kvpilot.dev/llmdeployment={name}",
        )
        if not p["metadata"].get("deletionTimestamp")
    ]


def ready(kube: Cluster, namespace: str, name: str) -> dict | None:
    obj = kube.llmd(namespace, name)
    cond = condition(obj, "Ready")
    generation = (obj or {}).get("metadata", {}).get("generation")
    return (
        obj
        if cond.get("status") == "True" and cond.get("observedGeneration") == generation
        else None
    )


def degraded(kube: Cluster, namespace: str, name: str, reason: str) -> dict | None:
    cond = condition(kube.llmd(namespace, name), "Degraded")
    return cond if cond.get("status") == "True" and cond.get("reason") == reason else None


def test_pods_land_on_nodes_of_the_planned_gpu_type(kube: Cluster, watched, model_config_source):
    """Issue 15, bug 3: on a cluster with H100 and L4 nodes, a plan for one type must run on
    that type (a required node affinity on nvidia.com/gpu.product), also after a change."""
    spec = {
        "model": {"source": model_config_source("Meta-Llama-3-8B")},
        "gpu": {"type": "L4"},
        "engine": {"maxModelLen": 4096},
        "replicas": 3,
        "image": NO_ENGINE,
    }
    kube.create_llmd(watched, "llm", spec)
    wait_for(lambda: ready(kube, watched, "llm"), "three L4 replicas")
    assert {p["spec"]["nodeName"].rsplit("-", 1)[0] for p in pods(kube, watched, "llm")} == {
        "kwok-l4"
    }
    kube.kubectl(
        "patch", "llmd", "llm", "-n", watched, "--type=merge",
        "-p", '{"spec": {"gpu": {"type": "H100-80GB"}}}',
    )  # fmt: skip

    def on_h100() -> bool:
        placed = pods(kube, watched, "llm")
        return len(placed) == 3 and all(
            (p["spec"].get("nodeName") or "").startswith("kwok-h100-") for p in placed
        )

    wait_for(on_h100, "the replicas moved to H100 nodes", timeout=180)
    template = kube.get(f"/apis/apps/v1/namespaces/{watched}/deployments/llm")["spec"]["template"]
    (term,) = template["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [
        {
            "key": "nvidia.com/gpu.product",
            "operator": "In",
            "values": ["NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe"],
        }
    ]


def test_the_progress_deadline_outlasts_the_startup_probe(
    kube: Cluster, watched, model_config_source
):
    """Issue 15, bug 4: the API server defaults progressDeadlineSeconds to 600, shorter than
    the hour the startup probe allows for a download: every slow start would be reported as a
    failed rollout (ProgressDeadlineExceeded, then Degraded) while the pod is still starting."""
    spec = engineless(model_config_source("Meta-Llama-3-8B"), "L4")
    kube.create_llmd(watched, "slow", spec)
    deployment = wait_for(
        lambda: kube.get(f"/apis/apps/v1/namespaces/{watched}/deployments/slow"),
        "the Deployment",
    )
    probe = deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    allowance = probe["periodSeconds"] * probe["failureThreshold"]
    assert deployment["spec"]["progressDeadlineSeconds"] > allowance == 3600
    assert deployment["spec"]["progressDeadlineSeconds"] == manifests.PROGRESS_DEADLINE_SECONDS


def test_an_unbound_claim_and_its_immutable_spec_are_reported(
    kube: Cluster, watched, model_config_source
):
    """Issue 15, bugs 2 and 11: no provisioner binds the model cache claim, so the pods cannot
    be scheduled; the LLMDeployment says so (not just Pending pods). Changing the claim's
    class is refused by the API server (a claim's spec is immutable): the operator keeps the
    claim, says what it could not change, and still rolls out the rest of the spec."""
    spec = {
        "model": {"source": model_config_source("Meta-Llama-3-8B")},
        "gpu": {"type": "L4"},
        "engine": {"maxModelLen": 4096},
        "image": NO_ENGINE,
        "modelCache": {"size": "40Gi", "storageClassName": "standard"},
    }
    kube.create_llmd(watched, "cached", spec)
    cond = wait_for(
        lambda: degraded(kube, watched, "cached", "ModelCacheClaimPending"),
        "the claim reported",
    )
    assert "cached-model-cache" in cond["message"] and "'standard'" in cond["message"], cond
    claim = kube.get(f"/api/v1/namespaces/{watched}/persistentvolumeclaims/cached-model-cache")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    kube.kubectl(
        "patch", "llmd", "cached", "-n", watched, "--type=merge",
        "-p", '{"spec": {"modelCache": {"storageClassName": "fast"}, "engine": {"maxModelLen": 2048}}}',
    )  # fmt: skip
    cond = wait_for(
        lambda: degraded(kube, watched, "cached", "ModelCacheClaimUnchanged"), "the refusal"
    )
    assert "storageClassName 'standard' -> 'fast'" in cond["message"], cond
    assert "delete the claim" in cond["message"]
    claim = kube.get(f"/api/v1/namespaces/{watched}/persistentvolumeclaims/cached-model-cache")
    assert claim["spec"]["storageClassName"] == "standard"
    # The Deployment is not held back by the claim.
    deployment = kube.get(f"/apis/apps/v1/namespaces/{watched}/deployments/cached")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-model-len") + 1] == "2048"


def test_a_quota_that_requires_limits_admits_the_default_pods_and_reports_others(
    kube: Cluster, watched, model_config_source
):
    """Issue 15, bug 12: a ResourceQuota on limits refuses pods without limits. The default
    resources now set them (admitted); a user's requests-only resources are refused by the
    quota, and the ReplicaSet's FailedCreate reaches the LLMDeployment's Degraded condition."""
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": "limits", "namespace": watched},
            "spec": {
                "hard": {
                    "limits.cpu": "64",
                    "limits.memory": "256Gi",
                    "requests.nvidia.com/gpu": "16",
                }
            },
        }
    )
    base = engineless(model_config_source("Meta-Llama-3-8B"), "L4")
    kube.create_llmd(watched, "defaults", base)
    kube.create_llmd(
        watched,
        "unlimited",
        {**base, "resources": {"requests": {"cpu": "2", "memory": "8Gi"}}},
    )
    wait_for(lambda: ready(kube, watched, "defaults"), "the default resources admitted")
    (pod,) = pods(kube, watched, "defaults")
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert {"cpu", "memory", "nvidia.com/gpu"} <= set(limits), limits
    cond = wait_for(
        lambda: degraded(kube, watched, "unlimited", "FailedCreate"), "the quota's refusal"
    )
    assert "limits" in cond["message"], dump(cond)
    assert pods(kube, watched, "unlimited") == []


def test_without_chunked_prefill_the_engine_runs_the_rendered_flags(
    kube: Cluster, watched, tiny_model_dir
):
    """Issue 15, bug 6: with enableChunkedPrefill false and a long context, the planner used to
    render a step budget (8,192) below maxModelLen (32,768), which the engine refuses: a crash
    loop under Sized=True. A real engine (on a simulated H100, run on the CPU) now starts."""
    source = pod_visible_model(
        tiny_model_dir("llama", max_position_embeddings=32768), "tiny-llama-32k"
    )
    spec = {
        "model": {"source": source},
        "gpu": {"type": "H100-80GB"},
        "engine": {"maxModelLen": 32768, "enableChunkedPrefill": False},
    }
    kube.create_llmd(watched, "long", spec)
    obj = wait_for(lambda: ready(kube, watched, "long"), "the engine serving", timeout=300)
    assert obj["status"]["plan"]["maxModelLen"] == 32768
    (pod,) = pods(kube, watched, "long")
    args = pod["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-batched-tokens") + 1] == "32768"
    assert "--no-enable-chunked-prefill" in args
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0


def group_pods(kube: Cluster, namespace: str, name: str) -> dict[str, dict]:
    """A LeaderWorkerSet's live pods (leaders and workers) by name."""
    return {
        p["metadata"]["name"]: p
        for p in kube.items(
            f"/api/v1/namespaces/{namespace}/pods",
            labelSelector=f"leaderworkerset.sigs.k8s.io/name={name}",
        )
        if not p["metadata"].get("deletionTimestamp")
    }


def test_a_model_larger_than_a_node_runs_as_a_leader_worker_set_group(
    kube: Cluster, watched, model_config_source
):
    """Issue 19: Llama-3.1-405B in bf16 on H100s (TP 8 x PP 2) becomes a LeaderWorkerSet on the
    real LWS controller (built from its Go module, webhooks included): the group's two 8-GPU
    pods land on two H100 nodes, only the leader is selected by the Service (and the scraper),
    the LLMDeployment is Ready from the LeaderWorkerSet's status, and deleting the worker
    recreates the whole group. The pods run no engine (``NO_ENGINE``): the Ray group the real
    image forms is tested in tests/engine/test_ray_node.py."""
    spec = engineless(model_config_source("Meta-Llama-3.1-405B"), gpu="H100-80GB")
    kube.create_llmd(watched, "big", spec)
    obj = wait_for(lambda: ready(kube, watched, "big"), "the multi-node replica Ready")
    assert obj["status"]["plan"]["pipelineParallelSize"] == 2
    assert kube.get(f"/apis/apps/v1/namespaces/{watched}/deployments/big") is None
    lws = kube.get(f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{watched}/leaderworkersets/big")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2, dump(lws)
    # What the operator renders is valid against the LWS CRD's schema: strict field validation
    # (an unknown field is an error, not silently pruned) in a server-side dry run.
    spec_obj = parse_spec(spec)
    plan = plan_for_spec(spec_obj, ModelShape.from_hf_config(json.loads(CONFIG_405B.read_text())))
    rendered = leaderworkerset.leader_worker_set("dry", watched, spec_obj, plan)
    kube.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-f", "-", input=json.dumps(rendered)
    )

    group = group_pods(kube, watched, "big")
    assert sorted(group) == ["big-0", "big-0-1"], dump(group)
    nodes = {p["spec"]["nodeName"] for p in group.values()}
    assert len(nodes) == 2 and all(n.startswith("kwok-h100-") for n in nodes), dump(group)
    worker = group["big-0-1"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["LWS_LEADER_ADDRESS"] == f"big-0.big.{watched}"  # the LWS pod webhook ran
    assert worker["args"] == ["ray-node", "worker", "--address", "$(LWS_LEADER_ADDRESS)"]
    assert [p["metadata"]["name"] for p in pods(kube, watched, "big")] == ["big-0"]

    old_leader = group["big-0"]["metadata"]["uid"]
    kube.kubectl("delete", "pod", "big-0-1", "-n", watched, "--wait=false")

    def recreated() -> dict | None:
        now = group_pods(kube, watched, "big")
        fresh = len(now) == 2 and now.get("big-0", {}).get("metadata", {}).get("uid") != old_leader
        return now if fresh else None

    wait_for(recreated, "the group recreated with a new leader")
    wait_for(lambda: ready(kube, watched, "big"), "Ready again")
