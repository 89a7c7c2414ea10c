"""What the emulator knows about each resource type: names, scope, subresources, schema.

Built-in types come from kmock's bundled API discovery (a recent k3s cluster); custom types
from ``CustomResourceDefinition`` objects as they are created.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import kmock

# (group, version, plural) of the types the operator's tests read and write.
LLMD = ("kvpilot.dev", "v1alpha1", "llmdeployments")
DEPLOYMENTS = ("apps", "v1", "deployments")
SERVICES = ("", "v1", "services")
PDBS = ("policy", "v1", "poddisruptionbudgets")
EVENTS = ("", "v1", "events")


def llm_deployment(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """An ``LLMDeployment`` object named ``name`` with ``spec``, ready to create."""
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name},
        "spec": spec,
    }


# Built-in workload types that expose /scale, and where Kubernetes reads the numbers from.
_BUILTIN_SCALE = {
    ("apps", "deployments"),
    ("apps", "replicasets"),
    ("apps", "statefulsets"),
}


@dataclasses.dataclass(frozen=True)
class ScalePaths:
    """Where the scale subresource reads and writes (CRD ``subresources.scale`` field names).

    ``label_selector_path`` is ``None`` for built-ins, whose selector is ``spec.selector``
    (a LabelSelector object) rather than a string field.
    """

    spec_replicas_path: str = ".spec.replicas"
    status_replicas_path: str = ".status.replicas"
    label_selector_path: str | None = None


@dataclasses.dataclass(frozen=True)
class ResourceType:
    """One served resource (group, version, plural) and the semantics the emulator applies."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    subresources: frozenset[str] = frozenset()
    scale: ScalePaths | None = None
    schema: dict[str, Any] | None = None
    printer_columns: tuple[dict[str, Any], ...] = ()
    singular: str = ""
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        """``apiVersion`` of objects of this type (``v1`` for the core group)."""
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> tuple[str, str, str]:
        """(group, version, plural), the identity used throughout the emulator."""
        return (self.group, self.version, self.plural)

    @property
    def has_status(self) -> bool:
        """Whether status is a subresource, isolated from writes to the main resource."""
        return "status" in self.subresources

    @property
    def custom(self) -> bool:
        """Whether the type comes from a CustomResourceDefinition."""
        return self.schema is not None


def builtin_types(resources: kmock.ResourcesArray) -> dict[tuple[str, str, str], ResourceType]:
    """Resource types for every built-in kind in kmock's bundled discovery data."""
    result = {}
    for res in resources:
        info = resources[res]
        scale = ScalePaths() if (res.group, res.plural) in _BUILTIN_SCALE else None
        rtype = ResourceType(
            group=res.group,
            version=res.version,
            plural=res.plural,
            kind=info.kind or res.plural.capitalize(),
            namespaced=bool(info.namespaced),
            subresources=frozenset(info.subresources),
            scale=scale,
            singular=info.singular or "",
            short_names=tuple(sorted(info.shortnames)),
            categories=tuple(sorted(info.categories)),
        )
        result[rtype.key] = rtype
    return result


def crd_types(crd: dict[str, Any]) -> list[ResourceType]:
    """Resource types (one per served version) declared by a CustomResourceDefinition."""
    spec = crd["spec"]
    names = spec["names"]
    result = []
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        subresources = version.get("subresources") or {}
        scale = subresources.get("scale")
        result.append(
            ResourceType(
                group=spec["group"],
                version=version["name"],
                plural=names["plural"],
                kind=names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                subresources=frozenset(subresources),
                scale=None
                if scale is None
                else ScalePaths(
                    spec_replicas_path=scale["specReplicasPath"],
                    status_replicas_path=scale["statusReplicasPath"],
                    label_selector_path=scale.get("labelSelectorPath"),
                ),
                schema=(version.get("schema") or {}).get("openAPIV3Schema") or {},
                printer_columns=tuple(version.get("additionalPrinterColumns") or ()),
                singular=names.get("singular") or names["kind"].lower(),
                short_names=tuple(names.get("shortNames") or ()),
                categories=tuple(names.get("categories") or ()),
            )
        )
    return result


def discovery_info(rtype: ResourceType) -> kmock.ResourceInfo:
    """kmock's discovery record for a type (served by kmock's discovery endpoints)."""
    return kmock.ResourceInfo(
        kind=rtype.kind,
        singular=rtype.singular,
        namespaced=rtype.namespaced,
        verbs={"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"},
        shortnames=set(rtype.short_names),
        categories=set(rtype.categories),
        subresources=set(rtype.subresources),
    )
