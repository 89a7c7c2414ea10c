"""The test cluster's own pure parts: the simulated nodes and what the kubelet stand-in (a
stand-in for the kubelet and a container runtime) makes of a container."""

from __future__ import annotations

import ipaddress
import pathlib
import sys

import pytest

from tests.cluster import images, kubelet, nodes


def test_nodes_have_gpu_labels_taints_and_loopback_addresses():
    objects = nodes.node_objects(nodes.DEFAULT_POOLS, subnet=3)
    assert [n["metadata"]["name"] for n in objects][:3] == [
        "kwok-h100-0",
        "kwok-h100-1",
        "kwok-l4-0",
    ]
    h100 = objects[0]
    assert h100["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert h100["status"]["capacity"]["nvidia.com/gpu"] == "8"
    assert h100["spec"]["taints"] == [
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    ]
    cpu = objects[-1]
    assert "nvidia.com/gpu" not in cpu["status"]["capacity"] and cpu["spec"]["taints"] == []
    loopback = ipaddress.ip_network("127.0.0.0/8")
    for i, node in enumerate(objects, start=1):
        assert node["spec"]["podCIDR"] == f"127.3.{i}.0/24"
        assert ipaddress.ip_network(node["spec"]["podCIDR"]).subnet_of(loopback)
        (internal,) = [a for a in node["status"]["addresses"] if a["type"] == "InternalIP"]
        assert ipaddress.ip_address(internal["address"]) in loopback
    with pytest.raises(ValueError):
        nodes.node_objects(subnet=100)


def test_container_argv_follows_kubernetes_command_and_args_rules():
    engine = {"image": "ghcr.io/kvpilot/kvpilot-engine:9.9", "args": ["--port", "8001"]}
    program, args = images.container_argv(engine)
    assert program == [sys.executable, "-m", "kvpilot"]
    assert args == ["serve", "--port", "8001"]  # ENTRYPOINT kept, CMD replaced
    program, args = images.container_argv({"image": "kvpilot-engine"})
    assert args == ["serve", "--host", "0.0.0.0", "--port", "8000"]  # the Dockerfile's CMD
    program, args = images.container_argv(
        {"image": "x/kvpilot-operator@sha256:ab", "command": ["kvpilot"]}
    )
    assert args == []  # a command without args drops CMD too
    assert images.container_argv({"image": "nginx:1"}) is None


def test_paths_under_mounts_are_mapped_but_the_program_never_is(tmp_path):
    mounts = {"/tmp": tmp_path / "tmp", "/models/cache": tmp_path / "cache"}
    assert kubelet.map_paths("/tmp/x/y", mounts) == f"{tmp_path}/tmp/x/y"
    assert (
        kubelet.map_paths("--dir=/models/cache/kvpilot", mounts)
        == f"--dir={tmp_path}/cache/kvpilot"
    )
    assert kubelet.map_paths("/tmpfoo", mounts) == "/tmpfoo"
    assert kubelet.map_paths("/models/cachex", mounts) == "/models/cachex"
    # The interpreter that stands for the image may live anywhere, /tmp included.
    program, _ = images.container_argv({"image": "kvpilot-engine"})
    assert pathlib.Path(program[0]).is_absolute() and program[1:] == ["-m", "kvpilot"]


def test_all_interfaces_become_the_pods_ip():
    assert kubelet.bind_to_pod_ip(["--host", "0.0.0.0", "--x=http://0.0.0.0:8080/h"], "127.1.2.3") == [
        "--host", "127.1.2.3", "--x=http://127.1.2.3:8080/h",
    ]  # fmt: skip
    assert kubelet.bind_to_pod_ip(["10.0.0.0"], "127.1.2.3") == ["10.0.0.0"]
    assert kubelet.bind_to_pod_ip(["0.0.0.0"], "::1") == ["[::1]"]


def test_an_exec_hook_reaches_its_own_pod_at_the_pod_ip():
    argv = ["--url", "http://127.0.0.1:8000", "localhost:9", "127.0.0.10", "my.localhost"]
    assert kubelet.loopback_to_pod_ip(argv, "127.1.2.3") == [
        "--url", "http://127.1.2.3:8000", "127.1.2.3:9", "127.0.0.10", "my.localhost",
    ]  # fmt: skip


def test_a_gpu_engine_runs_on_the_cpu():
    argv = [
        "serve", "--device", "cuda", "--dtype", "bfloat16", "--tensor-parallel-size", "4",
        "--gpu-memory-utilization", "0.9", "--max-model-len=8192",
    ]  # fmt: skip
    assert kubelet.emulate_gpus(argv) == [
        "serve", "--device", "cpu", "--dtype", "float32", "--tensor-parallel-size", "1",
        "--kv-cache-memory", kubelet.GPU_POD_KV_CACHE_MEMORY, "--max-model-len=8192",
    ]  # fmt: skip
    assert kubelet.asks_for_gpus({"resources": {"limits": {"nvidia.com/gpu": "1"}}})
    assert not kubelet.asks_for_gpus({"resources": {"limits": {"cpu": "1"}}})


def test_readiness_follows_the_probe_thresholds_as_the_kubelet_does():
    results = kubelet.ProbeResults(success_threshold=1, failure_threshold=3)
    assert [results.record(ok) for ok in (False, True, False, False, True)] == [
        False, True, True, True, True,
    ]  # fmt: skip
    assert [results.record(False) for _ in range(3)] == [True, True, False]
    strict = kubelet.ProbeResults(success_threshold=2, failure_threshold=1)
    assert [strict.record(ok) for ok in (True, False, True, True, False)] == [
        False, False, False, True, False,
    ]  # fmt: skip
