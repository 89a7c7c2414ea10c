"""The CRD on a real API server: accepted (a structural schema whose CEL rules the server
compiles and cost-checks), and its schema, its CEL rules and operator/spec.py reject the same
specs naming the same field (spec.py enforces them again, so the operator never acts on a spec
the server would refuse).

Every case is a dry-run create with strict field validation, as ``kubectl apply`` sends it.
"""

from __future__ import annotations

import copy
import pathlib
import re

import pytest
import yaml

from kvpilot.operator.crd import MANAGED_FLAGS
from kvpilot.operator.gpus import CATALOGUE, CUSTOM
from kvpilot.operator.spec import SpecError, parse_spec, validate_name


@pytest.fixture(scope="module")
def namespace(kube, crd):
    """One namespace for the module's dry runs (nothing is stored in it)."""
    name = kube.create_namespace("crd-schema")
    yield name
    kube.kubectl("delete", "namespace", name, "--wait=false", check=False)


CRD = yaml.safe_load(
    (pathlib.Path(__file__).parents[2] / "crds" / "llmdeployment.yaml").read_text()
)
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

BASE = {
    "apiVersion": "kvpilot.dev/v1alpha1",
    "kind": "LLMDeployment",
    "metadata": {"name": "chat"},
    "spec": {
        "model": {"source": "hf://meta-llama/Meta-Llama-3-8B-Instruct"},
        "engine": {"maxModelLen": 8192},
        "gpu": {"type": "L4"},
        "autoscaling": {"minReplicas": 1, "maxReplicas": 3},
        "adapters": [{"name": "sql", "source": "hf://org/sql-lora"}],
    },
}


def test_the_api_server_accepts_the_crd(crd):
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True" and conditions["NamesAccepted"] == "True"
    assert crd["status"]["acceptedNames"]["shortNames"] == ["llmd"]
    spec = CRD["spec"]
    assert CRD["metadata"]["name"] == "llmdeployments.kvpilot.dev"
    assert (spec["group"], spec["scope"]) == ("kvpilot.dev", "Namespaced")
    assert spec["names"]["kind"] == "LLMDeployment"
    assert spec["names"]["plural"] == "llmdeployments"
    assert spec["names"]["shortNames"] == ["llmd"]
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["TP"] == ".status.plan.tensorParallelSize"
    assert columns["PP"] == ".status.plan.pipelineParallelSize"
    assert columns["GPUs/Replica"] == ".status.plan.gpusPerReplica"
    assert columns["Ready"] == ".status.readyReplicas"
    assert columns["KV Usage"] == ".status.kvCacheUsage"
    assert columns["Age"] == ".metadata.creationTimestamp"


def test_gpu_enum_matches_the_catalogue():
    gpu_types = SCHEMA["properties"]["spec"]["properties"]["gpu"]["properties"]["type"]["enum"]
    assert gpu_types == [*CATALOGUE, CUSTOM]


def test_plan_status_fields_match_the_planner():
    from kvpilot.operator.planner import Plan

    plan_schema = SCHEMA["properties"]["status"]["properties"]["plan"]["properties"]
    sample = Plan(**{name: 1 for name in Plan.__dataclass_fields__}).to_status()
    assert set(sample) == set(plan_schema)


def test_base_is_valid_and_defaults_agree_with_spec_py(kube, crd, namespace):
    assert kube.admission_error(namespace, BASE) is None
    defaulted = kube.stored(namespace, BASE)["spec"]
    parsed = parse_spec(copy.deepcopy(BASE["spec"]))
    assert defaulted["replicas"] == parsed.replicas == 1
    assert defaulted["gpu"]["resourceName"] == parsed.gpu.resource_name == "nvidia.com/gpu"
    assert defaulted["engine"]["dtype"] == parsed.engine.dtype == "auto"
    assert defaulted["autoscaling"]["mode"] == parsed.autoscaling.mode == "kvpilot"
    assert defaulted["engine"]["kvCacheDtype"] == parsed.engine.kv_cache_dtype == "auto"
    assert defaulted["autoscaling"]["allowKvCacheDtype"] is parsed.autoscaling.allow_kv_cache_dtype
    assert parsed.autoscaling.allow_kv_cache_dtype is False
    assert "quantization" not in defaulted["engine"] and parsed.engine.quantization is None
    with_secret = {**BASE["spec"], "model": {"hfTokenSecretRef": {"name": "hf"}}}
    defaulted = kube.stored(namespace, {**BASE, "spec": with_secret})["spec"]
    assert defaulted["model"]["hfTokenSecretRef"]["key"] == "token"
    assert parse_spec(with_secret).model.hf_token_secret_key == "token"


