"""Server-side printing: the ``meta.k8s.io/v1`` Table that ``kubectl get`` asks for.

Columns are a CRD's ``additionalPrinterColumns`` (``Name`` first), or Name and Age for types
without them. Cell values come from the column's JSONPath; the subset that CRDs use is
supported: ``.a.b``, ``.a[0]``, ``.a[*].b``, ``.a[?(@.k=="v")].b``.
"""

from __future__ import annotations

import datetime
import re
from typing import Any

from .resources import ResourceType

_TOKEN = re.compile(
    r"\.([A-Za-z0-9_-]+)|\[(\d+|\*)\]|\[\?\(@\.([A-Za-z0-9_.-]+)\s*==\s*[\"']([^\"']*)[\"']\)\]"
)
_AGE_COLUMN = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}


def wants_table(accept: str) -> bool:
    """Whether an ``Accept`` header asks for a Table (``as=Table;g=meta.k8s.io``)."""
    return "as=Table" in accept


def jsonpath(obj: Any, path: str) -> list[Any]:
    """Every value ``path`` selects in ``obj`` (an empty list when nothing matches).

    Raises:
        ValueError: the path uses JSONPath syntax outside the supported subset.
    """
    path = path.strip().strip("{}").lstrip("$")
    nodes, pos = [obj], 0
    while pos < len(path):
        match = _TOKEN.match(path, pos)
        if match is None:
            raise ValueError(f"unsupported JSONPath {path!r} at {path[pos:]!r}")
        field, index, filter_key, filter_value = match.groups()
        selected: list[Any] = []
        for node in nodes:
            if field is not None and isinstance(node, dict) and field in node:
                selected.append(node[field])
            elif index == "*" and isinstance(node, list):
                selected.extend(node)
            elif (
                index is not None
                and index != "*"
                and isinstance(node, list)
                and int(index) < len(node)
            ):
                selected.append(node[int(index)])
            elif filter_key is not None and isinstance(node, list):
                selected.extend(item for item in node if _first(item, filter_key) == filter_value)
        nodes, pos = selected, match.end()
    return nodes


def _first(item: Any, dotted_key: str) -> str | None:
    values = jsonpath(item, "." + dotted_key)
    return str(values[0]) if values else None


def human_age(timestamp: str, now: datetime.datetime | None = None) -> str:
    """An age as kubectl prints it (``45s``, ``3m12s``, ``5h``, ``12d``)."""
    created = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=datetime.UTC
    )
    seconds = max(0, int(((now or datetime.datetime.now(datetime.UTC)) - created).total_seconds()))
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if seconds < 120:
        return f"{seconds}s"
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if hours < 3:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    return f"{days}d"


def _cell(obj: dict[str, Any], column: dict[str, Any]) -> Any:
    values = jsonpath(obj, column["jsonPath"])
    if not values:
        return None
    value = values[0] if len(values) == 1 else ",".join(str(v) for v in values)
    if column.get("type") == "date" and isinstance(value, str):
        return human_age(value)
    return value


def render_table(
    rtype: ResourceType, items: list[dict[str, Any]], resource_version: int
) -> dict[str, Any]:
    """The Table for ``items`` of type ``rtype``."""
    columns = list(rtype.printer_columns) or [_AGE_COLUMN]
    definitions = [
        {
            "name": "Name",
            "type": "string",
            "format": "name",
            "description": "Name of the object",
            "priority": 0,
        }
    ]
    definitions += [
        {
            "name": c["name"],
            "type": c.get("type", "string"),
            "format": c.get("format", ""),
            "description": c.get("description", ""),
            "priority": c.get("priority", 0),
        }
        for c in columns
    ]
    rows = [
        {
            "cells": [obj["metadata"]["name"], *(_cell(obj, c) for c in columns)],
            "object": {
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": obj["metadata"],
            },
        }
        for obj in items
    ]
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": str(resource_version)},
        "columnDefinitions": definitions,
        "rows": rows,
    }
