"""`helm template` output: valid Kubernetes objects, a hardened operator pod, least-privilege RBAC.

Core and apiextensions objects are validated with kubernetes-validate --strict (unknown fields
fail) for the oldest Kubernetes version Chart.yaml's kubeVersion admits and the newest the
package knows. monitoring.coreos.com objects have no schema there: their metadata and label
selectors are validated as ObjectMeta and LabelSelector, and the rest is checked field by field
against the objects they point at (test_monitors_*).
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import yaml
from kubernetes_validate import utils as kubernetes_validate

from kvpilot.engine.model_shape import ModelShape
from kvpilot.operator import manifests
from kvpilot.operator.planner import plan_for_spec
from kvpilot.operator.spec import parse_spec
from tests.chart.conftest import run_helm

REPO = pathlib.Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvpilot"
VALUES_DIR = pathlib.Path(__file__).parent / "values"
EXAMPLE = REPO / "examples" / "smollm2-cpu.yaml"
# The planner's copy of SmolLM2-135M-Instruct's config.json (what the operator reads from the GGUF).
SMOLLM2_CONFIG = REPO / "tests" / "operator" / "configs" / "SmolLM2-135M-Instruct.json"
NAMESPACE = "kvpilot-system"
MONITORING_GROUP = "monitoring.coreos.com/"
RBAC_VERBS = {"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"}


def _kube_versions() -> list[str]:
    floor = re.search(
        r"(\d+\.\d+)", yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    )
    return [floor.group(1), kubernetes_validate.latest_version()]


def _of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def _one(objects: list[dict], kind: str) -> dict:
    (obj,) = _of_kind(objects, kind)
    return obj


def _validate(obj: dict, version: str) -> None:
    """Validate ``obj`` strictly, raising kubernetes_validate's ValidationError."""
    if not obj["apiVersion"].startswith(MONITORING_GROUP):
        kubernetes_validate.validate(obj, version, strict=True)
        return
    # No schema for Prometheus Operator objects: check what has a core schema by putting it
    # where Kubernetes defines that type.
    kubernetes_validate.validate(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}, version, strict=True
    )
    selector = obj["spec"]["selector"]
    kubernetes_validate.validate(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "selector-check"},
            "spec": {"selector": selector, "minAvailable": 1},
        },
        version,
        strict=True,
    )


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _operator_container(objects: list[dict]) -> dict:
    deployment = _one(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("version", _kube_versions())
def test_every_object_is_valid(rendered: list[dict], version: str) -> None:
    assert rendered
    for obj in rendered:
        try:
            _validate(obj, version)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} invalid for {version}: {e}")


def test_strict_validation_catches_an_unknown_field(default_objects: list[dict]) -> None:
    """The validation above is strict: a misspelt field in the Deployment is an error."""
    deployment = _one(default_objects, "Deployment")
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(broken, kubernetes_validate.latest_version())


def test_default_install_objects(default_objects: list[dict]) -> None:
    kinds = sorted(o["kind"] for o in default_objects)
    assert kinds == sorted(
        [
            "CustomResourceDefinition",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Deployment",
            "Service",
            "ConfigMap",
        ]
    )
    for obj in default_objects:
        if obj["kind"] not in ("ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"):
            assert obj["metadata"]["namespace"] == NAMESPACE


