"""The Ray executor (``distributed_executor_backend="ray"``) on CPU actors with gloo, on a Ray
cluster of two "nodes" on this machine (``ray.cluster_utils.Cluster``, one CPU each, loopback
addresses), started once for the module and found through ``RAY_ADDRESS``: every engine here
spans both nodes.

Tensor- and pipeline-parallel engines must reproduce one rank token for token (the same check
as test_tensor_parallel.py); a pipeline's stages sit one per node; a killed actor turns the
engine dead with an error naming its rank, and the server's ``/health`` answers 503; a
placement group the cluster cannot hold is refused, naming the bundles.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from fastapi.testclient import TestClient

from kvpilot.engine.executor import EngineDeadError
from kvpilot.engine.server.app import ServerConfig, create_app
from tests.engine.parallel_helpers import (
    assert_same_generation,
    generate,
    make_llm,
    random_prompts,
)

# 5 requests needing 31 blocks in all share 16: some are preempted and recomputed.
PROMPTS = random_prompts([1, 7, 9, 17, 33])
NUM_BLOCKS = 16
# Seconds a collective waits for a dead peer: the bound on how long a failure can take.
DISTRIBUTED_TIMEOUT_S = 20

# About two minutes on 2 cores (Ray's start, one actor start per engine): slow.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ray_cluster():
    """Two Ray nodes of one CPU each on 127.0.0.1, at ``RAY_ADDRESS``."""
    ray = pytest.importorskip("ray")
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    # Ray would otherwise bind its nodes to this machine's outward address: the environment
    # for its processes, the constant for this one (read when Ray was imported).
    previous = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    enable_cluster, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    cluster = None
    try:
        node = {"num_cpus": 1, "node_ip_address": "127.0.0.1"}
        cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
        cluster.add_node(**node)
        # The first engine connects through RAY_ADDRESS, as a pod of a LeaderWorkerSet would.
        os.environ["RAY_ADDRESS"] = cluster.address
        yield ray
    finally:
        os.environ.pop("RAY_ADDRESS", None)
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = enable_cluster
        if previous is None:
            os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        else:
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = previous


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The 3-layer tiny model and its greedy generation on one rank, in process."""
    model_dir = tiny_model_dir("llama", num_hidden_layers=3)
    return model_dir, generate(make_llm(model_dir, 1, NUM_BLOCKS), PROMPTS, max_tokens=12)


def ray_llm(model_dir, tp: int, pp: int):
    return make_llm(
        model_dir,
        tp,
        NUM_BLOCKS,
        pp=pp,
        backend="ray",
        distributed_timeout_seconds=DISTRIBUTED_TIMEOUT_S,
    )


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_ray_ranks_on_two_nodes_match_one_rank(ray_cluster, reference, tp, pp):
    model_dir, expected = reference
    llm = ray_llm(model_dir, tp, pp)
    executor = llm.llm_engine.executor
    try:
        assert type(executor).__name__ == "RayExecutor"
        assert_same_generation(expected, generate(llm, PROMPTS, max_tokens=12))
        # One actor per node; rank 0 (a pipeline's first stage) on the driver's node.
        driver_node = ray_cluster.get_runtime_context().get_node_id()
        assert len(set(executor.worker_node_ids)) == 2
        assert executor.worker_node_ids[0] == driver_node
        assert executor.collective_rpc("stage") == (
            [(0, 0, 3), (0, 0, 3)] if pp == 1 else [(0, 0, 2), (1, 2, 3)]
        )
    finally:
        llm.llm_engine.shutdown()
    # The placement group is gone: both CPUs are free for the next engine.
    deadline = time.monotonic() + 30
    while ray_cluster.available_resources().get("CPU", 0) < 2:
        assert time.monotonic() < deadline, ray_cluster.available_resources()
        time.sleep(0.2)


def test_a_killed_actor_makes_the_engine_dead_and_health_503(ray_cluster, reference):
    model_dir, _ = reference
    engines = []

    def load():
        engines.append(ray_llm(model_dir, 1, 2).llm_engine)
        return engines[0]

    app = create_app(load, ServerConfig(["tiny"]))
    with TestClient(app) as client:
        deadline = time.monotonic() + 240
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the engine did not start"
            time.sleep(0.2)
        engine = engines[0]
        try:
            body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
            assert client.post("/v1/completions", json=body).status_code == 200
            # Kill the last stage's actor while a long generation is running.
            victim = engine.executor.worker_pids[1]
            body = {**body, "max_tokens": 40, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as stream:
                lines = stream.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                os.kill(victim, signal.SIGKILL)
                rest = "\n".join(lines)
            assert "rank 1" in rest and "died" in rest
            health = client.get("/health")
            assert health.status_code == 503
            assert f"Ray worker rank 1 (pid {victim}" in health.json()["error"]["message"]
            with pytest.raises(EngineDeadError, match="rank 1"):
                engine.check_health()
        finally:
            engine.shutdown()


def test_a_placement_the_cluster_cannot_hold_is_refused(ray_cluster, reference, monkeypatch):
    from kvpilot.engine.executor import ray_executor

    monkeypatch.setattr(ray_executor, "PLACEMENT_GROUP_TIMEOUT_S", 2.0)
    model_dir, _ = reference
    with pytest.raises(ValueError, match=r"could not place 4 bundles of \{'CPU': 1.0\}"):
        ray_llm(model_dir, 2, 2)


def test_two_ray_stages_match_one_on_the_default_model(ray_cluster, default_model_dir):
    """SmolLM2-135M on Ray: its head counts allow tensor parallel 1 or 3 only (3 query-KV
    groups), so it is split into two pipeline stages of 15 layers, one per Ray node (its tied
    head copied onto stage 1), and must reproduce one rank."""
    prompts = [
        "The capital of France is",
        "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
    ]
    # The two requests need 8 blocks of 4 tokens; 6 blocks force preemption.
    expected = generate(make_llm(default_model_dir, 1, 6), prompts, max_tokens=6)
    llm = make_llm(
        default_model_dir,
        1,
        6,
        pp=2,
        backend="ray",
        distributed_timeout_seconds=DISTRIBUTED_TIMEOUT_S,
    )
    try:
        assert_same_generation(expected, generate(llm, prompts, max_tokens=6))
        executor = llm.llm_engine.executor
        assert executor.collective_rpc("stage") == [(0, 0, 15), (1, 15, 30)]
        assert len(set(executor.worker_node_ids)) == 2
    finally:
        llm.llm_engine.shutdown()
