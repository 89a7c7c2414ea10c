"""operator/crd.py is the one source of the ``LLMDeployment`` schema: the committed CRD files are
its output, and the dataclasses of spec.py and the autoscaler's policy carry its fields."""

from __future__ import annotations

from dataclasses import fields

import pytest
import yaml

from kvpilot.operator import crd
from kvpilot.operator.autoscaler import AutoscalingPolicy
from kvpilot.operator.spec import (
    Adapter,
    AutoscalingSpec,
    EngineSpec,
    GpuSpec,
    ModelCacheSpec,
    parse_spec,
)


@pytest.mark.parametrize("path", crd.OUTPUTS, ids=lambda path: str(path.relative_to(crd.REPO)))
def test_committed_crds_are_generated(path):
    """Fails on drift: a hand edit of either YAML file, or crd.py changed without `make crd`."""
    assert path.read_text() == crd.render(), f"{path} differs from operator/crd.py: run make crd"


def test_the_yaml_holds_the_declaration_unchanged():
    assert yaml.safe_load(crd.render()) == crd.CRD


@pytest.mark.parametrize(
    ("cls", "schema"),
    [
        (EngineSpec, crd.field_schema("engine")),
        (GpuSpec, crd.field_schema("gpu")),
        (AutoscalingSpec, crd.field_schema("autoscaling")),
        (ModelCacheSpec, crd.field_schema("modelCache")),
        (Adapter, crd.field_schema("adapters")["items"]),
    ],
    ids=lambda value: getattr(value, "__name__", ""),
)
def test_spec_dataclasses_have_the_schema_fields(cls, schema):
    assert [f.name for f in fields(cls)] == [crd.python_name(key) for key in schema["properties"]]


def test_the_policy_knobs_are_autoscaling_fields_with_the_crd_defaults():
    known = {crd.python_name(key) for key in crd.field_schema("autoscaling")["properties"]}
    assert {f.name for f in fields(AutoscalingPolicy)} <= known
    policy = AutoscalingPolicy()
    parsed = parse_spec({"autoscaling": {"maxReplicas": 1}}).autoscaling
    assert policy.min_replicas == parsed.min_replicas == crd.default("autoscaling.minReplicas")
    assert policy.predictive_scaling is parsed.predictive_scaling is True
    assert AutoscalingPolicy.from_spec(parsed) == policy


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("targetKVCacheUsage", "target_kv_cache_usage"),
        ("memoryGiB", "memory_gib"),
        ("maxReplicas", "max_replicas"),
        ("type", "type"),
    ],
)
def test_python_name(name, expected):
    assert crd.python_name(name) == expected