def test_operator_pod_is_hardened(default_objects: list[dict]) -> None:
    deployment = _one(default_objects, "Deployment")
    # Standalone kopf: never two operators at once, not even during an upgrade.
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = _operator_container(default_objects)
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["privileged"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    for kind in ("requests", "limits"):
        assert set(container["resources"][kind]) == {"cpu", "memory"}
    # The read-only root filesystem leaves /tmp, an emptyDir, as the only writable place: every
    # cache the operator uses must point there.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    env = {e["name"]: e.get("value") for e in container["env"]}
    for name in ("HOME", "HF_HOME", "KVPILOT_CACHE_DIR"):
        assert env[name].startswith("/tmp")


def test_liveness_probe_targets_the_operator_liveness_endpoint(default_objects: list[dict]) -> None:
    container = _operator_container(default_objects)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    probe = container["livenessProbe"]["httpGet"]
    liveness_args = [a for a in container["args"] if a.startswith("--liveness=")]
    assert liveness_args == [f"--liveness=http://0.0.0.0:{ports[probe['port']]}{probe['path']}"]


def _rules(role: dict) -> list[dict]:
    return role["rules"]


def test_rbac_has_no_wildcards(rendered: list[dict]) -> None:
    roles = _of_kind(rendered, "ClusterRole") + _of_kind(rendered, "Role")
    for role in roles:
        for rule in _rules(role):
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field], f"{role['kind']} rule {rule} uses a wildcard"
            assert set(rule["verbs"]) <= RBAC_VERBS
            assert "nonResourceURLs" not in rule
            # Named resources only for Secrets read cluster-wide (rbac.secretNames).
            assert "resourceNames" not in rule or rule["resources"] == ["secrets"]


def test_cluster_role_follows_crds_when_watching_every_namespace(
    default_objects: list[dict],
) -> None:
    role = _one(default_objects, "ClusterRole")
    assert {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["list", "watch"],
    } in role["rules"]


def test_cluster_role_is_bound_to_the_operator_service_account(
    default_objects: list[dict],
) -> None:
    role = _one(default_objects, "ClusterRole")
    binding = _one(default_objects, "ClusterRoleBinding")
    account = _one(default_objects, "ServiceAccount")
    deployment = _one(default_objects, "Deployment")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    assert (
        deployment["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]
    )
    assert "--all-namespaces" in _operator_container(default_objects)["args"]


def test_namespaced_rbac_grants_nothing_cluster_wide(render, default_objects: list[dict]) -> None:
    values = yaml.safe_load((VALUES_DIR / "namespaced.yaml").read_text())
    namespaces = values["operator"]["watchNamespaces"]
    objects = render(VALUES_DIR / "namespaced.yaml")
    assert not _of_kind(objects, "ClusterRole") and not _of_kind(objects, "ClusterRoleBinding")
    roles = _of_kind(objects, "Role")
    bindings = _of_kind(objects, "RoleBinding")
    assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(namespaces)
    assert sorted(b["metadata"]["namespace"] for b in bindings) == sorted(namespaces)
    account = _one(objects, "ServiceAccount")["metadata"]["name"]
    for binding in bindings:
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
        ]
    # A Role carries the same namespaced rules as the ClusterRole; the cluster-scoped CRD rule is
    # left out (Roles cannot grant cluster-scoped resources), and Secrets are readable by any
    # name, but only in the Role's own namespace.
    cluster_rules = _rules(_one(default_objects, "ClusterRole"))
    namespaced_rules = [
        {k: v for k, v in r.items() if k != "resourceNames"}
        for r in cluster_rules
        if r["apiGroups"] != ["apiextensions.k8s.io"]
    ]
    for role in roles:
        assert _rules(role) == namespaced_rules
    args = _operator_container(objects)["args"]
    assert [a for a in args if a.startswith("--namespace")] == [
        f"--namespace={n}" for n in namespaces
    ]
    assert "--all-namespaces" not in args


def secret_rules(objects: list[dict]) -> dict[tuple[str, str | None], list]:
    """(kind, namespace) of each role that grants Secrets -> the names it is limited to."""
    return {
        (role["kind"], role["metadata"].get("namespace")): rule.get("resourceNames")
        for role in _of_kind(objects, "ClusterRole") + _of_kind(objects, "Role")
        for rule in _rules(role)
        if "secrets" in rule["resources"]
    }


