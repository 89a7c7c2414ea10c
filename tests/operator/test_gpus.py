"""GPU names as people type them (``kvpilot plan --gpu``), and as the CRD keeps them."""

from __future__ import annotations

import pytest

from kvpilot.operator.gpus import CATALOGUE, CPU, CUSTOM, resolve_gpu_name
from kvpilot.operator.spec import SpecError, parse_spec


@pytest.mark.parametrize(
    ("typed", "name"),
    [
        ("H100-80GB", "H100-80GB"),
        ("h100-80gb", "H100-80GB"),
        ("H100", "H100-80GB"),
        ("h200", "H200-141GB"),
        ("a100-40GB", "A100-40GB"),
        # An exact name wins over the names it starts: L4 is not ambiguous with L40S.
        ("l4", "L4"),
        ("Custom", CUSTOM),
    ],
)
def test_names_in_any_case_and_by_their_unique_first_part(typed, name):
    assert resolve_gpu_name(typed) == name


def test_a_shared_first_part_is_ambiguous():
    with pytest.raises(ValueError) as caught:
        resolve_gpu_name("a100")
    assert str(caught.value) == "gpu type 'a100' is ambiguous: A100-40GB or A100-80GB"


@pytest.mark.parametrize("typed", ["L40", "A10", "H1", "", "H100-"])
def test_an_alias_never_cuts_a_part_short(typed):
    # L40 and A10 are other GPUs than L40S and A10G; H1 is no GPU's name at all.
    with pytest.raises(ValueError) as caught:
        resolve_gpu_name(typed)
    assert str(caught.value) == (
        f"unknown gpu type {typed!r}; known: {', '.join([*CATALOGUE, CUSTOM])}"
    )


def test_the_names_to_choose_from_can_include_cpu():
    assert resolve_gpu_name("CPU", (*CATALOGUE, CUSTOM, CPU)) == CPU
    with pytest.raises(ValueError, match="unknown gpu type 'cpu'"):
        resolve_gpu_name("cpu")


def test_the_crd_spelling_stays_exact():
    # spec.gpu.type is an enum in crds/llmdeployment.yaml: one canonical spelling per object.
    assert parse_spec({"gpu": {"type": "H100-80GB"}}).gpu.type == "H100-80GB"
    for typed in ("H100", "h100-80gb"):
        with pytest.raises(SpecError) as caught:
            parse_spec({"gpu": {"type": typed}})
        assert caught.value.field == "spec.gpu.type"
