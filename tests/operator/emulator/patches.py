"""Patch formats the Kubernetes API accepts: JSON merge patch, JSON patch, strategic merge patch.

Pure functions over plain JSON-like values; the inputs are never modified.

- JSON merge patch: RFC 7386 (``application/merge-patch+json``). kopf and kubectl (for custom
  resources) send it.
- JSON patch: RFC 6902 (``application/json-patch+json``), including ``test``; a failed
  operation raises :class:`PatchError`, which the server answers with 422 like Kubernetes.
- Strategic merge patch (``application/strategic-merge-patch+json``) and server-side apply
  (``application/apply-patch+yaml``): approximated as a merge patch in which lists of objects
  that carry a ``name`` are merged by that key (containers, env, ports, volumes, conditions are
  keyed like this in Kubernetes' own patch strategies); ``$patch``/``$setElementOrder``
  directives are not interpreted.
"""

from __future__ import annotations

import copy
from typing import Any

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
PATCH_TYPES = (MERGE_PATCH, JSON_PATCH, STRATEGIC_MERGE_PATCH, APPLY_PATCH)


class PatchError(ValueError):
    """A patch that cannot be applied (bad pointer, failed ``test``, malformed operation)."""


def apply_patch(content_type: str, target: Any, patch: Any) -> Any:
    """Apply ``patch`` of media type ``content_type`` to ``target`` and return the new value.

    Raises:
        PatchError: the patch is malformed or a JSON-patch operation fails.
        ValueError: ``content_type`` is not a patch media type.
    """
    media = content_type.split(";")[0].strip().lower()
    if media == MERGE_PATCH:
        return merge_patch(target, patch)
    if media == JSON_PATCH:
        return json_patch(target, patch)
    if media in (STRATEGIC_MERGE_PATCH, APPLY_PATCH):
        return strategic_merge_patch(target, patch)
    raise ValueError(f"unsupported patch content type {content_type!r}; use one of {PATCH_TYPES}")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, ``null`` deletes a key, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Merge patch, except that lists of named objects merge element-wise by ``name``."""
    if isinstance(patch, list) and isinstance(target, list) and _all_named(patch + target):
        merged = {item["name"]: copy.deepcopy(item) for item in target}
        for item in patch:
            merged[item["name"]] = strategic_merge_patch(merged.get(item["name"]), item)
        return list(merged.values())
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
        else:
            result[key] = strategic_merge_patch(result.get(key), value)
    return result


def _all_named(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(item, dict) and "name" in item for item in items)


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902: apply ``add``/``remove``/``replace``/``move``/``copy``/``test`` in order.

    Raises:
        PatchError: an operation is malformed, its path does not exist, or a ``test`` fails.
    """
    if not isinstance(operations, list):
        raise PatchError("a JSON patch must be a list of operations")
    doc = copy.deepcopy(target)
    for op in operations:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"malformed JSON patch operation: {op!r}")
        kind, path = op["op"], op["path"]
        if kind == "add":
            doc = _add(doc, path, copy.deepcopy(op.get("value")))
        elif kind == "remove":
            doc = _remove(doc, path)[0]
        elif kind == "replace":
            _get(doc, path)
            doc = _add(_remove(doc, path)[0], path, copy.deepcopy(op.get("value")))
        elif kind == "move":
            doc, value = _remove(doc, op["from"])
            doc = _add(doc, path, value)
        elif kind == "copy":
            doc = _add(doc, path, copy.deepcopy(_get(doc, op["from"])))
        elif kind == "test":
            if _get(doc, path) != op.get("value"):
                raise PatchError(f"test operation failed at {path}: value differs")
        else:
            raise PatchError(f"unknown JSON patch operation {kind!r}")
    return doc


def _tokens(pointer: str) -> list[str]:
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise PatchError(f"JSON pointer must start with '/': {pointer!r}")
    return [t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/")]


def _index(container: list[Any], token: str, allow_end: bool) -> int:
    if token == "-" and allow_end:
        return len(container)
    if not token.isdigit():
        raise PatchError(f"bad list index {token!r}")
    index = int(token)
    if index > len(container) or (index == len(container) and not allow_end):
        raise PatchError(f"list index {index} out of range")
    return index


def _parent(doc: Any, pointer: str) -> tuple[Any, str]:
    tokens = _tokens(pointer)
    if not tokens:
        raise PatchError("the whole document cannot be the target of this operation")
    return _get(
        doc, "".join("/" + t.replace("~", "~0").replace("/", "~1") for t in tokens[:-1])
    ), tokens[-1]


def _get(doc: Any, pointer: str) -> Any:
    node = doc
    for token in _tokens(pointer):
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list):
            node = node[_index(node, token, allow_end=False)]
        else:
            raise PatchError(f"path {pointer!r} does not exist")
    return node


def _add(doc: Any, pointer: str, value: Any) -> Any:
    if pointer == "":
        return value
    parent, token = _parent(doc, pointer)
    if isinstance(parent, dict):
        parent[token] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, token, allow_end=True), value)
    else:
        raise PatchError(f"cannot add at {pointer!r}: parent is not a container")
    return doc


def _remove(doc: Any, pointer: str) -> tuple[Any, Any]:
    parent, token = _parent(doc, pointer)
    if isinstance(parent, dict) and token in parent:
        return doc, parent.pop(token)
    if isinstance(parent, list):
        return doc, parent.pop(_index(parent, token, allow_end=False))
    raise PatchError(f"path {pointer!r} does not exist")
