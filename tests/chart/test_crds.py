"""The chart ships crds/ unchanged (as a template, so upgrades apply it, kept on uninstall), and
its RBAC names the CRD's group, plural and subresources."""

from __future__ import annotations

import pathlib

import yaml
from kubernetes_validate import utils as kubernetes_validate

REPO = pathlib.Path(__file__).resolve().parents[2]
SOURCE = REPO / "crds"
CHART_CRDS = REPO / "charts" / "kvpilot" / "files" / "crds"


def _crds() -> list[dict]:
    return [yaml.safe_load(path.read_text()) for path in sorted(SOURCE.glob("*.yaml"))]


def test_chart_crds_are_exact_copies() -> None:
    """The chart's copy of crds/: `make crd` writes both from operator/crd.py."""
    source = {p.name: p.read_bytes() for p in SOURCE.glob("*.yaml")}
    copies = {p.name: p.read_bytes() for p in CHART_CRDS.glob("*.yaml")}
    assert source, "crds/ holds no CRD"
    assert copies.keys() == source.keys(), "run make crd"
    for name, content in source.items():
        assert copies[name] == content, f"{CHART_CRDS}/{name} differs: run make crd"


def test_rendered_crds_are_the_source_with_helm_labels_and_kept(render) -> None:
    rendered = [o for o in render() if o["kind"] == "CustomResourceDefinition"]
    assert [{**o, "metadata": {"name": o["metadata"]["name"]}} for o in rendered] == _crds()
    for crd in rendered:
        kubernetes_validate.validate(crd, kubernetes_validate.latest_version(), strict=True)
        assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
        assert crd["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"


def test_crds_can_be_left_to_the_user_or_removed_on_uninstall(render, tmp_path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text("crds:\n  install: false\n")
    assert not [o for o in render(values) if o["kind"] == "CustomResourceDefinition"]
    values.write_text("crds:\n  keep: false\n")
    (crd,) = [o for o in render(values) if o["kind"] == "CustomResourceDefinition"]
    assert "annotations" not in crd["metadata"]


def test_rbac_names_the_crd(default_objects: list[dict]) -> None:
    """Every kvpilot.dev resource the ClusterRole grants exists in the CRD: the plural and the
    subresources it serves."""
    (crd,) = _crds()
    group = crd["spec"]["group"]
    plural = crd["spec"]["names"]["plural"]
    served = {plural}
    for version in crd["spec"]["versions"]:
        served |= {f"{plural}/{sub}" for sub in version.get("subresources", {})}
    (role,) = [o for o in default_objects if o["kind"] == "ClusterRole"]
    granted = {r for rule in role["rules"] if group in rule["apiGroups"] for r in rule["resources"]}
    # finalizers is no subresource the CRD serves: it is what the OwnerReferencesPermission-
    # Enforcement admission plugin checks before a child may set blockOwnerDeletion.
    assert granted <= served | {f"{plural}/finalizers"}
    assert plural in granted
