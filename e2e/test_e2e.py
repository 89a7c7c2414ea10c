"""End to end on a real cluster: install the chart, serve the CPU example, chat, scale, roll, delete.

Skipped without KUBECONFIG. e2e/run.sh builds the images, starts a kind cluster, loads the
images into it and runs this file; e2e/README.md gives the steps one by one.
Env: KVPILOT_E2E_EXAMPLE (default examples/smollm2-cpu.yaml), KVPILOT_E2E_READY_TIMEOUT
(seconds, default 900: the first start converts the model on CPU).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
import yaml

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="needs a cluster (KUBECONFIG)"),
]

REPO = pathlib.Path(__file__).resolve().parents[1]
TOOLS = REPO / ".tools" / "bin"
RELEASE = "kvpilot"
OPERATOR_NAMESPACE = "kvpilot-system"
EXAMPLE = REPO / os.environ.get("KVPILOT_E2E_EXAMPLE", "examples/smollm2-cpu.yaml")
READY_TIMEOUT = float(os.environ.get("KVPILOT_E2E_READY_TIMEOUT", "900"))
CHILD_KINDS = ("deployments.apps", "services", "poddisruptionbudgets.policy")


def _tool(name: str) -> str:
    """The helm/kubectl binary from hack/install-tools.sh, else the one on PATH."""
    local = TOOLS / name
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} not found: run hack/install-tools.sh")
    return found


def kubectl(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([_tool("kubectl"), *args], capture_output=True, text=True, timeout=300)
    if check and done.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {done.stderr}")
    return done


def get_json(*args: str) -> dict:
    return json.loads(kubectl("get", *args, "-o", "json").stdout)


def wait_for(what: str, condition: Callable[[], Any], timeout: float, interval: float = 3.0) -> Any:
    """Poll ``condition`` until it returns something truthy; fail naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def condition_status(obj: dict, type_: str) -> str | None:
    for condition in obj.get("status", {}).get("conditions", []):
        if condition["type"] == type_:
            return condition["status"]
    return None


@pytest.fixture(scope="module")
def operator() -> Iterator[None]:
    """The chart installed with its defaults (images loaded into the cluster by e2e/run.sh)."""
    helm = _tool("helm")
    subprocess.run(
        [
            helm, "upgrade", "--install", RELEASE, str(REPO / "charts" / "kvpilot"),
            "--namespace", OPERATOR_NAMESPACE, "--create-namespace", "--wait", "--timeout", "5m",
        ],
        check=True,
        timeout=600,
    )  # fmt: skip
    yield
    subprocess.run([helm, "uninstall", RELEASE, "--namespace", OPERATOR_NAMESPACE, "--wait"])
    kubectl("delete", "namespace", OPERATOR_NAMESPACE, "--ignore-not-found", "--wait=false")


@pytest.fixture(scope="module")
def namespace(operator: None) -> Iterator[str]:
    name = f"kvpilot-e2e-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", name)
    yield name
    # LLMDeployments first, while the operator still runs to release their finalizers.
    kubectl("delete", "llmd", "--all", "--namespace", name, "--timeout=120s", check=False)
    kubectl("delete", "namespace", name, "--ignore-not-found", "--wait=false")


@pytest.fixture(scope="module")
def deployment(namespace: str) -> dict:
    """The CPU example applied and Ready; returns it as the API server has it."""
    manifest = yaml.safe_load(EXAMPLE.read_text())
    name = manifest["metadata"]["name"]
    kubectl("apply", "--namespace", namespace, "-f", str(EXAMPLE))

    def ready() -> dict | None:
        obj = get_json("llmd", name, "--namespace", namespace)
        return obj if condition_status(obj, "Ready") == "True" else None

    return wait_for(f"LLMDeployment {name} Ready", ready, READY_TIMEOUT)


def children(namespace: str, owner_uid: str) -> list[dict]:
    """Deployments, Services and PodDisruptionBudgets owned by the object with ``owner_uid``."""
    found = []
    for kind in CHILD_KINDS:
        for item in get_json(kind, "--namespace", namespace)["items"]:
            owners = item["metadata"].get("ownerReferences", [])
            if any(o["uid"] == owner_uid for o in owners):
                found.append(item)
    return found


def owned_deployment(namespace: str, owner_uid: str) -> dict:
    (deployment,) = [c for c in children(namespace, owner_uid) if c["kind"] == "Deployment"]
    return deployment


