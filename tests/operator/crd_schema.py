"""Validate custom resources against a CRD's openAPIV3Schema with jsonschema (test helper).

Kubernetes' structural schemas are OpenAPI 3.0 with extensions; jsonschema speaks JSON Schema.
``to_json_schema`` translates what differs (ENVIRONMENT.md):

- ``nullable: true`` -> the type also admits ``null``;
- ``x-kubernetes-int-or-string: true`` -> integer or string;
- ``x-kubernetes-preserve-unknown-fields: true`` -> unknown fields allowed; every other object
  with ``properties`` rejects unknown fields (what ``kubectl``'s strict field validation does,
  instead of the API server's silent pruning);
- boolean ``exclusiveMinimum``/``exclusiveMaximum`` (draft 4) -> numeric ones.

CEL rules (``x-kubernetes-validations``) are outside JSON Schema: ``cel_rules`` lists them and
``cel_violations`` evaluates them with cel-python (``celpy``), at every node present in the
object, as the API server does after defaulting. ``apply_defaults`` fills ``default`` values as
the API server does on create/update.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import jsonschema
import yaml

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "llmdeployment.yaml"


def load_crd(path: Path = CRD_PATH) -> dict[str, Any]:
    """The CRD document at ``path``."""
    return yaml.safe_load(path.read_text())


def open_api_schema(crd: dict[str, Any], version: str = "v1alpha1") -> dict[str, Any]:
    """The ``openAPIV3Schema`` of ``version``.

    Raises:
        KeyError: the CRD serves no such version.
    """
    for served in crd["spec"]["versions"]:
        if served["name"] == version:
            return served["schema"]["openAPIV3Schema"]
    raise KeyError(f"CRD {crd['metadata']['name']} has no version {version!r}")


def to_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Translate a structural openAPIV3Schema node (recursively) into JSON Schema."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = to_json_schema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [to_json_schema(sub) for sub in value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            if value is True:
                out[key] = schema["minimum" if key == "exclusiveMinimum" else "maximum"]
        elif not key.startswith("x-kubernetes-") and key != "nullable":
            out[key] = value
    if schema.get("exclusiveMinimum") is True:
        out.pop("minimum", None)
    if schema.get("exclusiveMaximum") is True:
        out.pop("maximum", None)
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def validator(crd: dict[str, Any] | None = None) -> jsonschema.Draft202012Validator:
    """A jsonschema validator for whole custom resources of ``crd`` (default: LLMDeployment)."""
    schema = to_json_schema(open_api_schema(crd or load_crd()))
    return jsonschema.Draft202012Validator(schema)


def field_path(error: jsonschema.ValidationError) -> str:
    """The error's field as Kubernetes writes it: ``spec.engine.extraArgs[0]``.

    For an unknown or missing property the property itself is named.
    """
    path = ""
    for part in error.absolute_path:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    if error.validator == "additionalProperties":
        extra = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        path += f".{extra[0]}"
    elif error.validator == "required":
        path += "." + error.message.split("'")[1]
    return path.lstrip(".")


def validation_errors(obj: dict[str, Any], crd: dict[str, Any] | None = None) -> list[str]:
    """``"field: message"`` for every schema violation of ``obj`` (empty when valid)."""
    errors = sorted(validator(crd).iter_errors(obj), key=lambda e: list(map(str, e.path)))
    return [f"{field_path(e)}: {e.message}" for e in errors]


def apply_defaults(obj: dict[str, Any], crd: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of ``obj`` with the schema's ``default`` values filled in where fields are absent."""
    result = copy.deepcopy(obj)
    _fill(result, open_api_schema(crd or load_crd()))
    return result


def _fill(value: Any, schema: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                _fill(value[name], sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _fill(item, schema["items"])


def cel_rules(schema: dict[str, Any], path: str = "") -> list[tuple[str, str, str]]:
    """Every CEL rule as ``(field path, rule, message)``, depth first.

    The field is where the API server reports a violation: the rule's node, joined with its
    ``fieldPath`` when it has one (``spec.autoscaling`` + ``.minReplicas``).
    """
    rules = [
        (path + rule.get("fieldPath", ""), rule["rule"], rule.get("message", ""))
        for rule in schema.get("x-kubernetes-validations", [])
    ]
    for name, sub in schema.get("properties", {}).items():
        rules += cel_rules(sub, f"{path}.{name}".lstrip("."))
    if isinstance(schema.get("items"), dict):
        rules += cel_rules(schema["items"], f"{path}[*]")
    return rules


def cel_violations(obj: dict[str, Any], crd: dict[str, Any] | None = None) -> list[str]:
    """``"field: message"`` for every CEL rule ``obj`` breaks (apply defaults first).

    A rule runs at each node of ``obj`` its schema node is attached to, with ``self`` bound to
    that node; a rule that does not evaluate to true (false or an evaluation error) is broken.
    Needs the ``cel-python`` package.
    """
    return _cel(obj, open_api_schema(crd or load_crd()), "")


@functools.cache
def cel_program(rule: str) -> Any:
    """``rule`` compiled by cel-python (compiling is slow: each rule once)."""
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule))


def _cel(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    import celpy

    broken = []
    for rule in schema.get("x-kubernetes-validations", []):
        result = cel_program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})
        if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
            field = (path + rule.get("fieldPath", "")).lstrip(".")
            broken.append(f"{field}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                broken += _cel(value[name], sub, f"{path}.{name}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            broken += _cel(item, schema["items"], f"{path}[{i}]")
    return broken
