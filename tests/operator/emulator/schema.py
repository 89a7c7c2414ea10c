"""Admission of custom resources: pruning, defaulting, validation (the API server's order).

- Pruning: fields the structural schema does not declare are dropped, except under
  ``x-kubernetes-preserve-unknown-fields`` or ``additionalProperties``; ``metadata`` is the
  API server's own and never pruned. With ``?fieldValidation=Strict`` (what ``kubectl apply``
  sends unless ``--validate=false``) unknown fields are refused instead.
- Defaulting: a ``default`` fills an absent property of an object that is present.
- Validation: the CRD's ``openAPIV3Schema`` translated to JSON Schema by the suite's translator
  (``tests/operator/crd_schema.py``), errors named by field path as Kubernetes prints them
  (``spec.gpu.type``). CEL rules (``x-kubernetes-validations``) are not evaluated.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

import jsonschema

from tests.operator import crd_schema

from .resources import ResourceType

_API_SERVER_FIELDS = {"apiVersion", "kind", "metadata"}


def prune_and_default(schema: dict[str, Any], value: Any, top: bool = True) -> Any:
    """A copy of ``value`` without undeclared fields and with the schema's defaults filled in."""
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        keep_unknown = schema.get("x-kubernetes-preserve-unknown-fields") or extra is True
        result = {}
        for name, item in value.items():
            if top and name in _API_SERVER_FIELDS:
                result[name] = copy.deepcopy(item)
            elif name in properties:
                result[name] = prune_and_default(properties[name], item, top=False)
            elif isinstance(extra, dict):
                result[name] = prune_and_default(extra, item, top=False)
            elif keep_unknown:
                result[name] = copy.deepcopy(item)
        for name, sub in properties.items():
            if name not in result and "default" in sub:
                result[name] = prune_and_default(sub, copy.deepcopy(sub["default"]), top=False)
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune_and_default(schema["items"], item, top=False) for item in value]
    return copy.deepcopy(value)


@functools.cache
def _validator(schema_json: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(crd_schema.to_json_schema(json.loads(schema_json)))


def schema_errors(schema: dict[str, Any], obj: dict[str, Any]) -> list[dict[str, str]]:
    """Violations of ``schema`` as 422 causes: ``{"field": "spec.x", "message": ..., "reason": ...}``."""
    validator = _validator(json.dumps(schema, sort_keys=True))
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    return [
        {
            "field": crd_schema.field_path(e) or "<root>",
            "message": e.message,
            "reason": "FieldValueUnknown"
            if e.validator == "additionalProperties"
            else "FieldValueInvalid",
        }
        for e in errors
    ]


def admit_custom_resource(
    rtype: ResourceType, obj: dict[str, Any], strict: bool
) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """Prune, default and validate ``obj``; returns the admitted object and its 422 causes.

    With ``strict``, unknown fields are causes instead of being pruned.
    """
    schema = rtype.schema or {}
    causes = (
        [c for c in schema_errors(schema, obj) if c["reason"] == "FieldValueUnknown"]
        if strict
        else []
    )
    admitted = prune_and_default(schema, obj)
    return admitted, causes + schema_errors(schema, admitted)
