"""The pure parts of ``router/kubernetes.py`` and ``ReplicaSet.replace`` (the watch itself runs
against the real control plane in ``test_router_cluster.py``)."""

from __future__ import annotations

import argparse

import pytest

from kvpilot.router import cli as router_cli
from kvpilot.router.config import RouterConfig
from kvpilot.router.kubernetes import pod_url, replicas_by_url, served_models
from kvpilot.router.replicas import ReplicaSet


def pod(name: str, owner: str, ip: str | None = "127.1.0.5", ready: bool = True, **meta) -> dict:
    return {
        "metadata": {"name": name, "labels": {"kvpilot.dev/llmdeployment": owner}, **meta},
        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_only_ready_undeleted_pods_with_an_ip_are_replicas():
    assert pod_url(pod("a", "chat")) == "http://127.1.0.5:8000"
    assert pod_url(pod("a", "chat", ip="::1")) == "http://[::1]:8000"
    assert pod_url(pod("a", "chat", ready=False)) is None
    assert pod_url(pod("a", "chat", ip=None)) is None
    assert pod_url(pod("a", "chat", deletionTimestamp="2026-01-01T00:00:00Z")) is None


def test_replicas_carry_their_deployments_model_names():
    llmds = {
        "chat": {
            "spec": {"adapters": [{"name": "sql", "source": "hf://o/sql"}]},
            "status": {"model": "org/base"},
        }
    }
    assert served_models(llmds["chat"]) == {"org/base", "sql"}
    pods = {
        "a": pod("a", "chat", ip="127.1.0.5"),
        "b": pod("b", "chat", ip="127.1.0.6", deletionTimestamp="2026-01-01T00:00:00Z"),
        "c": pod("c", "other", ip="127.1.0.7"),
    }
    assert replicas_by_url(llmds, pods) == {"http://127.1.0.5:8000": {"org/base", "sql"}}


def test_replace_keeps_the_state_of_replicas_that_stay():
    replicas = ReplicaSet([])  # discovery may find none (a deployment at zero)
    replicas.replace({"http://a:1": {"m"}, "http://b:1": {"m"}})
    replicas.replicas["http://a:1"].in_flight = 3
    kept = replicas.replicas["http://a:1"]
    replicas.replace({"http://a:1": {"m"}, "http://c:1": {"n"}})
    assert list(replicas.replicas) == ["http://a:1", "http://c:1"]
    assert replicas.replicas["http://a:1"] is kept and kept.in_flight == 3
    assert replicas.known_models() == {"m", "n"}


def test_kubernetes_mode_and_endpoints_exclude_each_other():
    assert RouterConfig(endpoints=[], kubernetes=True).kubernetes
    with pytest.raises(ValueError, match="exclude each other"):
        RouterConfig(endpoints=["http://a:1"], kubernetes=True)
    with pytest.raises(SystemExit, match="--endpoint URL .* or --kubernetes"):
        router_cli.run(argparse.Namespace(endpoints=[], kubernetes=False))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_settings_are_refused(value):
    with pytest.raises(ValueError, match="--load-factor must be a finite number"):
        RouterConfig(endpoints=["http://a:1"], load_factor=value)
    with pytest.raises(ValueError, match="--kv-weight must be a finite number"):
        RouterConfig(endpoints=["http://a:1"], kv_weight=value)
