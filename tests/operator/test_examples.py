"""Every example: accepted by the API server (schema and CEL rules), parsed by spec.py, planned,
and rendered into valid objects."""

from __future__ import annotations

import json
import py_compile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvpilot.engine.model_shape import ModelShape
from kvpilot.operator import manifests
from kvpilot.operator.planner import plan_for_spec
from kvpilot.operator.spec import parse_spec, validate_name

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONFIGS = Path(__file__).parent / "configs"
# The Instruct models have the same sizes as the base models whose configs are stored here.
CONFIG_OF_SOURCE = {
    None: "SmolLM2-135M-Instruct",
    "hf://meta-llama/Meta-Llama-3-8B-Instruct": "Meta-Llama-3-8B",
    "hf://meta-llama/Meta-Llama-3-70B-Instruct": "Meta-Llama-3-70B",
    "hf://Qwen/Qwen2.5-72B-Instruct": "Qwen2.5-72B-Instruct",
}
# What each example is meant to show: (gpu type, tensor parallel size, gpus per pod).
EXPECTED = {
    "smollm2-cpu.yaml": ("cpu", 1, 0),
    "llama-3-8b-l4.yaml": ("L4", 1, 1),
    "llama-3-8b-h100-autoscaling.yaml": ("H100-80GB", 1, 1),
    "llama-3-70b-h100.yaml": ("H100-80GB", 4, 4),
    "qwen2.5-72b-h100.yaml": ("H100-80GB", 4, 4),
}


def readme_rows() -> dict[str, list[str]]:
    """examples/README.md's table: file name -> its cells."""
    rows = {}
    for line in (EXAMPLES / "README.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| `"):
            rows[cells[0].strip("`")] = cells
    return rows


def test_every_manifest_example_is_listed():
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(EXPECTED)
    assert sorted(readme_rows()) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_plans_and_renders(kube, crd, namespace, name):
    (resource,) = yaml.safe_load_all((EXAMPLES / name).read_text())
    assert kube.admission_error(namespace, resource) is None
    validate_name(resource["metadata"]["name"])
    spec = parse_spec(kube.stored(namespace, resource)["spec"])
    config = json.loads((CONFIGS / f"{CONFIG_OF_SOURCE[spec.model.source]}.json").read_text())
    plan = plan_for_spec(spec, ModelShape.from_hf_config(config))
    assert (plan.gpu_type, plan.tensor_parallel_size, plan.gpus_per_replica) == EXPECTED[name]
    assert plan.max_concurrency >= 1
    *_, tp, utilization, capacity, sequences = readme_rows()[name]
    assert int(tp) == plan.tensor_parallel_size
    assert utilization == (
        "-" if plan.gpu_memory_utilization is None else f"{plan.gpu_memory_utilization:.2f}"
    )
    assert capacity == f"{plan.kv_capacity_tokens:,}"
    assert sequences == f"{plan.max_concurrency} x {plan.max_model_len:,}"
    for obj in manifests.children(resource["metadata"]["name"], "default", spec, plan):
        kubernetes_validate.validate(obj, "1.32.0", strict=True)


def test_client_snippet_compiles(tmp_path):
    py_compile.compile(
        str(EXAMPLES / "client.py"), cfile=str(tmp_path / "client.pyc"), doraise=True
    )
