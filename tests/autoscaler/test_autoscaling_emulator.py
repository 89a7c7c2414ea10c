"""The autoscaling timer in a real kopf process against the API emulator: pressure up ->
replicas up with an Event; pressure gone -> down after the window; a wake annotation -> up from
zero; a full KV cache -> a tuning canary that the reconciler renders as a Deployment of its
own, rolled back when it preempts more; a steady fleet -> no status writes; mode external ->
never touched.

Engines are stand-ins: local HTTP servers bound to each emulated pod's loopback ``podIP`` and
container port, serving the engine's metric names as a prometheus_client registry renders
them. Nothing maps addresses: the operator scrapes what the Pod objects say. The emulator has
no Deployment controller: the test creates the pods a Deployment would, with the labels of the
pod template the operator rendered.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import pathlib
import shutil
import time

import pytest
from aiohttp import web

from kvpilot.operator import manifests
from tests.operator.emulator import (
    DEPLOYMENTS,
    EVENTS,
    LLMD,
    OPERATOR_TOKEN,
    SERVICES,
    create_ready_pod,
    operator_process,
    running_emulator,
)

# A real operator process on a shared 2-core machine: 10-25 s.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).parents[2]
PODS = ("", "v1", "pods")
NAMESPACE = "default"
SCALING_REASONS = {
    "ScaleUp",
    "ScaleDown",
    "Panic",
    "PendingPods",
    "StartingPods",
    "ScaleToZero",
    "WakeFromZero",
    "BelowMinimum",
    "AboveMaximum",
    "GPUBudget",
    "LongContext",
    "PredictedBurst",
}


class Engine:
    """A stand-in engine's /metrics at a pod's address; ``load`` is read at every scrape, and
    the counters in ``grow`` go up by their step at every scrape."""

    def __init__(self, render, grow=None, **load):
        self.render = render
        self.load = load
        self.grow = grow or {}
        self.runner = None
        self.scrapes = 0

    async def handle(self, request):
        self.scrapes += 1
        for counter, step in self.grow.items():
            self.load[counter] = self.load.get(counter, 0) + step
        return web.Response(text=self.render(**self.load), content_type="text/plain")

    async def start(self, ip: str, port: int = 8000) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self.handle)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, ip, port).start()


async def eventually(predicate, what: str, timeout: float = 90.0):
    """Poll without blocking the loop that serves the engines. The timeout only bounds a hung
    test; nothing asserts how long it took."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def llm_deployment(name, model_source, replicas, **autoscaling):
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"source": model_source},
            "gpu": {"type": "H100-80GB"},
            "engine": {"maxModelLen": 8192},
            "replicas": replicas,
            "autoscaling": autoscaling,
        },
    }


@pytest.fixture
def model_source(tmp_path) -> str:
    folder = tmp_path / "llama-3-8b"
    folder.mkdir()
    shutil.copy(ROOT / "tests/operator/configs/Meta-Llama-3-8B.json", folder / "config.json")
    return f"file://{folder}"


