"""The router's children (pure), the engine pod's drain hook, and the scale-down's choice."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import kubernetes_validate
import pytest

from kvpilot.engine.model_shape import ModelShape
from kvpilot.operator import drain, manifests, router_manifests, scale_down
from kvpilot.operator.autoscaling_handlers import HELD_REQUESTS_ANNOTATION, WAKE_ANNOTATION
from kvpilot.operator.planner import plan_for_spec
from kvpilot.operator.signals import MetricSample
from kvpilot.operator.spec import SpecError, parse_spec
from kvpilot.router import kubernetes as router_kubernetes

CONFIGS = Path(__file__).parent / "configs"
CPU = {"resources": {"limits": {"memory": "4Gi"}}}


def objects(spec: dict, name: str = "chat") -> dict[str, dict]:
    parsed = parse_spec(spec)
    return {
        o["kind"]: o for o in router_manifests.children(name, "team-a", parsed, "img/kvpilot:1")
    }


def test_router_children_are_valid_objects_selecting_only_the_router_pods():
    rendered = objects({"model": {"source": "file:///models/tiny"}, **CPU})
    for obj in rendered.values():
        kubernetes_validate.validate(obj, "1.32.0", strict=True)
        assert obj["metadata"]["name"] == "chat-router"
        assert manifests.LLMDEPLOYMENT_LABEL not in obj["metadata"]["labels"]
    template = rendered["Deployment"]["spec"]["template"]
    assert manifests.LLMDEPLOYMENT_LABEL not in template["metadata"]["labels"]
    assert rendered["Service"]["spec"]["selector"] == {"kvpilot.dev/router": "chat"}
    assert template["spec"]["serviceAccountName"] == "chat-router"
    (router,) = template["spec"]["containers"]
    assert router["args"] == [
        "router", "--kubernetes", "--namespace", "team-a", "--llmdeployment", "chat",
        "--host", "0.0.0.0", "--port", "8000", "--wake-timeout", "300",
        "--tokenizer", "/models/tiny",
    ]  # fmt: skip
    # At zero replicas the router must stay reachable: its probe is not /health.
    assert router["readinessProbe"]["httpGet"]["path"] == "/metrics"
    assert router_manifests.endpoint("chat", "team-a") == (
        "http://chat-router.team-a.svc.cluster.local:8000/v1"
    )


def test_the_router_role_is_what_router_kubernetes_calls():
    role = objects(CPU)["Role"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
        {
            "apiGroups": ["kvpilot.dev"],
            "resources": ["llmdeployments"],
            "resourceNames": ["chat"],
            "verbs": ["list", "watch", "patch"],
        },
    ]
    binding = objects(CPU)["RoleBinding"]
    assert binding["roleRef"]["name"] == "chat-router"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "chat-router", "namespace": "team-a"}
    ]
    assert WAKE_ANNOTATION == router_kubernetes.WAKE_ANNOTATION
    assert HELD_REQUESTS_ANNOTATION == router_kubernetes.HELD_REQUESTS_ANNOTATION


def test_the_router_tokenizer_and_settings_follow_the_spec():
    def args(spec: dict) -> list[str]:
        (c,) = objects({**CPU, **spec})["Deployment"]["spec"]["template"]["spec"]["containers"]
        return c["args"]

    hub = args(
        {
            "model": {"source": "hf://org/m", "hfTokenSecretRef": {"name": "tok"}},
            "gpu": {"type": "L4"},
        }
    )
    assert hub[hub.index("--tokenizer") + 1] == "org/m"
    assert "--tokenizer" not in args({})  # the built-in model: consistent hashing
    assert "--tokenizer" not in args(
        {"model": {"source": "pvc://claim/m", "config": {"model_type": "llama"}}}
    )
    timed = args({"router": {"wakeTimeoutSeconds": 30}})
    assert timed[timed.index("--wake-timeout") + 1] == "30"
    assert parse_spec({**CPU, "router": {"enabled": False}}).router.enabled is False
    with pytest.raises(SpecError, match="spec.router.wakeTimeoutSeconds"):
        parse_spec({**CPU, "router": {"wakeTimeoutSeconds": 7200}})
    spec = parse_spec({**CPU, "router": {"enabled": False}})
    assert not router_manifests.router_enabled(spec, True)
    assert not router_manifests.router_enabled(parse_spec(CPU), False)


def test_a_long_name_still_makes_a_valid_service_name():
    name = "a" * 63
    assert len(router_manifests.router_name(name)) <= 63
    assert router_manifests.router_name(name) != router_manifests.router_name("a" * 62 + "b")


def test_the_engine_pod_drains_before_it_stops():
    spec = parse_spec({**CPU, "engine": {"maxModelLen": 4096}})
    shape = ModelShape.from_hf_config(
        json.loads((CONFIGS / "SmolLM2-135M-Instruct.json").read_text())
    )
    pod = manifests.pod_template("chat", spec, plan_for_spec(spec, shape))["spec"]
    assert pod["terminationGracePeriodSeconds"] == manifests.TERMINATION_GRACE_SECONDS
    (engine,) = pod["containers"]
    command = engine["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["kvpilot", "drain"]
    drain_s = float(command[command.index("--timeout") + 1])
    # After the drain, SIGTERM: the engine aborts what is left and exits before the SIGKILL.
    shutdown_s = float(engine["args"][engine["args"].index("--shutdown-timeout") + 1])
    assert drain_s + shutdown_s < manifests.TERMINATION_GRACE_SECONDS


def sample(pod: str, running: float, waiting: float = 0, hits: float = 0) -> MetricSample:
    return MetricSample(pod, 0.0, 0.1, running, waiting, prefix_cache_hits_total=hits)


def test_the_idlest_replica_with_the_least_cached_traffic_goes_first():
    samples = [sample("a", 3), sample("b", 1, 1, hits=500), sample("c", 2, hits=10)]
    costs = scale_down.deletion_costs(["a", "b", "c", "d"], samples)
    # in flight: a 3, b 2, c 2 (c has fewer prefix hits); d was not scraped
    assert costs == {"d": 0, "c": 1, "b": 2, "a": 3}
    assert scale_down.lowers_replicas({"spec": {"replicas": 3}}, {"spec": {"replicas": 2}})
    assert not scale_down.lowers_replicas(None, {"spec": {"replicas": 0}})
    assert not scale_down.lowers_replicas({"spec": {"replicas": 2}}, {"spec": {"replicas": 2}})


class _Metrics(BaseHTTPRequestHandler):
    """An engine's /metrics whose in-flight count falls to 0 after a few reads."""

    counts = [2, 1, 0]

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        count = self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]
        body = (
            f'vllm:num_requests_running{{model_name="m"}} {count}\n'
            'vllm:num_requests_waiting{model_name="m"} 0\n'
        ).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


def test_drain_waits_until_the_engine_is_idle(capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        args = drain.argparse.Namespace(
            url=f"http://127.0.0.1:{server.server_port}", timeout=60.0, idle_seconds=0.0,
            interval=0.0,
        )  # fmt: skip
        assert drain.run(args) == 0
    finally:
        server.shutdown()
        server.server_close()
    assert "had up to 2 requests in flight" in capsys.readouterr().out
    assert _Metrics.counts == [0]
    # An engine that is gone has nothing to wait for.
    args.url = f"http://127.0.0.1:{server.server_port}"
    assert drain.run(args) == 0
    with pytest.raises(ValueError, match="num_requests_running"):
        drain.in_flight("vllm:other 1\n")
