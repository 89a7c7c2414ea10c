"""An LLMDeployment's life on a real control plane, as users drive it with kubectl.

The operator is installed by the Helm chart and runs with its ServiceAccount's token; pods are
scheduled by the real scheduler onto kwok's simulated nodes and their containers run as local
processes by the kubelet stand-in (tests/cluster/kubelet.py, a stand-in for the kubelet and a
container runtime), so the engines answer for real. Tests that need no engine give their pods
an image the stand-in runs no process for (``NO_ENGINE``): such pods are ready at once.
"""

from __future__ import annotations

import json
import pathlib
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import Cluster, condition, dump, wait_for
from tests.cluster.specs import NO_ENGINE, engineless

CPU_RESOURCES = {"requests": {"cpu": "100m", "memory": "1600Mi"}, "limits": {"memory": "1600Mi"}}

pytestmark = pytest.mark.slow


def cpu_spec(model_source: str, **extra) -> dict:
    return {
        "model": {"source": model_source},
        "engine": {"maxModelLen": 512},
        "resources": CPU_RESOURCES,
        **extra,
    }


def engine_pods(kube: Cluster, namespace: str, name: str) -> list[dict]:
    pods = kube.items(
        f"/api/v1/namespaces/{namespace}/pods", labelSelector=f"kvpilot.dev/llmdeployment={name}"
    )
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def settled(kube: Cluster, namespace: str, name: str, replicas: int = 1) -> dict | None:
    """The LLMDeployment once its current generation is rolled out and ready."""
    obj = kube.llmd(namespace, name)
    generation = (obj or {}).get("metadata", {}).get("generation")
    ready, progressing = condition(obj, "Ready"), condition(obj, "Progressing")
    if (
        ready.get("status") == "True"
        and ready.get("observedGeneration") == generation
        and progressing.get("reason") == "RolloutComplete"
        and obj["status"].get("readyReplicas") == replicas
    ):
        return obj
    return None


def child_paths(namespace: str, name: str) -> list[str]:
    return [
        f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}",
        f"/api/v1/namespaces/{namespace}/services/{name}",
        f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/{name}",
    ]


def reasons(kube: Cluster, namespace: str, name: str) -> list[str]:
    return [e["reason"] for e in kube.events(namespace, name)]


def test_apply_to_ready_rollout_scale_delete(kube: Cluster, watched, tiny_model_source):
    created = kube.create_llmd(watched, "tiny", cpu_spec(tiny_model_source))
    obj = wait_for(lambda: settled(kube, watched, "tiny"), "Ready=True", timeout=300)
    assert obj["status"]["plan"]["gpuType"] == "cpu"
    (pod,) = engine_pods(kube, watched, "tiny")
    assert pod["spec"]["nodeName"].startswith("kwok-cpu-"), pod["spec"]["nodeName"]
    ip = pod["status"]["podIP"]
    assert ip.startswith("127.1."), ip
    models = json.load(urllib.request.urlopen(f"http://{ip}:8000/v1/models", timeout=10))
    assert models["data"][0]["id"] == tiny_model_source.removeprefix("file://")
    deployment = kube.get(child_paths(watched, "tiny")[0])
    (ref,) = deployment["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["uid"], ref["controller"], ref["blockOwnerDeletion"]) == (
        "LLMDeployment", created["metadata"]["uid"], True, True,
    )  # fmt: skip
    columns = kube.kubectl("get", "llmd", "tiny", "-n", watched).stdout
    header, row = columns.splitlines()
    assert header.split() == [
        "NAME", "MODEL", "GPU", "TP", "PP", "GPUS/REPLICA", "REPLICAS", "READY", "KV", "USAGE",
        "AGE",
    ]  # fmt: skip
    assert row.split()[2:8] == ["cpu", "1", "1", "0", "1", "1"], columns

    # A spec change rolls the Deployment out for real: a new ReplicaSet, new pods.
    kube.kubectl(
        "patch", "llmd", "tiny", "-n", watched, "--type=merge",
        "-p", '{"spec": {"engine": {"maxModelLen": 256}}}',
    )  # fmt: skip
    obj = wait_for(lambda: settled(kube, watched, "tiny"), "the rollout", timeout=300)
    assert obj["status"]["observedGeneration"] == 2
    assert obj["status"]["plan"]["maxModelLen"] == 256
    sets = kube.items(
        f"/apis/apps/v1/namespaces/{watched}/replicasets",
        labelSelector="kvpilot.dev/llmdeployment=tiny",
    )
    assert sorted(rs["spec"]["replicas"] for rs in sets) == [0, 1], dump(sets)
    (pod,) = engine_pods(kube, watched, "tiny")
    args = pod["spec"]["containers"][0]["args"]
    assert args[args.index("--max-model-len") + 1] == "256"

    # kubectl scale goes through the scale subresource, as HPA or KEDA would.
    kube.kubectl("scale", "llmd/tiny", "--replicas=2", "-n", watched)
    wait_for(lambda: settled(kube, watched, "tiny", replicas=2), "two replicas", timeout=300)
    assert kube.get(child_paths(watched, "tiny")[0])["spec"]["replicas"] == 2
    assert len(engine_pods(kube, watched, "tiny")) == 2
    assert {"Created", "Planned", "ReplicasReady"} <= set(reasons(kube, watched, "tiny"))

    # Deleted: gone at once (no finalizer), the garbage collector removes the children.
    kube.kubectl("delete", "llmd", "tiny", "-n", watched, "--wait=true", "--timeout=60s")
    wait_for(
        lambda: all(kube.get(path) is None for path in child_paths(watched, "tiny")),
        "children garbage-collected",
    )
    wait_for(lambda: not engine_pods(kube, watched, "tiny"), "engine pods gone")