async def test_scaling_tuning_waking_and_external_mode(tmp_path, model_source, exposition):
    engines: list[Engine] = []
    with running_emulator() as cluster:
        store = cluster.store
        cluster.install_crd(ROOT / "crds" / "llmdeployment.yaml")
        fast = dict(
            minReplicas=1, maxReplicas=4, targetKVCacheUsage=0.7, stableWindowSeconds=3,
            panicWindowSeconds=1.5, scaleDownStabilizationSeconds=4, idleSeconds=600,
        )  # fmt: skip
        store.create(LLMD, NAMESPACE, llm_deployment("chat", model_source, 1, mode="kvpilot",
                                                     **fast))  # fmt: skip
        store.create(LLMD, NAMESPACE, llm_deployment("ext", model_source, 3, mode="external",
                                                     **fast))  # fmt: skip
        store.create(LLMD, NAMESPACE, llm_deployment("sleepy", model_source, 0, mode="kvpilot",
                                                     minReplicas=0, maxReplicas=2))  # fmt: skip
        store.create(LLMD, NAMESPACE, llm_deployment(
            "tuned", model_source, 2, mode="kvpilot", minReplicas=2, maxReplicas=2,
            stableWindowSeconds=3, panicWindowSeconds=1.5, tuneEngine=True,
        ))  # fmt: skip
        store.create(LLMD, NAMESPACE, llm_deployment(
            "steady", model_source, 1, mode="kvpilot", minReplicas=1, maxReplicas=1,
            stableWindowSeconds=3, panicWindowSeconds=1.5,
        ))  # fmt: skip

        async def engine_pod(owner, index, *, labels=None, grow=None, **load) -> Engine:
            labels = labels or manifests.selector_labels(owner)
            ip = create_ready_pod(store, NAMESPACE, f"{owner}-{index}", labels)
            engine = Engine(exposition, grow, **load)
            await engine.start(ip)
            engines.append(engine)
            return engine

        busy = dict(kv=0.99, running=4, waiting=6)
        first = await engine_pod("chat", 0, **busy)
        for i in range(3):
            await engine_pod("ext", i, **busy)
        for i in range(2):
            await engine_pod("tuned", i, kv=0.99, running=4, waiting=0)
        steady = await engine_pod("steady", 0, kv=0.3, running=1, waiting=0)

        kubeconfig = cluster.write_kubeconfig(tmp_path / "operator", token=OPERATOR_TOKEN)
        # The real `kvpilot operator`, deciding every second so the test sees several rounds.
        args = ("--autoscale-interval=1", "--scrape-timeout=1")
        try:
            with operator_process(kubeconfig, tmp_path / "operator.log", *args):

                def chat():
                    return store.get(LLMD, NAMESPACE, "chat")

                def events(name):
                    items, _ = store.list(EVENTS, NAMESPACE,
                                          field_selector=f"involvedObject.name={name}")  # fmt: skip
                    return items

                # Pressure up: one replica at 99% KV usage with requests waiting -> more replicas.
                await eventually(lambda: chat()["spec"]["replicas"] >= 2, "a scale-up")
                up = await eventually(
                    lambda: [e for e in events("chat") if e["reason"] in ("ScaleUp", "Panic")],
                    "a scale-up Event",
                )
                assert "replicas 1 -> " in up[0]["message"]
                status = chat()["status"]
                assert status["desiredReplicas"] == chat()["spec"]["replicas"]
                assert status["lastDecision"]["signals"]["kvCacheUsage"] == pytest.approx(0.99)
                assert status["lastDecision"]["signals"]["requestsWaiting"] == pytest.approx(6)
                # A full KV cache: the recommendation gives it more of the GPU than the plan (0.9).
                assert status["recommendations"]["gpuMemoryUtilization"] == pytest.approx(0.95)

                # The new pods start (as the Deployment controller would make them), then the
                # pressure goes away: back to minReplicas after the scale-down window.
                for i in range(1, chat()["spec"]["replicas"]):
                    await engine_pod("chat", i, kv=0.05, running=0, waiting=0)
                first.load = dict(kv=0.05, running=0, waiting=0)
                await eventually(
                    lambda: chat()["spec"]["replicas"] == chat()["status"]["desiredReplicas"] == 1,
                    "a scale-down and its status",
                )
                down = await eventually(
                    lambda: [e for e in events("chat") if e["reason"] == "ScaleDown"],
                    "a scale-down Event",
                )

                def at(event):
                    stamp = event.get("firstTimestamp") or event["eventTime"]
                    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))

                last = max(down, key=at)
                assert last["type"] == "Normal" and last["message"].startswith("replicas ")
                assert " -> 1: " in last["message"]
                # The burst put it in panic mode, which lasts a stable window (3 s): no scale
                # down before that has passed since the last panic decision.
                panics = [at(e) for e in events("chat") if e["reason"] == "Panic"]
                assert panics
                assert (min(at(e) for e in down) - max(panics)).total_seconds() >= 3

                # Waking from zero: the annotation is enough.
                store.patch(
                    LLMD,
                    NAMESPACE,
                    "sleepy",
                    "application/merge-patch+json",
                    {"metadata": {"annotations": {"kvpilot.dev/wake": str(time.time())}}},
                )
                await eventually(
                    lambda: store.get(LLMD, NAMESPACE, "sleepy")["spec"]["replicas"] == 1, "a wake"
                )
                woke = await eventually(
                    lambda: [e for e in events("sleepy") if e["reason"] == "WakeFromZero"],
                    "the wake Event",
                )
                assert "replicas 0 -> 1" in woke[0]["message"]

                # Live tuning: a full KV cache -> a canary with more memory for it, which the
                # reconciler renders as one replica of a Deployment of its own.
                def tuning():
                    raw = store.get(LLMD, NAMESPACE, "tuned")["metadata"].get("annotations") or {}
                    return json.loads(raw.get("kvpilot.dev/engine-tuning", "null"))

                def deployment(name):
                    items, _ = store.list(DEPLOYMENTS, NAMESPACE)
                    return next((d for d in items if d["metadata"]["name"] == name), None)

                def engine_flag(name, flag):
                    (engine,) = deployment(name)["spec"]["template"]["spec"]["containers"]
                    return engine["args"][engine["args"].index(flag) + 1]

                canary = await eventually(lambda: tuning(), "a tuning canary")
                assert canary["phase"] == "Canary"
                assert canary["settings"]["gpuMemoryUtilization"] == pytest.approx(0.95)
                await eventually(
                    lambda: (
                        (deployment("tuned-canary") or {}).get("spec", {}).get("replicas")
                        == 1
                        == deployment("tuned")["spec"]["replicas"]
                    ),
                    "the canary Deployment beside one main replica",
                )
                assert engine_flag("tuned-canary", "--gpu-memory-utilization") == "0.95"
                assert engine_flag("tuned", "--gpu-memory-utilization") == "0.9"
                template = deployment("tuned-canary")["spec"]["template"]["metadata"]["labels"]
                assert template["kvpilot.dev/canary"] == "true"
                selector = store.get(SERVICES, NAMESPACE, "tuned")["spec"]["selector"]
                assert selector.items() <= template.items()  # it serves behind the same Service

                # As the Deployment controllers would: a main pod goes, a canary pod comes. It
                # preempts more than the other: rolled back, with a Warning.
                store.delete(PODS, NAMESPACE, "tuned-1")
                await engine_pod("tuned-canary", "0", labels=template, grow={"preemptions": 5},
                                 kv=0.9, running=4, waiting=0)  # fmt: skip
                await eventually(lambda: tuning()["phase"] == "RolledBack", "a rollback")
                assert "preemptions went from 0.000/s" in tuning()["reason"]
                # Rendered: the canary retired, both replicas on the previous (planned) settings.
                await eventually(
                    lambda: (
                        deployment("tuned-canary")["spec"]["replicas"] == 0
                        and deployment("tuned")["spec"]["replicas"] == 2
                    ),
                    "the canary retired",
                )
                assert engine_flag("tuned", "--gpu-memory-utilization") == "0.9"
                reasons = await eventually(
                    lambda: (
                        {e["reason"]: e["type"] for e in events("tuned")}.get("TuningRolledBack")
                        and {e["reason"]: e["type"] for e in events("tuned")}
                    ),
                    "the tuning Events",
                )
                assert (
                    reasons["TuningCanary"] == "Normal" and reasons["TuningRolledBack"] == "Warning"
                )

                # A steady fleet: its decisions stop changing, and so do the status writes.
                def status_writes():
                    return sum(
                        1 for c in cluster.emulator.calls
                        if c.user == OPERATOR_TOKEN and c.name == "steady"
                        and c.subresource == "status" and c.verb == "patch"
                    )  # fmt: skip

                await eventually(
                    lambda: "lastDecision" in store.get(LLMD, NAMESPACE, "steady")["status"],
                    "a decision for steady",
                )
                scraped, written = steady.scrapes, status_writes()
                await eventually(lambda: steady.scrapes >= scraped + 6, "six more rounds")
                # (A window whose span crosses a half second between rounds is a change.)
                assert status_writes() - written <= 2

                # mode: external -> never scaled, no decision written, no Event.
                ext = store.get(LLMD, NAMESPACE, "ext")
                assert ext["spec"]["replicas"] == 3
                assert not {"desiredReplicas", "lastDecision"} & set(ext.get("status", {}))
                # (The reconciler's own Events about ext are not the autoscaler's.)
                assert not [e for e in events("ext") if e["reason"] in SCALING_REASONS]
                touched = [
                    c for c in cluster.emulator.calls
                    if c.user == OPERATOR_TOKEN and c.name == "ext"
                    and c.subresource == "scale"
                ]  # fmt: skip
                assert touched == []
        finally:
            for engine in engines:
                await engine.runner.cleanup()
            print((tmp_path / "operator.log").read_text()[-5000:])
