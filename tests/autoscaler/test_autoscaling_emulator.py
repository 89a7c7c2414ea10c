"""The autoscaling timer in a real kopf process against the API emulator: pressure up ->
replicas up with an Event; pressure gone -> down after the window; a wake annotation -> up from
zero; a full KV cache -> a tuning canary, rolled back when it preempts more; mode external ->
never touched.

Engines are stand-ins: local HTTP servers bound to each emulated pod's loopback ``podIP`` and
container port, serving the engine's metric names as a prometheus_client registry renders
them. Nothing maps addresses: the operator scrapes what the Pod objects say.
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
    OPERATOR_TOKEN,
    create_ready_pod,
    operator_process,
    running_emulator,
)

# A real operator process on a shared 2-core machine: 10-25 s.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).parents[2]
LLMD = ("kvpilot.dev", "v1alpha1", "llmdeployments")
EVENTS = ("", "v1", "events")
NAMESPACE = "default"
SCALING_REASONS = {
    "ScaleUp",
    "ScaleDown",
    "Panic",
    "PendingPods",
    "ScaleToZero",
    "WakeFromZero",
    "BelowMinimum",
    "AboveMaximum",
    "GPUBudget",
    "LongContext",
}


class Engine:
    """A stand-in engine's /metrics at a pod's address; ``load`` is read at every scrape, and
    the counters in ``grow`` go up by their step at every scrape."""

    def __init__(self, render, grow=None, **load):
        self.render = render
        self.load = load
        self.grow = grow or {}
        self.runner = None

    async def handle(self, request):
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

        async def engine_pod(owner, index, *, extra_labels=None, grow=None, **load) -> Engine:
            labels = {**manifests.selector_labels(owner), **(extra_labels or {})}
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

                # Live tuning: a full KV cache -> a canary with more memory for it. The canary pod
                # (the reconciler's job, stood in for here) preempts more than the others: it is
                # rolled back, with a Warning.
                def tuning():
                    raw = store.get(LLMD, NAMESPACE, "tuned")["metadata"].get("annotations") or {}
                    return json.loads(raw.get("kvpilot.dev/engine-tuning", "null"))

                canary = await eventually(lambda: tuning(), "a tuning canary")
                assert canary["phase"] == "Canary"
                assert canary["settings"]["gpuMemoryUtilization"] == pytest.approx(0.95)
                await engine_pod("tuned", "canary", extra_labels={"kvpilot.dev/canary": "true"},
                                 grow={"preemptions": 5}, kv=0.9, running=4, waiting=0)  # fmt: skip
                await eventually(lambda: tuning()["phase"] == "RolledBack", "a rollback")
                assert "preemptions went from 0.000/s" in tuning()["reason"]
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
