"""The operator's API calls against the Helm chart's ClusterRole.

The real ``kvpilot operator`` runs a scenario that exercises every code path that talks to the
API server (create, update, readiness, a hub model with a token Secret, a created model cache
claim, an invalid spec, autoscaling, deletion). The emulator records each call with the
operator's identity; every call must be granted by the chart's ClusterRole, and every grant
must be used: the chart asks for exactly what the operator needs.
"""

from __future__ import annotations

import base64
import pathlib
import re
import shutil
import subprocess

import pytest
import yaml

from tests.operator.emulator import (
    DEPLOYMENTS,
    LLMD,
    OPERATOR_TOKEN,
    ApiCall,
    ApiError,
    llm_deployment,
    running_emulator,
    running_operator,
    settled,
    wait_for,
)

ROOT = pathlib.Path(__file__).parents[2]
CHART = ROOT / "charts" / "kvpilot"
HELM = ROOT / ".tools" / "bin" / "helm"
CONFIGS = pathlib.Path(__file__).parent / "configs"
SECRETS = ("", "v1", "secrets")
CLAIMS = ("", "v1", "persistentvolumeclaims")


def cluster_role_rules() -> list[dict]:
    """The ClusterRole's rules: rendered by ``helm template``, else read from the rule template."""
    if HELM.exists():
        rendered = subprocess.run(
            [str(HELM), "template", "kvpilot", str(CHART), "--show-only", "templates/rbac.yaml"],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout  # fmt: skip
        (role,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "ClusterRole"]
        return role["rules"]
    template = (CHART / "templates" / "_rbac_rules.tpl").read_text()
    blocks = re.findall(r'{{-? define "kvpilot\.\w+Rules" -?}}(.*?){{-? end }}', template, re.S)
    return [rule for block in blocks for rule in yaml.safe_load(block)]


def grants(rules: list[dict]) -> set[tuple[str, str, str]]:
    """Every (apiGroup, resource, verb) the rules grant."""
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def allowed(call: ApiCall, granted: set[tuple[str, str, str]]) -> bool:
    return any(
        group in (call.group, "*")
        and resource in (call.rbac_resource, "*")
        and verb in (call.verb, "*")
        for group, resource, verb in granted
    )


def status_of(cluster, name: str) -> dict:
    return cluster.store.get(LLMD, "default", name).get("status") or {}


@pytest.fixture(scope="module")
def recorded_calls(tmp_path_factory) -> list[ApiCall]:
    """Run the scenario; return the operator's calls."""
    model_dir = tmp_path_factory.mktemp("model")
    shutil.copy(CONFIGS / "Meta-Llama-3-8B.json", model_dir / "config.json")
    gpu = {"model": {"source": f"file://{model_dir}"}, "gpu": {"type": "H100-80GB"}}
    with running_emulator() as cluster:
        cluster.install_crd(ROOT / "crds" / "llmdeployment.yaml")
        folder = tmp_path_factory.mktemp("operator")
        with running_operator(cluster, folder, "--retry-delay=1", "--autoscale-interval=1"):
            store = cluster.store
            store.create(
                SECRETS,
                "default",
                {
                    "metadata": {"name": "hf-token"},
                    "data": {"token": base64.b64encode(b"hf_x").decode()},
                },
            )
            store.create(LLMD, "default", llm_deployment("plain", gpu))
            cached = {**gpu, "modelCache": {"size": "40Gi", "storageClassName": "standard-rwx"}}
            store.create(LLMD, "default", llm_deployment("cached", cached))
            hub = {
                "model": {
                    "source": "hf://meta-llama/Meta-Llama-3-8B",
                    "hfTokenSecretRef": {"name": "hf-token"},
                },
                "gpu": {"type": "L4"},
            }
            store.create(LLMD, "default", llm_deployment("hub", hub))
            store.create(
                LLMD,
                "default",
                llm_deployment(
                    "invalid", {**gpu, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}}
                ),
            )
            # Below its minimum, so the autoscaler's first decision scales it up.
            store.create(
                LLMD,
                "default",
                llm_deployment(
                    "scaled",
                    {**gpu, "replicas": 1, "autoscaling": {"minReplicas": 2, "maxReplicas": 4}},
                ),
            )

            wait_for(
                lambda: status_of(cluster, "plain").get("observedGeneration") == 1,
                "plain reconciled",
            )
            wait_for(
                lambda: store.get(CLAIMS, "default", "cached-model-cache"),
                "model cache claim created",
            )
            wait_for(
                lambda: any(
                    c["reason"] == "ConfigUnavailable"
                    for c in status_of(cluster, "hub").get("conditions", [])
                ),
                "hub reported",
            )
            wait_for(
                lambda: status_of(cluster, "invalid").get("observedGeneration") == 1,
                "invalid reported",
            )
            wait_for(
                lambda: store.get(DEPLOYMENTS, "default", "scaled")["spec"]["replicas"] == 2,
                "autoscaled to its minimum",
            )

            store.patch(
                LLMD,
                "default",
                "plain",
                "application/merge-patch+json",
                {"spec": {"engine": {"maxModelLen": 2048}}},
            )
            wait_for(
                lambda: status_of(cluster, "plain").get("observedGeneration") == 2, "plain updated"
            )
            rollout = {
                "observedGeneration": 2,
                "replicas": 1,
                "updatedReplicas": 1,
                "readyReplicas": 1,
                "availableReplicas": 1,
            }
            store.patch(
                DEPLOYMENTS,
                "default",
                "plain",
                "application/merge-patch+json",
                {"status": rollout},
                subresource="status",
            )
            wait_for(lambda: status_of(cluster, "plain").get("readyReplicas") == 1, "plain ready")
            # Drift of every child is repaired by the next reconcile (here: after a spec change that
            # also expands the model cache claim).
            merge = "application/merge-patch+json"
            store.patch(
                ("", "v1", "services"),
                "default",
                "cached",
                merge,
                {"spec": {"ports": [{"name": "http", "port": 9999}]}},
            )
            store.patch(
                ("policy", "v1", "poddisruptionbudgets"),
                "default",
                "cached",
                merge,
                {"spec": {"maxUnavailable": 3}},
            )
            store.patch(
                LLMD, "default", "cached", merge, {"spec": {"modelCache": {"size": "50Gi"}}}
            )
            wait_for(
                lambda: (
                    "app"
                    not in store.get(("", "v1", "services"), "default", "cached")["spec"][
                        "selector"
                    ]
                ),
                "Service repaired",
            )
            wait_for(
                lambda: (
                    store.get(("policy", "v1", "poddisruptionbudgets"), "default", "cached")[
                        "spec"
                    ]["maxUnavailable"]
                    == 1
                ),
                "PDB repaired",
            )
            wait_for(
                lambda: (
                    store.get(CLAIMS, "default", "cached-model-cache")["spec"]["resources"][
                        "requests"
                    ]["storage"]
                    == "50Gi"
                ),
                "claim expanded",
            )
            wait_for(
                lambda: settled(store, LLMD, "default", "plain"), "kopf done with plain's update"
            )
            store.delete(LLMD, "default", "plain")

            def gone() -> bool:
                try:
                    store.get(LLMD, "default", "plain")
                except ApiError:
                    return True
                return False

            wait_for(gone, "plain deleted (finalizer released)")
        return [c for c in cluster.emulator.calls if c.user == OPERATOR_TOKEN]


def test_every_call_is_granted(recorded_calls):
    granted = grants(cluster_role_rules())
    denied = sorted(
        {(c.group, c.rbac_resource, c.verb) for c in recorded_calls if not allowed(c, granted)}
    )
    assert denied == [], f"the operator needs these (apiGroup, resource, verb) grants: {denied}"


def test_nothing_granted_is_unused(recorded_calls):
    unused = sorted(
        g for g in grants(cluster_role_rules()) if not any(allowed(c, {g}) for c in recorded_calls)
    )
    assert unused == [], f"granted but never used (apiGroup, resource, verb): {unused}"