def test_invalid_or_unplannable_specs_get_conditions_without_retries(
    kube: Cluster, watched, tmp_path, model_config_source
):
    # The API server refuses what the schema and CEL rules catch, naming the field.
    bad = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "bad", "namespace": watched},
        "spec": {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
    }
    refused = kube.run("kubectl", "apply", "-f", "-", input=json.dumps(bad), check=False)
    assert refused.returncode != 0 and "spec.autoscaling.minReplicas" in refused.stderr

    # What only the planner knows is a condition: a 70B model on one L4 (a tensor parallel
    # size fixed below the GPUs per node is never pipelined).
    spec = {
        "model": {"source": model_config_source("Meta-Llama-3-70B")},
        "gpu": {"type": "L4", "perNode": 2},
        "tensorParallelSize": 1,
        "image": NO_ENGINE,
    }
    kube.create_llmd(watched, "huge", spec)

    def reported() -> dict | None:
        obj = kube.llmd(watched, "huge")
        return obj if condition(obj, "Sized").get("observedGeneration") == 1 else None

    obj = wait_for(reported, "the planner's verdict")
    assert (condition(obj, "Sized")["status"], condition(obj, "Sized")["reason"]) == (
        "False", "ModelTooLarge",
    )  # fmt: skip
    assert condition(obj, "Degraded")["status"] == "True"
    assert "plan" not in obj["status"]
    assert all(kube.get(path) is None for path in child_paths(watched, "huge"))
    # kopf records the handled spec only when the handler succeeded: no retry loop.
    wait_for(
        lambda: (
            "kopf.zalando.org/last-handled-configuration"
            in kube.llmd(watched, "huge")["metadata"].get("annotations", {})
        ),
        "kopf's handled state",
    )
    assert [(e["type"], e["reason"]) for e in kube.events(watched, "huge")] == [
        ("Warning", "ModelTooLarge")
    ]

    # Left to the planner: 5 nodes of 2 L4s (TP 2 x PP 5), a LeaderWorkerSet of 5-pod groups
    # (this cluster has 2 L4 nodes: they stay Pending).
    kube.kubectl(
        "patch", "llmd", "huge", "-n", watched, "--type=merge",
        "-p", '{"spec": {"tensorParallelSize": null}}',
    )  # fmt: skip

    def multi_node() -> dict | None:
        obj = kube.llmd(watched, "huge")
        return obj if condition(obj, "Sized").get("observedGeneration") == 2 else None

    obj = wait_for(multi_node, "the multi-node plan")
    assert condition(obj, "Sized")["status"] == "True"
    plan = obj["status"]["plan"]
    assert (plan["tensorParallelSize"], plan["pipelineParallelSize"]) == (2, 5)
    lws_path = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{watched}/leaderworkersets/huge"
    lws = wait_for(lambda: kube.get(lws_path), "the LeaderWorkerSet")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 5
    assert kube.get(f"/apis/apps/v1/namespaces/{watched}/deployments/huge") is None

    # Fixed: planned, deployed, recovered.
    kube.kubectl(
        "patch", "llmd", "huge", "-n", watched, "--type=merge",
        "-p", '{"spec": {"gpu": {"type": "H100-80GB", "perNode": 8}}}',
    )  # fmt: skip
    obj = wait_for(lambda: settled(kube, watched, "huge"), "the fixed spec deployed")
    assert obj["status"]["plan"]["tensorParallelSize"] == 2  # 141 GB of bf16 weights
    # The LeaderWorkerSet the plan no longer needs is kept at 0 groups (nothing is deleted).
    assert kube.get(lws_path)["spec"]["replicas"] == 0
    assert {"Planned", "Recovered"} <= set(reasons(kube, watched, "huge"))


def test_operator_and_api_server_restarts_converge_without_duplicates(
    kube: Cluster, crd, namespace, model_config_source
):
    spec = engineless(
        model_config_source("Meta-Llama-3-8B"), "H100-80GB", engine={"maxModelLen": 8192}
    )
    with kube.operator(namespace):
        kube.create_llmd(namespace, "steady", spec)
        before = wait_for(lambda: settled(kube, namespace, "steady"), "first rollout")
        operator = kube.operator_pod(namespace)["metadata"]["name"]

        # Killed, then restarted by its kubelet: kopf resumes, finds nothing to do.
        kube.kubelet.kill_container(namespace, operator, "operator")

        def resumed() -> bool:
            text = kube.operator_metrics(namespace)
            return (
                'kvpilot_operator_reconciles_total{result="unchanged",trigger="resume"} 1.0' in text
            )

        wait_for(resumed, "the resume reconcile after the restart")
        after = kube.llmd(namespace, "steady")
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
        deployment = kube.get(child_paths(namespace, "steady")[0])
        assert deployment["metadata"]["generation"] == 1

        # Killed in the middle of handling a change: the restarted one finishes it.
        kube.kubectl(
            "patch", "llmd", "steady", "-n", namespace, "--type=merge",
            "-p", '{"spec": {"engine": {"maxModelLen": 4096}}}',
        )  # fmt: skip
        kube.kubelet.kill_container(namespace, operator, "operator")
        obj = wait_for(lambda: settled(kube, namespace, "steady"), "the change after a crash")
        assert obj["status"]["plan"]["maxModelLen"] == 4096

        # The API server restarts under the running operator: its watches come back.
        kube.control_plane.restart("kube-apiserver")
        kube.kubectl(
            "patch", "llmd", "steady", "-n", namespace, "--type=merge",
            "-p", '{"spec": {"engine": {"maxModelLen": 2048}}}',
        )  # fmt: skip
        obj = wait_for(
            lambda: (
                (o := settled(kube, namespace, "steady"))
                and o["status"]["observedGeneration"] == 3
                and o
            ),
            "the change after the API server restart",
            timeout=180,
        )
        assert obj["status"]["plan"]["maxModelLen"] == 2048
        deployments = kube.items(
            f"/apis/apps/v1/namespaces/{namespace}/deployments",
            labelSelector="kvpilot.dev/llmdeployment=steady",
        )
        assert [d["metadata"]["name"] for d in deployments] == ["steady"]
        assert deployments[0]["metadata"]["generation"] == 3  # one rollout per spec change
        # Steady again: a resync or a child event writes nothing and says nothing.
        updated = reasons(kube, namespace, "steady").count("Updated")
        kube.kubectl("annotate", "llmd", "steady", "-n", namespace, "touch=1")
        wait_for(
            lambda: (
                "touch"
                in json.dumps(
                    kube.llmd(namespace, "steady")["metadata"]["annotations"].get(
                        "kopf.zalando.org/last-handled-configuration", ""
                    )
                )
            ),
            "the annotation handled",
        )
        assert reasons(kube, namespace, "steady").count("Updated") == updated
        assert kube.get(child_paths(namespace, "steady")[0])["metadata"]["generation"] == 3


def test_recreating_a_deleted_name_waits_for_the_garbage_collector(
    kube: Cluster, crd, namespace, model_config_source
):
    """Issue 15, bug 10: the old children still name the old owner's uid for a moment; the
    new object is retried within seconds (not at the next resync, 300 s away)."""
    spec = engineless(
        model_config_source("Meta-Llama-3-8B"), "H100-80GB", engine={"maxModelLen": 8192}
    )
    with kube.operator(namespace):
        kube.create_llmd(namespace, "again", spec)
        wait_for(lambda: settled(kube, namespace, "again"), "the first one ready")
        # Hold the old Deployment (a finalizer of the test's), so that it is certainly still
        # there, owned by the deleted object, when the new one is reconciled.
        kube.kubectl(
            "patch", "deployment", "again", "-n", namespace, "--type=merge",
            "-p", '{"metadata": {"finalizers": ["kvpilot.dev/test-hold"]}}',
        )  # fmt: skip
        kube.kubectl("delete", "llmd", "again", "-n", namespace, "--wait=true")
        second = kube.create_llmd(namespace, "again", spec)
        uid = second["metadata"]["uid"]
        wait_for(
            lambda: 'reason="StaleOwner"' in kube.operator_metrics(namespace),
            "a reconcile that found the old children",
        )
        kube.kubectl(
            "patch", "deployment", "again", "-n", namespace, "--type=json",
            "-p", '[{"op": "remove", "path": "/metadata/finalizers"}]',
        )  # fmt: skip

        def owned_by_the_new_one() -> bool:
            children = [kube.get(path) for path in child_paths(namespace, "again")]
            return all(
                c is not None and c["metadata"]["ownerReferences"][0]["uid"] == uid
                for c in children
            )

        wait_for(owned_by_the_new_one, "children of the new object", timeout=120)
        wait_for(lambda: settled(kube, namespace, "again"), "the second one ready", timeout=120)
        obj = kube.llmd(namespace, "again")
        assert condition(obj, "Degraded")["status"] == "False", dump(obj["status"])


def test_a_namespaced_operator_leaves_other_namespaces_alone(
    kube: Cluster, crd, namespace, model_config_source
):
    other = kube.create_namespace("ignored")
    spec = engineless(model_config_source("Meta-Llama-3-8B"), "L4")
    try:
        with kube.operator(namespace):
            for ns in (other, namespace):
                kube.create_llmd(ns, "llm", spec)
            wait_for(lambda: settled(kube, namespace, "llm"), "the watched object")
            assert "status" not in kube.llmd(other, "llm")
            assert all(kube.get(path) is None for path in child_paths(other, "llm"))
    finally:
        kube.kubectl("delete", "namespace", other, "--wait=false", check=False)


def test_liveness_and_metrics_of_the_operator(kube: Cluster, crd, namespace, model_config_source):
    spec = engineless(model_config_source("Meta-Llama-3-8B"), "L4")
    with kube.operator(namespace):
        kube.create_llmd(namespace, "m", spec)
        wait_for(lambda: settled(kube, namespace, "m"), "reconciled")
        ip = kube.operator_pod(namespace)["status"]["podIP"]
        assert urllib.request.urlopen(f"http://{ip}:8080/healthz", timeout=10).status == 200
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(kube.operator_metrics(namespace))
            for s in family.samples
        }
        assert (
            samples[
                (
                    "kvpilot_operator_reconciles_total",
                    (("result", "changed"), ("trigger", "create")),
                )
            ]
            == 1
        )
        total = sum(v for (n, _), v in samples.items() if n == "kvpilot_operator_reconciles_total")
        durations = sum(
            v
            for (n, _), v in samples.items()
            if n == "kvpilot_operator_reconcile_duration_seconds_count"
        )
        assert durations == total


def test_the_examples_as_a_new_user_applies_them(kube: Cluster, watched):
    """``kubectl apply -f examples/``: the CPU example serves the built-in SmolLM2 for real (its
    pod converts the model into its own cache volume first); the hub examples cannot read their
    config offline and say so; ``kubectl get llmd`` lists them all."""
    examples = pathlib.Path(__file__).parents[3] / "examples"
    applied = kube.kubectl("apply", "-n", watched, "-f", str(examples)).stdout
    names = sorted(line.split()[0].split("/")[1] for line in applied.splitlines())
    expected = sorted(
        yaml.safe_load(p.read_text())["metadata"]["name"] for p in examples.glob("*.yaml")
    )
    assert names == expected
    wait_for(
        lambda: (
            condition(kube.llmd(watched, "llama-3-8b"), "Sized").get("reason")
            == "ConfigUnavailable"
        ),
        "a hub example reported",
    )
    obj = wait_for(lambda: settled(kube, watched, "smollm2"), "SmolLM2 serving", timeout=420)
    assert obj["status"]["model"] == "SmolLM2-135M-Instruct"
    (pod,) = engine_pods(kube, watched, "smollm2")
    chat = urllib.request.Request(
        f"http://{pod['status']['podIP']}:8000/v1/chat/completions",
        data=json.dumps(
            {
                "model": "SmolLM2-135M-Instruct",
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 8,
                "temperature": 0,
            }
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    answer = json.load(urllib.request.urlopen(chat, timeout=120))
    assert "Paris" in answer["choices"][0]["message"]["content"], answer
    rows = kube.kubectl("get", "llmd", "-n", watched).stdout.splitlines()[1:]
    assert sorted(row.split()[0] for row in rows) == expected
