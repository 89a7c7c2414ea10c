"""The chart ships crds/ unchanged, and its RBAC names the CRD's group, plural and subresources."""

from __future__ import annotations

import pathlib

import yaml
from kubernetes_validate import utils as kubernetes_validate

REPO = pathlib.Path(__file__).resolve().parents[2]
SOURCE = REPO / "crds"
CHART_CRDS = REPO / "charts" / "kvpilot" / "crds"


def _crds() -> list[dict]:
    return [yaml.safe_load(path.read_text()) for path in sorted(SOURCE.glob("*.yaml"))]


def test_chart_crds_are_exact_copies() -> None:
    """crds/ is the one source; hack/sync-crds.sh copies it into the chart."""
    source = {p.name: p.read_bytes() for p in SOURCE.glob("*.yaml")}
    copies = {p.name: p.read_bytes() for p in CHART_CRDS.glob("*.yaml")}
    assert source, "crds/ holds no CRD"
    assert copies.keys() == source.keys(), "run hack/sync-crds.sh"
    for name, content in source.items():
        assert copies[name] == content, f"charts/kvpilot/crds/{name} differs: run hack/sync-crds.sh"


def test_rendered_crds_are_valid(render) -> None:
    rendered = [o for o in render(include_crds=True) if o["kind"] == "CustomResourceDefinition"]
    assert rendered == _crds()
    for crd in rendered:
        kubernetes_validate.validate(crd, kubernetes_validate.latest_version(), strict=True)


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
    assert granted <= served
    assert plural in granted