def test_secrets_are_readable_only_where_needed(render, default_objects, tmp_path) -> None:
    """Issue 15, bug 15: watching every namespace, only the Secret names of rbac.secretNames;
    watching listed namespaces, any Secret of those namespaces and none elsewhere."""
    assert secret_rules(default_objects) == {("ClusterRole", None): ["hf-token"]}
    values = tmp_path / "values.yaml"
    values.write_text("operator:\n  watchNamespaces: [team-a, team-b]\n")
    assert secret_rules(render(values)) == {("Role", "team-a"): None, ("Role", "team-b"): None}


def test_namespace_globs_get_cluster_scanning_and_no_roles(render, helm, tmp_path) -> None:
    """Issue 15, bug 13: a glob in watchNamespaces makes kopf follow namespaces, which needs
    list/watch on them (and the CRD) cluster-wide; per-namespace Roles cannot name a glob."""
    values = tmp_path / "values.yaml"
    values.write_text("operator:\n  watchNamespaces: [team-*]\n")
    objects = render(values)
    rules = _rules(_one(objects, "ClusterRole"))
    assert {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]} in rules
    assert not _of_kind(objects, "Role")
    assert "--namespace=team-*" in _operator_container(objects)["args"]
    values.write_text("operator:\n  watchNamespaces: [team-*]\nrbac:\n  namespaced: true\n")
    result = run_helm(helm, "template", "kvp", str(CHART), "--values", str(values))
    assert result.returncode != 0 and "glob" in result.stderr


def test_no_rbac_and_an_existing_service_account(render) -> None:
    values = yaml.safe_load((VALUES_DIR / "no-rbac.yaml").read_text())
    objects = render(VALUES_DIR / "no-rbac.yaml")
    for kind in ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"):
        assert not _of_kind(objects, kind)
    pod = _one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == values["serviceAccount"]["name"]


