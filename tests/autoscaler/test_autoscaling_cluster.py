"""The autoscaler end to end on a real control plane, with real engines.

The operator (installed by the chart, deciding every 2 s) scrapes the engines' real /metrics at
their pod IPs. Load comes from clients on the pods' loopback addresses: requests pile up in
the engine's waiting queue (``maxNumSeqs`` 2), the autoscaler scales up, the Deployment and
ReplicaSet controllers and the scheduler make the pods, the kubelet stand-in (a stand-in for
the kubelet and container runtime, tests/cluster/kubelet.py) runs their engines; the load
stops, it scales down, then to zero once idle, and a wake request brings one replica back.
Beside it: a ``mode: external`` deployment is never touched, a steady one stops writing its
status, and a GPU budget and the cluster's GPU count bound a TP 8 deployment (real Pending
pods, reported in Degraded).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.cluster import Cluster, condition, dump, wait_for
from tests.cluster.specs import NO_ENGINE, engineless

pytestmark = pytest.mark.slow

SCALING_REASONS = {
    "ScaleUp", "ScaleDown", "Panic", "PendingPods", "StartingPods", "ScaleToZero",
    "WakeFromZero", "BelowMinimum", "AboveMaximum", "GPUBudget", "LongContext", "PredictedBurst",
}  # fmt: skip


def ready_ips(kube: Cluster, namespace: str, name: str) -> list[str]:
    pods = kube.items(
        f"/api/v1/namespaces/{namespace}/pods", labelSelector=f"kvpilot.dev/llmdeployment={name}"
    )
    return [
        p["status"]["podIP"]
        for p in pods
        if condition(p, "Ready").get("status") == "True"
        and not p["metadata"].get("deletionTimestamp")
    ]


class Load:
    """``workers`` clients sending completions, in turn, to the ready pods of a deployment."""

    def __init__(self, kube: Cluster, namespace: str, name: str, model: str, workers: int = 8):
        self.kube, self.namespace, self.name, self.model = kube, namespace, name, model
        self.stop = threading.Event()
        self.answered = 0
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(workers)
        ]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)

    def _run(self, worker: int) -> None:
        body = json.dumps(
            {
                "model": self.model,
                "prompt": "Once upon a time",
                "max_tokens": 200,
                "ignore_eos": True,
            }
        ).encode()
        n = worker
        while not self.stop.is_set():
            ips = ready_ips(self.kube, self.namespace, self.name)
            if not ips:
                time.sleep(0.5)
                continue
            n += 1
            request = urllib.request.Request(
                f"http://{ips[n % len(ips)]}:8000/v1/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            try:
                urllib.request.urlopen(request, timeout=120).read()
                self.answered += 1
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)


def rounds(kube: Cluster, namespace: str, name: str) -> int:
    """Autoscaling rounds so far for ``name``: each lists its pods (from the audit log)."""
    return sum(
        1
        for e in kube.control_plane.audit_events()
        if e["verb"] == "list"
        and (e.get("objectRef") or {}).get("resource") == "pods"
        and (e.get("objectRef") or {}).get("namespace") == namespace
        and f"llmdeployment%3D{name}" in e.get("requestURI", "")
    )


def wait_rounds(kube: Cluster, namespace: str, name: str, more: int) -> None:
    start = rounds(kube, namespace, name)
    wait_for(
        lambda: rounds(kube, namespace, name) >= start + more, f"{more} more rounds", timeout=180
    )


def replicas(kube: Cluster, namespace: str, name: str) -> int:
    return kube.llmd(namespace, name)["spec"]["replicas"]


def scaling_events(kube: Cluster, namespace: str, name: str) -> list[dict]:
    return [e for e in kube.events(namespace, name) if e["reason"] in SCALING_REASONS]


def test_load_scales_up_then_down_then_to_zero_and_a_wake_brings_it_back(
    kube: Cluster, watched, tiny_model_source
):
    spec = {
        "model": {"source": tiny_model_source},
        "engine": {"maxModelLen": 512, "maxNumSeqs": 2},
        "resources": {"requests": {"cpu": "100m", "memory": "1600Mi"}, "limits": {"memory": "1600Mi"}},
        "autoscaling": {
            "minReplicas": 0, "maxReplicas": 3, "targetWaitingRequests": 1,
            "stableWindowSeconds": 4, "panicWindowSeconds": 2,
            "scaleDownStabilizationSeconds": 4, "idleSeconds": 10, "predictiveScaling": False,
        },
    }  # fmt: skip
    model = tiny_model_source.removeprefix("file://")
    kube.create_llmd(watched, "chat", spec)
    # The clients wait for the first engine and send as soon as it is Ready.
    with Load(kube, watched, "chat", model) as load:
        wait_for(lambda: ready_ips(kube, watched, "chat"), "the first engine", timeout=300)
        wait_for(lambda: replicas(kube, watched, "chat") >= 2, "a scale-up", timeout=300)
        up = wait_for(
            lambda: [
                e
                for e in scaling_events(kube, watched, "chat")
                if e["reason"] in ("ScaleUp", "Panic")
            ],
            "the scale-up Event",
        )
        assert up[0]["message"].startswith("replicas 1 -> "), dump(up)
        status = kube.llmd(watched, "chat")["status"]
        assert status["lastDecision"]["signals"]["requestsWaiting"] > 1, dump(status)
        wait_for(
            lambda: len(ready_ips(kube, watched, "chat")) >= 2,
            "the new engines serve",
            timeout=300,
        )
        # Requests of 200 tokens on a loaded machine may still be running when new pods are Ready.
        wait_for(lambda: load.answered > 0, "an answered request", timeout=300)
    # The load stops: back down after the stabilization window, then to zero once idle.
    wait_for(lambda: replicas(kube, watched, "chat") == 0, "scaled to zero", timeout=300)
    wait_for(
        lambda: "ScaleToZero" in [e["reason"] for e in scaling_events(kube, watched, "chat")],
        "the scale-to-zero Event",
    )
    wait_for(lambda: not ready_ips(kube, watched, "chat"), "no engine left", timeout=120)
    wait_for(
        lambda: condition(kube.llmd(watched, "chat"), "Ready")["reason"] == "ScaledToZero",
        "Ready=False, ScaledToZero",
    )

    # A wake request (what a router or an activator sets) brings one replica back; a longer
    # idleSeconds first, so that it is not idle again before the checks below reach it.
    kube.kubectl(
        "patch", "llmd", "chat", "-n", watched, "--type=merge",
        "-p", json.dumps({"spec": {"autoscaling": {"idleSeconds": 600}}}),
    )  # fmt: skip
    kube.kubectl(
        "annotate",
        "llmd",
        "chat",
        "-n",
        watched,
        f"kvpilot.dev/wake={time.time():.0f}",
        "--overwrite",
    )
    wait_for(lambda: replicas(kube, watched, "chat") == 1, "a wake")
    (ip,) = wait_for(lambda: ready_ips(kube, watched, "chat"), "an engine again", timeout=300)
    woke = wait_for(
        lambda: [e for e in scaling_events(kube, watched, "chat") if e["reason"] == "WakeFromZero"],
        "the wake Event",
    )
    assert "replicas 0 -> 1" in woke[-1]["message"], dump(woke)
    models = json.load(urllib.request.urlopen(f"http://{ip}:8000/v1/models", timeout=30))
    assert models["data"][0]["id"] == model


def test_external_mode_is_never_touched_and_a_steady_fleet_stops_writing(
    kube: Cluster, crd, namespace, model_config_source
):
    base = engineless(model_config_source("Meta-Llama-3-8B"), "L4")
    with kube.operator(namespace):
        kube.create_llmd(
            namespace,
            "ext",
            {**base, "replicas": 3, "autoscaling": {"mode": "external", "maxReplicas": 4}},
        )
        kube.create_llmd(
            namespace, "steady", {**base, "autoscaling": {"minReplicas": 1, "maxReplicas": 1}}
        )
        wait_for(
            lambda: (
                "lastDecision" in (kube.llmd(namespace, "steady").get("status") or {})
                and condition(kube.llmd(namespace, "steady"), "Ready").get("status") == "True"
            ),
            "a decision about a ready replica",
        )
        user = f"system:serviceaccount:{namespace}:"

        def status_writes(name: str) -> int:
            return sum(
                1
                for e in kube.control_plane.audit_events()
                if e.get("user", {}).get("username", "").startswith(user)
                and (e.get("objectRef") or {}).get("name") == name
                and (e.get("objectRef") or {}).get("subresource") == "status"
                and e["verb"] == "patch"
                and (e.get("responseStatus") or {}).get("code") == 200
            )

        written = status_writes("steady")
        wait_rounds(kube, namespace, "steady", 6)
        assert status_writes("steady") - written <= 1
        ext = kube.llmd(namespace, "ext")
        assert ext["spec"]["replicas"] == 3
        assert not {"desiredReplicas", "lastDecision"} & set(ext.get("status", {}))
        assert not scaling_events(kube, namespace, "ext")
        scale_calls = [
            e
            for e in kube.control_plane.audit_events()
            if (e.get("objectRef") or {}).get("name") == "ext"
            and (e.get("objectRef") or {}).get("subresource") == "scale"
        ]
        assert scale_calls == []


def test_the_gpu_count_and_budget_bound_replicas_and_pending_pods_are_reported(
    kube: Cluster, watched, model_config_source
):
    """Two H100 nodes of 8 GPUs: three TP 8 replicas cannot all be placed. The scheduler keeps
    one Pending; the LLMDeployment says why (Degraded, Unschedulable, the scheduler's words).
    With a GPU budget of 16 the autoscaler never asks for the third."""
    base = engineless(model_config_source("Meta-Llama-3-70B"), "H100-80GB", tensorParallelSize=8)
    kube.create_llmd(
        watched,
        "big",
        {**base, "replicas": 3, "autoscaling": {"mode": "external", "maxReplicas": 3}},
    )

    def unschedulable() -> dict | None:
        cond = condition(kube.llmd(watched, "big"), "Degraded")
        return cond if cond.get("reason") == "Unschedulable" else None

    cond = wait_for(unschedulable, "the Pending pod reported")
    assert "nvidia.com/gpu" in cond["message"], cond
    wait_for(lambda: len(ready_ips(kube, watched, "big")) == 2, "the two placed replicas")
    nodes = {
        p["spec"].get("nodeName")
        for p in kube.items(
            f"/api/v1/namespaces/{watched}/pods",
            labelSelector="kvpilot.dev/llmdeployment=big",
        )
    }
    assert nodes == {"kwok-h100-0", "kwok-h100-1", None}

    kube.create_llmd(
        watched, "budget",
        {**base, "replicas": 1, "autoscaling": {"minReplicas": 3, "maxReplicas": 3, "gpuBudget": 40}},
    )  # fmt: skip
    # 24 GPUs held by "big" (its 3 replicas count, placed or not) leave 16 of the 40.
    wait_for(lambda: replicas(kube, watched, "budget") == 2, "scaled up to the budget")
    wait_for(
        lambda: any(e["reason"] == "GPUBudget" for e in scaling_events(kube, watched, "budget")),
        "the GPUBudget Event",
    )
    wait_rounds(kube, watched, "budget", 3)
    assert replicas(kube, watched, "budget") == 2


def test_a_tuning_canary_is_rendered_as_a_deployment_of_its_own_and_retired(
    kube: Cluster, watched, model_config_source
):
    """The reconciler's half of live tuning, on real Deployments: a rollout in Canary (what the
    autoscaler records when the KV cache stays full) runs one replica with the tuned settings
    beside the others, behind the same Service; rolled back, the canary keeps 0 replicas."""
    spec = {
        "model": {"source": model_config_source("Meta-Llama-3-8B")},
        "gpu": {"type": "H100-80GB"},
        "engine": {"maxModelLen": 8192},
        "replicas": 2,
        "image": NO_ENGINE,
        # The autoscaler never moves 2 replicas (min = max) nor the rollout (no metrics).
        "autoscaling": {"minReplicas": 2, "maxReplicas": 2, "tuneEngine": True},
    }
    canary = {
        "phase": "Canary",
        "settings": {"gpuMemoryUtilization": 0.95, "maxNumSeqs": 128},
        "previous": None,
        "started": time.time(),
        "reason": "KV cache full",
    }

    def deployment(name: str) -> dict:
        return kube.get(f"/apis/apps/v1/namespaces/{watched}/deployments/{name}") or {}

    def flag(name: str, option: str) -> str:
        (engine,) = deployment(name)["spec"]["template"]["spec"]["containers"]
        return engine["args"][engine["args"].index(option) + 1]

    kube.create_llmd(watched, "tuned", spec)
    wait_for(lambda: len(ready_ips(kube, watched, "tuned")) == 2, "two replicas")
    kube.kubectl(
        "annotate", "llmd", "tuned", "-n", watched,
        f"kvpilot.dev/engine-tuning={json.dumps(canary)}",
    )  # fmt: skip
    wait_for(
        lambda: (
            deployment("tuned-canary").get("status", {}).get("readyReplicas") == 1
            and deployment("tuned")["spec"]["replicas"] == 1
        ),
        "one canary replica beside one main replica",
    )
    assert flag("tuned-canary", "--gpu-memory-utilization") == "0.95"
    assert flag("tuned", "--gpu-memory-utilization") != "0.95"
    labels = deployment("tuned-canary")["spec"]["template"]["metadata"]["labels"]
    selector = kube.get(f"/api/v1/namespaces/{watched}/services/tuned")["spec"]["selector"]
    assert labels["kvpilot.dev/canary"] == "true" and selector.items() <= labels.items()
    assert len(ready_ips(kube, watched, "tuned")) == 2

    rolled_back = {**canary, "phase": "RolledBack", "reason": "preempted more"}
    kube.kubectl(
        "annotate", "llmd", "tuned", "-n", watched, "--overwrite",
        f"kvpilot.dev/engine-tuning={json.dumps(rolled_back)}",
    )  # fmt: skip
    wait_for(
        lambda: (
            deployment("tuned-canary")["spec"]["replicas"] == 0
            and deployment("tuned")["spec"]["replicas"] == 2
            and len(ready_ips(kube, watched, "tuned")) == 2
        ),
        "the canary retired",
    )
    assert flag("tuned", "--gpu-memory-utilization") != "0.95"