def with_change(path: str, value) -> dict:
    """BASE with the field at dotted ``path`` set to ``value`` (``...`` deletes it)."""
    obj = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node = obj
    for part in parents:
        node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return obj


SCHEMA_CASES = [
    ("spec.gpu.type", "V100", "spec.gpu.type"),
    ("spec.replicas", -1, "spec.replicas"),
    ("spec.gpuMemoryUtilization", 1.5, "spec.gpuMemoryUtilization"),
    ("spec.gpuMemoryUtilization", 0, "spec.gpuMemoryUtilization"),
    ("spec.tensorParallelSize", "2", "spec.tensorParallelSize"),
    ("spec.model.source", "s3://bucket/llama", "spec.model.source"),
    ("spec.engine.dtype", "int8", "spec.engine.dtype"),
    ("spec.engine.kvCacheDtype", "int8", "spec.engine.kvCacheDtype"),
    ("spec.engine.quantization", "bitsandbytes", "spec.engine.quantization"),
    ("spec.autoscaling.allowKvCacheDtype", "yes", "spec.autoscaling.allowKvCacheDtype"),
    ("spec.engine.maxModelLength", 4096, "spec.engine.maxModelLength"),
    ("spec.autoscaling.maxReplicas", ..., "spec.autoscaling.maxReplicas"),
    ("spec.autoscaling.targetKVCacheUsage", 0, "spec.autoscaling.targetKVCacheUsage"),
    ("spec.autoscaling.maxScaleUpRate", 1, "spec.autoscaling.maxScaleUpRate"),
    ("spec.autoscaling.allowedGpuTypes", ["TPU"], "spec.autoscaling.allowedGpuTypes[0]"),
    ("spec.resources", {"limits": {"memory": "lots"}}, "spec.resources.limits.memory"),
    ("spec.resources", {"limits": {"nvidia.com/gpu": 1}}, "spec.resources.limits.nvidia.com/gpu"),
    ("spec.adapters", [{"name": "sql"}], "spec.adapters[0].source"),
    ("spec.model.hfTokenSecretRef", {"key": "token"}, "spec.model.hfTokenSecretRef.name"),
]


def refused_fields(kube, namespace: str, obj: dict) -> list[str]:
    """The fields the API server names when it refuses ``obj`` (empty: accepted)."""
    error = kube.admission_error(namespace, obj)
    if error is None:
        return []
    unknown = re.findall(r'unknown field "([^"]+)"', error.message)
    # "<nil>": the note that CEL rules were skipped because the schema already failed.
    return unknown or [f for f in error.fields if f != "<nil>"] or [error.message]


@pytest.mark.parametrize(("path", "value", "field"), SCHEMA_CASES)
def test_schema_and_spec_py_reject_the_same_field(kube, crd, namespace, path, value, field):
    obj = with_change(path, value)
    assert field in refused_fields(kube, namespace, obj), kube.admission_error(namespace, obj)
    with pytest.raises(SpecError) as caught:
        parse_spec(obj["spec"])
    assert caught.value.field == field