def test_overrides_reach_the_operator_pod(render) -> None:
    values = yaml.safe_load((VALUES_DIR / "custom.yaml").read_text())
    operator = values["operator"]
    objects = render(VALUES_DIR / "custom.yaml")
    assert not _of_kind(objects, "ConfigMap")
    deployment = _one(objects, "Deployment")
    assert deployment["metadata"]["name"].startswith(values["fullnameOverride"])
    pod = deployment["spec"]["template"]["spec"]
    container = _operator_container(objects)
    image = operator["image"]
    assert container["image"] == f"{image['repository']}:{image['tag']}"
    assert container["imagePullPolicy"] == image["pullPolicy"]
    assert pod["imagePullSecrets"] == operator["imagePullSecrets"]
    assert pod["serviceAccountName"] == values["serviceAccount"]["name"]
    assert pod["priorityClassName"] == operator["priorityClassName"]
    assert pod["nodeSelector"] == operator["nodeSelector"]
    assert pod["tolerations"] == operator["tolerations"]
    assert pod["affinity"] == operator["affinity"]
    assert deployment["spec"]["template"]["metadata"]["annotations"] == operator["podAnnotations"]
    assert deployment["spec"]["template"]["metadata"]["labels"]["team"] == "ml-platform"
    assert container["resources"]["limits"]["memory"] == operator["resources"]["limits"]["memory"]
    assert f"--log-level={operator['logLevel']}" in container["args"]
    assert f"--metrics-port={operator['metricsPort']}" in container["args"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"liveness": operator["livenessPort"], "metrics": operator["metricsPort"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HF_HUB_OFFLINE"] == "1"
    engine = values["engine"]["image"]
    assert f"--engine-image={engine['repository']}:{engine['tag']}" in container["args"]
    # Watching listed namespaces, kopf does not follow CRDs cluster-wide: no rule for that.
    (role,) = _of_kind(objects, "ClusterRole")
    assert all(r["apiGroups"] != ["apiextensions.k8s.io"] for r in role["rules"])
    assert [a for a in container["args"] if a.startswith("--namespace")] == [
        f"--namespace={n}" for n in operator["watchNamespaces"]
    ]


def test_monitors_select_the_operator_service(render) -> None:
    values = yaml.safe_load((VALUES_DIR / "monitoring.yaml").read_text())["monitoring"]
    objects = render(VALUES_DIR / "monitoring.yaml")
    monitor = _one(objects, "ServiceMonitor")
    service = _one(objects, "Service")
    pod_template = _one(objects, "Deployment")["spec"]["template"]
    assert monitor["metadata"]["labels"]["release"] == values["serviceMonitor"]["labels"]["release"]
    assert _selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["interval"] == values["serviceMonitor"]["interval"]
    (service_port,) = service["spec"]["ports"]
    assert endpoint["port"] == service_port["name"]
    assert _selects(service["spec"]["selector"], pod_template["metadata"]["labels"])
    container_ports = {p["name"] for p in pod_template["spec"]["containers"][0]["ports"]}
    assert service_port["targetPort"] in container_ports


def _matches(selector: dict, labels: dict) -> bool:
    """Whether a LabelSelector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist)
    selects ``labels``."""
    tests = {
        "In": lambda key, values: labels.get(key) in values,
        "NotIn": lambda key, values: labels.get(key) not in values,
        "Exists": lambda key, _: key in labels,
        "DoesNotExist": lambda key, _: key not in labels,
    }
    return _selects(selector.get("matchLabels", {}), labels) and all(
        tests[e["operator"]](e["key"], e.get("values", []))
        for e in selector.get("matchExpressions", [])
    )


def _engine_deployment() -> dict:
    """The Deployment the operator builds for the CPU example (its own pure functions)."""
    example = yaml.safe_load(EXAMPLE.read_text())
    config = json.loads(SMOLLM2_CONFIG.read_text())
    spec = parse_spec(example["spec"])
    plan = plan_for_spec(spec, ModelShape.from_hf_config(config))
    return manifests.deployment(example["metadata"]["name"], "llm-team-a", spec, plan)


def test_pod_monitor_scrapes_the_engine_pods(render) -> None:
    values = yaml.safe_load((VALUES_DIR / "monitoring.yaml").read_text())["monitoring"]
    monitor = _one(render(VALUES_DIR / "monitoring.yaml"), "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    template = _engine_deployment()["spec"]["template"]
    assert _matches(monitor["spec"]["selector"], template["metadata"]["labels"])
    # The operator's own pod is not an engine.
    operator_pod = _one(render(), "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert not _matches(monitor["spec"]["selector"], operator_pod)
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (container,) = template["spec"]["containers"]
    assert endpoint["port"] in {p["name"] for p in container["ports"]}
    assert endpoint["path"] == "/metrics"
    assert (endpoint["interval"], endpoint["scrapeTimeout"]) == (
        values["podMonitor"]["interval"],
        values["podMonitor"]["scrapeTimeout"],
    )
    namespaced = _one(
        render(VALUES_DIR / "monitoring.yaml", VALUES_DIR / "namespaced.yaml"), "PodMonitor"
    )
    watched = yaml.safe_load((VALUES_DIR / "namespaced.yaml").read_text())["operator"]
    assert namespaced["spec"]["namespaceSelector"] == {"matchNames": watched["watchNamespaces"]}


def test_dashboard_config_map(render) -> None:
    values = yaml.safe_load((VALUES_DIR / "monitoring.yaml").read_text())["monitoring"]
    objects = render(VALUES_DIR / "monitoring.yaml")
    config_map = _one(objects, "ConfigMap")
    assert config_map["metadata"]["namespace"] == values["dashboard"]["namespace"]
    for key, value in values["dashboard"]["labels"].items():
        assert config_map["metadata"]["labels"][key] == value
    dashboard = json.loads((CHART / "dashboards" / "kvpilot.json").read_text())
    assert json.loads(config_map["data"]["kvpilot.json"]) == dashboard