@pytest.fixture
def port_forward(namespace: str, deployment: dict) -> Iterator[str]:
    """``kubectl port-forward`` to the example's Service; yields the local base URL."""
    (service,) = [
        c for c in children(namespace, deployment["metadata"]["uid"]) if c["kind"] == "Service"
    ]
    port = service["spec"]["ports"][0]["port"]
    process = subprocess.Popen(
        [_tool("kubectl"), "port-forward", "--namespace", namespace,
         f"service/{service['metadata']['name']}", f":{port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        line = process.stdout.readline()
        match = re.search(r"127\.0\.0\.1:(\d+)", line)
        assert match, f"kubectl port-forward said: {line}"
        yield f"http://127.0.0.1:{match.group(1)}/v1"
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_children_and_status(namespace: str, deployment: dict) -> None:
    owned = children(namespace, deployment["metadata"]["uid"])
    assert sorted(c["kind"] for c in owned) == ["Deployment", "PodDisruptionBudget", "Service"]
    status = deployment["status"]
    assert status["observedGeneration"] == deployment["metadata"]["generation"]
    assert status["readyReplicas"] == status["replicas"] >= 1
    assert condition_status(deployment, "Sized") == "True"


def test_chat_through_the_service(port_forward: str) -> None:
    client = openai.OpenAI(base_url=port_forward, api_key="unused", max_retries=5)
    (model,) = [m.id for m in client.models.list()]
    for prompt in ("What is the capital of France?", "Write a haiku about Kubernetes."):
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=24,
            temperature=0,
        )
        choice = reply.choices[0]
        assert choice.message.content.strip()
        assert choice.finish_reason in ("stop", "length")
        assert 0 < reply.usage.completion_tokens <= 24
        assert reply.usage.prompt_tokens > 0


def test_kubectl_scale(namespace: str, deployment: dict) -> None:
    name = deployment["metadata"]["name"]
    kubectl("scale", "llmd", name, "--namespace", namespace, "--replicas=2")

    # Both replicas exist (their readiness depends on the cluster's spare CPUs, not on kvpilot).
    def scaled() -> bool:
        child = owned_deployment(namespace, deployment["metadata"]["uid"])
        parent = get_json("llmd", name, "--namespace", namespace)
        return child["spec"]["replicas"] == 2 and parent["status"].get("replicas") == 2

    wait_for(f"{name} at 2 replicas", scaled, 300)
    kubectl("scale", "llmd", name, "--namespace", namespace, "--replicas=1")
    wait_for(
        f"{name} back to 1 replica",
        lambda: owned_deployment(namespace, deployment["metadata"]["uid"])["spec"]["replicas"] == 1,
        300,
    )


def test_spec_change_rolls_the_deployment(namespace: str, deployment: dict) -> None:
    name = deployment["metadata"]["name"]
    uid = deployment["metadata"]["uid"]
    before = owned_deployment(namespace, uid)
    max_num_seqs = 7
    kubectl(
        "patch", "llmd", name, "--namespace", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"engine": {"maxNumSeqs": max_num_seqs}}}),
    )  # fmt: skip

    def rolled() -> dict | None:
        child = owned_deployment(namespace, uid)
        if child["metadata"]["generation"] == before["metadata"]["generation"]:
            return None
        return child

    after = wait_for(f"{name}'s Deployment updated", rolled, 300)
    (container,) = after["spec"]["template"]["spec"]["containers"]
    arguments = " ".join(container.get("command", []) + container.get("args", []))
    assert re.search(rf"--max-num-seqs[= ]{max_num_seqs}\b", arguments), arguments
    kubectl(
        "rollout", "status", f"deployment/{after['metadata']['name']}",
        "--namespace", namespace, f"--timeout={int(READY_TIMEOUT)}s",
    )  # fmt: skip

    def observed() -> bool:
        obj = get_json("llmd", name, "--namespace", namespace)
        return (
            obj["status"].get("observedGeneration") == obj["metadata"]["generation"]
            and condition_status(obj, "Ready") == "True"
        )

    wait_for(f"{name} Ready at its new generation", observed, READY_TIMEOUT)


def test_delete_removes_everything(namespace: str, deployment: dict) -> None:
    name = deployment["metadata"]["name"]
    uid = deployment["metadata"]["uid"]
    kubectl("delete", "llmd", name, "--namespace", namespace, "--wait=true", "--timeout=5m")
    wait_for(f"{name}'s children deleted", lambda: not children(namespace, uid), 300)

    def no_pods() -> bool:
        pods = get_json("pods", "--namespace", namespace)["items"]
        return not pods

    wait_for(f"{name}'s pods gone", no_pods, 300)
    gone = kubectl("get", "llmd", name, "--namespace", namespace, check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr
