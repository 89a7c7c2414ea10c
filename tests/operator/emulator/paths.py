"""Parse Kubernetes API request paths into (group, version, namespace, plural, name, subresource).

The grammar (the same for ``/api/v1`` and ``/apis/{group}/{version}``)::

    {prefix}/{plural}[/{name}[/{subresource}]]
    {prefix}/namespaces/{namespace}/{plural}[/{name}[/{subresource}]]
    /api/v1/namespaces/{name}[/status|/finalize]      (a Namespace object itself)
"""

from __future__ import annotations

import dataclasses

_NAMESPACE_SUBRESOURCES = {"status", "finalize"}


@dataclasses.dataclass(frozen=True)
class ApiPath:
    """A resource request path, parsed."""

    group: str
    version: str
    plural: str
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None


def parse(path: str) -> ApiPath | None:
    """Parse a resource path; ``None`` for discovery and non-API paths (``/api/v1``, ``/version``)."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 3 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = None
    namespaced_form = (
        rest[0] == "namespaces"
        and len(rest) >= 3
        and not (group == "" and len(rest) == 3 and rest[2] in _NAMESPACE_SUBRESOURCES)
    )
    if namespaced_form:
        namespace, rest = rest[1], rest[2:]
    if len(rest) > 3:
        return None
    plural, name, subresource = (rest + [None, None])[:3]
    return ApiPath(group, version, plural, namespace, name, subresource)
