"""The router as the operator deploys it, on the real control plane, in front of real engines.

The chart installs the operator with ``router.enabled``; each LLMDeployment gets a router pod
(``kvpilot router --kubernetes``, run by the kubelet stand-in as a local process with its
ServiceAccount's token, so its RBAC applies) that watches its engine pods. The tests talk to
the router at its pod IP (no ClusterIP is reachable here) and check:

- discovery: the router's replicas are exactly the Ready engine pods, and it answers through
  them; ``status.endpoint`` names the router's Service; the router's calls are all allowed;
- scale-down during 20 streams: the pod removed is the one the operator gave the lowest
  deletion cost; its preStop hook (``kvpilot drain``) waits for its streams, every stream ends
  whole, and after its deletion the router sends it nothing;
- wake from zero: a request for a deployment at 0 replicas is held by the router, which writes
  the wake annotation and the held count; the autoscaler scales up, the held request is
  answered, and the count goes back to 0.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from collections.abc import Iterator

import pytest

from tests.cluster import Cluster, condition, dump, wait_for

pytestmark = pytest.mark.slow

ENGINE = {
    "engine": {"maxModelLen": 1024, "maxNumSeqs": 16},
    "resources": {"requests": {"cpu": "100m", "memory": "1600Mi"}, "limits": {"memory": "1600Mi"}},
}
STREAMS = 20
STREAM_TOKENS = 400


@pytest.fixture(scope="module")
def routed(kube: Cluster, crd: dict) -> Iterator[str]:
    """A namespace with an operator (router on) watching it."""
    home = kube.create_namespace("router")
    with kube.operator(home, values={"router": {"enabled": True}}):
        yield home
    kube.kubectl("delete", "namespace", home, "--wait=false", check=False)


def pods(kube: Cluster, namespace: str, selector: str) -> list[dict]:
    return kube.items(f"/api/v1/namespaces/{namespace}/pods", labelSelector=selector)


def ready(pod: dict) -> bool:
    return condition(pod, "Ready").get("status") == "True" and not pod["metadata"].get(
        "deletionTimestamp"
    )


def engine_pods(kube: Cluster, namespace: str, name: str) -> list[dict]:
    return [p for p in pods(kube, namespace, f"kvpilot.dev/llmdeployment={name}") if ready(p)]


def router_url(kube: Cluster, namespace: str, name: str) -> str:
    def find() -> str | None:
        live = [p for p in pods(kube, namespace, f"kvpilot.dev/router={name}") if ready(p)]
        return f"http://{live[0]['status']['podIP']}:8000" if len(live) == 1 else None

    return wait_for(find, f"the router of {name}", timeout=180)


def router_replicas(url: str) -> set[str]:
    with urllib.request.urlopen(f"{url}/health", timeout=10) as answer:
        return set(json.load(answer)["replicas"])
    # a 503 (no replica yet) raises, which wait_for counts as "not yet"


def post(url: str, body: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        assert answer.status == 200
        return json.load(answer)


def completions_received(kube: Cluster, namespace: str, pod: str) -> int:
    """POST /v1/completions the engine of ``pod`` has answered (its access log: one line
    when each answer starts)."""
    path = kube.kubelet.log_path(namespace, pod, "engine")
    text = path.read_text(errors="replace") if path is not None and path.exists() else ""
    return text.count('"POST /v1/completions HTTP/1.1"')


class Stream(threading.Thread):
    """One streamed completion through the router; records its chunks."""

    def __init__(self, url: str, model: str, i: int) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.i = url, model, i
        self.started = threading.Event()
        self.tokens = 0  # the usage chunk's completion_tokens
        self.finish_reason: str | None = None
        self.done = False
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {
            "model": self.model,
            "prompt": f"Story number {self.i}: once upon a time",
            "max_tokens": STREAM_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=300) as answer:
                for raw in answer:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    self.started.set()
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        self.done = True
                        break
                    chunk = json.loads(data)
                    if chunk.get("usage"):
                        self.tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices") or []:
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.started.set()


def test_the_router_discovers_the_engine_pods_and_answers_through_them(
    kube: Cluster, routed: str, tiny_model_source: str
):
    model = tiny_model_source.removeprefix("file://")
    kube.create_llmd(
        routed, "chat", {"model": {"source": tiny_model_source}, "replicas": 2, **ENGINE}
    )
    wait_for(lambda: len(engine_pods(kube, routed, "chat")) == 2, "two engines", timeout=300)
    url = router_url(kube, routed, "chat")
    expected = {f"http://{p['status']['podIP']}:8000" for p in engine_pods(kube, routed, "chat")}
    wait_for(lambda: router_replicas(url) == expected, "the router's replicas")
    answer = post(url, {"model": model, "prompt": "Hello", "max_tokens": 4})
    assert answer["choices"][0]["text"], dump(answer)
    status = kube.llmd(routed, "chat")["status"]
    assert status["endpoint"] == f"http://chat-router.{routed}.svc.cluster.local:8000/v1"
    # The router runs as its own ServiceAccount, and every call it made was allowed.
    user = f"system:serviceaccount:{routed}:chat-router"
    calls = [e for e in kube.control_plane.audit_events() if e["user"]["username"] == user]
    assert calls, "the router made no API call"
    refused = [e["requestURI"] for e in calls if e["responseStatus"]["code"] == 403]
    assert refused == [], refused


def test_a_scale_down_during_20_streams_drains_the_removed_replica(
    kube: Cluster, routed: str, tiny_model_source: str
):
    model = tiny_model_source.removeprefix("file://")
    url = router_url(kube, routed, "chat")

    def two_ready() -> dict[str, dict] | None:
        engines = {p["metadata"]["name"]: p for p in engine_pods(kube, routed, "chat")}
        return engines if len(engines) == 2 else None

    before = wait_for(two_ready, "the two engines the discovery test leaves, both Ready")
    streams = [Stream(url, model, i) for i in range(STREAMS)]
    for stream in streams:
        stream.start()
    for stream in streams:
        stream.started.wait(300)
    assert [s.error for s in streams if s.error] == []
    received = {name: completions_received(kube, routed, name) for name in before}

    kube.kubectl("scale", "llmd", "chat", "-n", routed, "--replicas=1")

    def deleted() -> dict | None:
        gone = [
            p
            for p in pods(kube, routed, "kvpilot.dev/llmdeployment=chat")
            if p["metadata"].get("deletionTimestamp")
        ]
        return gone[0] if gone else None

    victim = wait_for(deleted, "the scale-down's pod deletion")
    name = victim["metadata"]["name"]
    (survivor,) = set(before) - {name}
    cost = "controller.kubernetes.io/pod-deletion-cost"
    costs = {
        n: int((kube.get(f"/api/v1/namespaces/{routed}/pods/{n}") or before[n])["metadata"]
               .get("annotations", {}).get(cost, "0"))
        for n in before
    }  # fmt: skip
    assert costs[name] < costs[survivor], costs
    victim_url = f"http://{victim['status']['podIP']}:8000"
    wait_for(lambda: victim_url not in router_replicas(url), "the router to drop the pod")
    for i in range(5):
        post(url, {"model": model, "prompt": f"After the scale-down {i}", "max_tokens": 4})

    for stream in streams:
        stream.join(300)
    cut = [(s.i, s.tokens, s.finish_reason, s.done, s.error) for s in streams
           if s.error or not s.done or s.finish_reason != "length" or s.tokens != STREAM_TOKENS]  # fmt: skip
    assert cut == [], cut
    # The drained engine answered nothing after the streams it had; the others went elsewhere.
    assert completions_received(kube, routed, name) == received[name]
    assert completions_received(kube, routed, survivor) == received[survivor] + 5
    # The pod went through its preStop hook (kvpilot drain) before SIGTERM. How many requests
    # it waited for depends on how far the streams had got when the deletion came (timing), so
    # it is not asserted; that none was cut is (above).
    log = kube.kubelet.log_path(routed, name, "engine")
    wait_for(
        lambda: re.search(r"kvpilot drain: idle \(had up to (\d+) requests", log.read_text()),
        "the preStop hook's report",
    )


def test_a_request_wakes_a_deployment_at_zero_and_is_answered(
    kube: Cluster, routed: str, tiny_model_source: str
):
    model = tiny_model_source.removeprefix("file://")
    spec = {
        "model": {"source": tiny_model_source},
        "replicas": 0,
        "router": {"wakeTimeoutSeconds": 280},
        "autoscaling": {"minReplicas": 0, "maxReplicas": 1, "idleSeconds": 600},
        **ENGINE,
    }
    kube.create_llmd(routed, "sleepy", spec)
    url = router_url(kube, routed, "sleepy")
    wait_for(
        lambda: condition(kube.llmd(routed, "sleepy"), "Ready").get("reason") == "ScaledToZero",
        "scaled to zero",
    )
    answers: list[dict] = []
    held = threading.Thread(
        target=lambda: answers.append(
            post(url, {"model": model, "prompt": "Wake up", "max_tokens": 4}, timeout=300)
        ),
        daemon=True,
    )
    held.start()
    annotations = wait_for(
        lambda: (
            kube.llmd(routed, "sleepy")["metadata"].get("annotations", {}).get("kvpilot.dev/wake")
        ),
        "the router's wake request",
    )
    assert float(annotations) > 0

    def held_requests() -> str | None:
        annotations = kube.llmd(routed, "sleepy")["metadata"].get("annotations", {})
        return annotations.get("kvpilot.dev/held-requests")

    # The held request is demand the autoscaler reads, reported until it is answered.
    wait_for(lambda: held_requests() == "1", "the router's held-request count")
    wait_for(lambda: kube.llmd(routed, "sleepy")["spec"]["replicas"] == 1, "the wake")
    held.join(300)
    assert answers and answers[0]["choices"][0]["text"], dump(answers)
    wait_for(lambda: held_requests() == "0", "the router's report that none is held")
    woke = [e for e in kube.events(routed, "sleepy") if e["reason"] == "WakeFromZero"]
    assert woke and "replicas 0 -> 1" in woke[-1]["message"], dump(woke)
