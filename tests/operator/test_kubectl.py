"""kubectl (v1.32, /usr/bin/kubectl) against the API emulator with the real operator running.

A user's first steps: apply the CRD and the examples, list them with ``kubectl get llmd``
(server-side printer columns), scale one, see a bad manifest refused with its field named,
delete one and see its children go.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest
import yaml

from tests.operator.emulator import (
    DEPLOYMENTS,
    LLMD,
    ApiError,
    running_emulator,
    running_operator,
    settled,
    wait_for,
)

ROOT = pathlib.Path(__file__).parents[2]
KUBECTL = shutil.which("kubectl")

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with (
        running_emulator() as running,
        running_operator(running, tmp_path_factory.mktemp("operator"), "--retry-delay=1"),
    ):
        yield running


@pytest.fixture(scope="module")
def kubectl(cluster, tmp_path_factory):
    home = tmp_path_factory.mktemp("kubectl")
    kubeconfig = cluster.write_kubeconfig(home / "config")

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        # The emulator serves no OpenAPI documents: client-side validation is off.
        command = [KUBECTL, f"--kubeconfig={kubeconfig}", f"--cache-dir={home / 'cache'}", *args]
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        if check:
            assert result.returncode == 0, result.stderr
        return result

    return run


def table(output: str) -> dict[str, dict[str, str]]:
    """``kubectl get`` output as {name: {column: value}} (columns split on 2+ spaces)."""
    header, *rows = output.strip().splitlines()
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    columns = [header[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    parsed = [
        [row[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)] for row in rows
    ]
    return {cells[0]: dict(zip(columns, cells, strict=True)) for cells in parsed}


def sized(cluster, name: str) -> dict | None:
    status = cluster.store.get(LLMD, "default", name).get("status", {})
    return next((c for c in status.get("conditions", []) if c["type"] == "Sized"), None)


def test_apply_examples_and_get(cluster, kubectl):
    assert (
        "created"
        in kubectl(
            "apply", "--validate=false", "-f", str(ROOT / "crds" / "llmdeployment.yaml")
        ).stdout
    )
    applied = kubectl("apply", "--validate=false", "-f", str(ROOT / "examples")).stdout
    names = sorted(line.split()[0].split("/")[1] for line in applied.splitlines())
    examples = (yaml.safe_load(p.read_text()) for p in (ROOT / "examples").glob("*.yaml"))
    assert names == sorted(e["metadata"]["name"] for e in examples)
    # The CPU example plans from the built-in model; hub examples cannot read their config
    # offline and say so.
    wait_for(
        lambda: (s := sized(cluster, "smollm2")) and s["status"] == "True",
        "smollm2 sized",
        timeout=120,
    )
    wait_for(
        lambda: (s := sized(cluster, "llama-3-8b")) and s["reason"] == "ConfigUnavailable",
        "hub example reported",
    )

    rows = table(kubectl("get", "llmd").stdout)
    assert set(rows) == set(names)
    assert (
        rows["smollm2"]["GPU"],
        rows["smollm2"]["TP"],
        rows["smollm2"]["GPUS/REPLICA"],
        rows["smollm2"]["REPLICAS"],
    ) == ("cpu", "1", "0", "1")
    assert rows["smollm2"]["MODEL"] == "SmolLM2-135M-Instruct"
    assert (
        kubectl("get", "llmd", "smollm2", "-o", "jsonpath={.status.plan.maxModelLen}").stdout
        == "4096"
    )


def test_scale_reaches_the_deployment(cluster, kubectl):
    kubectl("scale", "llmd/smollm2", "--replicas=2")
    wait_for(
        lambda: cluster.store.get(DEPLOYMENTS, "default", "smollm2")["spec"]["replicas"] == 2,
        "Deployment scaled",
    )
    assert table(kubectl("get", "llmd", "smollm2").stdout)["smollm2"]["REPLICAS"] == "2"


def test_invalid_manifest_is_refused_with_its_field(kubectl, tmp_path):
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(
        "apiVersion: kvpilot.dev/v1alpha1\nkind: LLMDeployment\nmetadata: {name: bad}\nspec:\n  gpu: {type: T4}\n"
    )
    result = kubectl("apply", "--validate=false", "-f", str(manifest), check=False)
    assert result.returncode != 0
    assert 'The LLMDeployment "bad" is invalid: spec.gpu.type' in result.stderr


def test_delete_removes_children(cluster, kubectl):
    wait_for(
        lambda: settled(cluster.store, LLMD, "default", "smollm2"), "kopf done with the scaling"
    )
    kubectl("delete", "-f", str(ROOT / "examples" / "smollm2-cpu.yaml"))

    def gone() -> bool:
        try:
            cluster.store.get(DEPLOYMENTS, "default", "smollm2")
        except ApiError:
            return True
        return False

    wait_for(gone, "Deployment garbage-collected")
    assert "smollm2" not in table(kubectl("get", "llmd").stdout)


def test_built_in_kinds_apply_as_json_and_protobuf_is_refused(kubectl, tmp_path):
    manifest = tmp_path / "web.yaml"
    manifest.write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: web-settings}\ndata: {mode: fast}\n"
    )
    assert (
        "configmap/web-settings created"
        in kubectl("apply", "--validate=false", "-f", str(manifest)).stdout
    )
    assert "web-settings" in table(kubectl("get", "configmaps").stdout)
    # kubectl create of a built-in kind sends protobuf, which the emulator does not decode.
    refused = kubectl("create", "deployment", "web", "--image=busybox", check=False)
    assert refused.returncode != 0 and "protobuf bodies are not understood" in refused.stderr
