"""Multi-node replicas rendered as a LeaderWorkerSet (pure; the same objects on the real
control plane with the LWS controller: tests/cluster/test_leaderworkerset.py)."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest

from kvpilot.engine.entrypoints import ray_node
from kvpilot.engine.model_shape import ModelShape
from kvpilot.operator import leaderworkerset, manifests
from kvpilot.operator.planner import plan_for_spec
from kvpilot.operator.spec import parse_spec

CONFIGS = Path(__file__).parent / "configs"
SPEC = {
    "model": {"source": "hf://meta-llama/Llama-3.1-405B-Instruct"},
    "engine": {"maxModelLen": 8192},
    "gpu": {"type": "H100-80GB"},
    "replicas": 2,
}


def two_node_plan():
    """Llama-3.1-405B in bf16 on H100-80GB: tensor parallel 8 x pipeline parallel 2, 16 GPUs
    over two 8-GPU nodes (tests/operator/test_planner_moe_quantized.py has the arithmetic)."""
    spec = parse_spec(SPEC)
    config = json.loads((CONFIGS / "Meta-Llama-3.1-405B.json").read_text())
    plan = plan_for_spec(spec, ModelShape.from_hf_config(config))
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size, plan.gpus_per_replica) == (
        8,
        2,
        16,
    )
    return spec, plan


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_a_two_node_plan_is_groups_of_a_ray_leader_and_a_worker():
    spec, plan = two_node_plan()
    lws = leaderworkerset.leader_worker_set("big", "team-a", spec, plan)
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["spec"]["replicas"] == 2
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"

    (leader,) = group["leaderTemplate"]["spec"]["containers"]
    args = leader["args"]
    assert args[:5] == ["ray-node", "leader", "--nodes", "2", "--"]
    serve = args[5:]
    assert serve[0] == "serve"
    assert flag(serve, "--tensor-parallel-size") == "8"
    assert flag(serve, "--pipeline-parallel-size") == "2"
    assert flag(serve, "--distributed-executor-backend") == "ray"
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == "8"  # one node's share
    assert {"name": "ray", "containerPort": 6379, "protocol": "TCP"} in leader["ports"]
    assert leader["readinessProbe"]["httpGet"]["path"] == "/health"

    (worker,) = group["workerTemplate"]["spec"]["containers"]
    assert worker["args"] == ["ray-node", "worker", "--address", "$(LWS_LEADER_ADDRESS)"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert "readinessProbe" not in worker and worker["ports"] == []
    mounts = {m["mountPath"] for m in worker["volumeMounts"]}
    assert {"/dev/shm", "/tmp"} <= mounts  # Ray's object store and session folder
    for template in (group["leaderTemplate"], group["workerTemplate"]):
        assert template["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
        annotations = template["metadata"]["annotations"]
        assert annotations[manifests.TEMPLATE_HASH_ANNOTATION] == manifests.template_hash(template)


def test_only_leaders_carry_the_selector_of_service_pdb_and_scraper():
    spec, plan = two_node_plan()
    group = leaderworkerset.leader_worker_set("big", "team-a", spec, plan)["spec"][
        "leaderWorkerTemplate"
    ]
    selector = manifests.service("big", "team-a")["spec"]["selector"]
    leader_labels = group["leaderTemplate"]["metadata"]["labels"]
    worker_labels = group["workerTemplate"]["metadata"]["labels"]
    assert selector.items() <= leader_labels.items()
    assert not selector.items() <= worker_labels.items()
    assert worker_labels[leaderworkerset.WORKER_OF_LABEL] == "big"
    assert worker_labels["app.kubernetes.io/instance"] == "big"


def test_pod_templates_are_valid_kubernetes_pod_specs():
    spec, plan = two_node_plan()
    group = leaderworkerset.leader_worker_set("big", "team-a", spec, plan)["spec"][
        "leaderWorkerTemplate"
    ]
    for template in (group["leaderTemplate"], group["workerTemplate"]):
        pod = {"apiVersion": "v1", "kind": "Pod", **template}
        pod["metadata"] = {**template["metadata"], "name": "p"}
        kubernetes_validate.validate(pod, "1.32.0", strict=True)


def test_a_single_node_plan_is_not_a_leader_worker_set():
    spec = parse_spec({**SPEC, "model": {"source": "hf://meta-llama/Meta-Llama-3-70B-Instruct"}})
    config = json.loads((CONFIGS / "Meta-Llama-3-70B.json").read_text())
    plan = plan_for_spec(spec, ModelShape.from_hf_config(config))
    assert not leaderworkerset.is_multi_node(plan)
    assert "--pipeline-parallel-size" not in manifests.engine_args(spec, plan)
    with pytest.raises(ValueError, match="Deployment"):
        leaderworkerset.leader_worker_set("big", "team-a", spec, plan)


def test_a_pipeline_that_fits_one_node_is_one_pod_without_ray():
    """Qwen2.5-72B-Instruct as an unpadded AWQ checkpoint on L4s: its MLP's 231 groups of 128
    split at TP 1 only, ~42 GB of weights need three 23 GB GPUs, and three GPUs fit one 8-GPU
    node: one pod asking for 3 GPUs, its stages processes of vLLM's ``mp`` backend."""
    body = {
        "model": {"source": "hf://Qwen/Qwen2.5-72B-Instruct-AWQ"},
        "engine": {"maxModelLen": 8192},
        "gpu": {"type": "L4"},
    }
    spec = parse_spec(body)
    config = json.loads((CONFIGS / "Qwen2.5-72B-Instruct-AWQ-unpadded.json").read_text())
    plan = plan_for_spec(spec, ModelShape.from_hf_config(config))
    shape = (plan.tensor_parallel_size, plan.pipeline_parallel_size, plan.gpus_per_replica)
    assert shape == (1, 3, 3) and plan.nodes_per_replica == 1
    assert plan.to_status()["nodesPerReplica"] == 1
    assert not leaderworkerset.is_multi_node(plan)
    (deployment,) = [
        obj
        for obj in manifests.children("big", "team-a", spec, plan)
        if obj["kind"] == "Deployment" and obj["metadata"]["name"] == "big"
    ]
    (engine,) = deployment["spec"]["template"]["spec"]["containers"]
    assert flag(engine["args"], "--pipeline-parallel-size") == "3"
    assert flag(engine["args"], "--tensor-parallel-size") == "1"
    assert "--distributed-executor-backend" not in engine["args"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "3"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
    # The same model on 2-GPU nodes spans two nodes per replica: one stage per node, at TP 1.
    two_per_node = parse_spec({**body, "gpu": {"type": "L4", "perNode": 2}})
    plan = plan_for_spec(two_per_node, ModelShape.from_hf_config(config))
    assert (plan.pipeline_parallel_size, plan.nodes_per_replica) == (3, 3)
    group = leaderworkerset.leader_worker_set("big", "team-a", two_per_node, plan)
    assert group["spec"]["leaderWorkerTemplate"]["size"] == 3
    (leader,) = group["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"]
    assert flag(leader["args"], "--distributed-executor-backend") == "ray"
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_ray_node_arguments():
    options, command = ray_node.parse_role_args(["--nodes", "2", "--", "serve", "--nodes", "x"])
    assert options.nodes == 2 and command == ["serve", "--nodes", "x"]
    ray = ["python", "-m", "ray.scripts.scripts"]
    assert ray_node.worker_command(ray, "big-0.big.team-a")[3:5] == [
        "start",
        "--address=big-0.big.team-a:6379",
    ]
    assert "--block" in ray_node.worker_command(ray, "10.0.0.1:7000")
    assert ray_node.head_command(ray, 6379, "127.0.0.1")[-1] == "--node-ip-address=127.0.0.1"
    with pytest.raises(SystemExit):
        ray_node.serve_command([])
    with pytest.raises(SystemExit):
        ray_node.parse_role_args(["--bogus"])
    for flag_ in ("-h", "--help"):  # help, not "unrecognized arguments"
        with pytest.raises(SystemExit) as caught:
            ray_node.parse_role_args([flag_])
        assert caught.value.code == 0
    # ``leader -- serve ...``: the top-level parser takes the ``--``, the command stays whole.
    assert ray_node.parse_role_args(["serve", "--pipeline-parallel-size", "2"])[1] == [
        "serve",
        "--pipeline-parallel-size",
        "2",
    ]
    options, command = ray_node.parse_role_args(["--nodes", "3", "--port=7000", "serve"])
    assert (options.nodes, options.port, command) == (3, 7000, ["serve"])