CEL_CASES = [
    ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "spec.autoscaling.minReplicas"),
    (
        {"autoscaling": {"maxReplicas": 2, "panicWindowSeconds": 90, "stableWindowSeconds": 60}},
        "spec.autoscaling.panicWindowSeconds",
    ),
    ({"gpu": {"type": "custom"}}, "spec.gpu.memoryGiB"),
    ({"gpu": {"type": "L4", "memoryGiB": 24}}, "spec.gpu.memoryGiB"),
    ({"gpu": ..., "tensorParallelSize": 2}, "spec.tensorParallelSize"),
    ({"gpu": ..., "gpuMemoryUtilization": 0.8}, "spec.gpuMemoryUtilization"),
    ({"model": {"source": "pvc://weights/llama"}}, "spec.model.config"),
    ({"model": {"source": "file:///models/x", "revision": "main"}}, "spec.model.revision"),
    ({"model": {"revision": "main"}}, "spec.model.revision"),
    ({"engine": {"extraArgs": ["--tensor-parallel-size=4"]}}, "spec.engine.extraArgs"),
    ({"engine": {"extraArgs": ["--no-enable-prefix-caching"]}}, "spec.engine.extraArgs"),
    # The engine reads underscores as dashes (vLLM's parser), and a --config file could set
    # any managed flag: refused too.
    ({"engine": {"extraArgs": ["--max_model_len=4096"]}}, "spec.engine.extraArgs"),
    ({"engine": {"extraArgs": ["--gpu_memory-utilization", "0.5"]}}, "spec.engine.extraArgs"),
    ({"engine": {"extraArgs": ["--config", "/etc/flags.yaml"]}}, "spec.engine.extraArgs"),
    (
        {
            "engine": {
                "maxModelLen": 8192,
                "maxNumBatchedTokens": 2048,
                "enableChunkedPrefill": False,
            }
        },
        "spec.engine.maxNumBatchedTokens",
    ),
    ({"modelCache": {"claimName": "models", "size": "10Gi"}}, "spec.modelCache.claimName"),
    ({"modelCache": {"storageClassName": "fast"}}, "spec.modelCache.size"),
    ({"modelCache": {"size": "10Gi", "accessMode": "ReadWriteMany"}}, "spec.modelCache.accessMode"),
]


@pytest.mark.parametrize(("changes", "field"), CEL_CASES)
def test_cel_rules_and_spec_py_reject_the_same_field(kube, crd, namespace, changes, field):
    spec = {**copy.deepcopy(BASE["spec"]), **changes}
    obj = {**BASE, "spec": {k: v for k, v in spec.items() if v is not ...}}
    assert refused_fields(kube, namespace, obj) == [field], kube.admission_error(namespace, obj)
    with pytest.raises(SpecError) as caught:
        parse_spec(obj["spec"])
    assert caught.value.field.startswith(field)


def cel_fields(schema: dict, path: str = "") -> set[str]:
    """The field paths of the CRD's CEL rules (their ``fieldPath`` appended)."""
    fields = {
        path + rule.get("fieldPath", "") for rule in schema.get("x-kubernetes-validations", [])
    }
    for key, sub in (schema.get("properties") or {}).items():
        fields |= cel_fields(sub, f"{path}.{key}" if path else key)
    if "items" in schema:
        fields |= cel_fields(schema["items"], path)
    return fields


def test_every_cel_rule_has_a_case():
    # Every rule has a case above (the root rule on metadata.name: test_name_rule).
    assert cel_fields(SCHEMA) == {"", *(field for _, field in CEL_CASES)}


@pytest.mark.parametrize("flag", MANAGED_FLAGS)
def test_managed_flags_are_refused_in_extra_args(kube, crd, namespace, flag):
    obj = with_change("spec.engine.extraArgs", ["--seed=3", f"{flag}=1"])
    assert refused_fields(kube, namespace, obj) == ["spec.engine.extraArgs"]
    with pytest.raises(SpecError) as caught:
        parse_spec(obj["spec"])
    assert caught.value.field == "spec.engine.extraArgs[1]"


def test_valid_objects_break_no_rule(kube, crd, namespace):
    assert kube.admission_error(namespace, BASE) is None
    assert kube.admission_error(namespace, {**BASE, "spec": {}}) is None


@pytest.mark.parametrize("bad", ["Llama", "3-llamas", "a" * 64, "llama.8b"])
def test_name_rule(kube, crd, namespace, bad):
    obj = {**BASE, "metadata": {"name": bad}}
    error = kube.admission_error(namespace, obj)
    assert error is not None and "metadata.name" in error.message, error
    with pytest.raises(SpecError, match="metadata.name"):
        validate_name(bad)
    validate_name("llama-3-8b")


def test_cpu_mode_needs_a_memory_limit():
    with pytest.raises(SpecError) as caught:
        parse_spec({"resources": {"requests": {"cpu": "2"}}})
    assert caught.value.field == "spec.resources.limits.memory"
    spec = parse_spec({})
    assert spec.gpu is None and spec.memory_limit_bytes == 4 * 1024**3
