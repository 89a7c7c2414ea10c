"""operator/handlers.py's pure decisions: planned a body, the status it should have, its events."""

from __future__ import annotations

import datetime
import json
import pathlib

from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME
from kvpilot.engine.model_shape import ModelShape
from kvpilot.operator import handlers, manifests
from kvpilot.operator.autoscaler import SHAPE_ANNOTATION
from kvpilot.operator.handlers import (
    Event,
    desired_status,
    plan_deployment,
    plan_user_spec,
    transition_events,
    tuning_rollout,
    with_chosen_shape,
)
from kvpilot.operator.planner import PlanError
from kvpilot.operator.tuning import TUNING_ANNOTATION, EngineSettings, Rollout

CONFIGS = pathlib.Path(__file__).parent / "configs"
NOW = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.UTC)
LATER = NOW + datetime.timedelta(minutes=5)


def load(name: str):
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    return lambda _source: ModelShape.from_hf_config(config)


def body(
    spec: dict, generation: int = 1, status: dict | None = None, annotations: dict | None = None
) -> dict:
    meta = {"name": "llama", "namespace": "ml", "generation": generation, "resourceVersion": "7"}
    if annotations:
        meta["annotations"] = annotations
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": meta,
        "spec": spec,
        "status": status or {},
    }


def deployment(
    replicas: int,
    ready: int,
    updated: int,
    generation: int = 1,
    observed: int = 1,
    conditions: list | None = None,
) -> dict:
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "conditions": conditions or [],
        },
    }


def states(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


GPU = {
    "model": {"source": "hf://meta-llama/Meta-Llama-3-8B"},
    "gpu": {"type": "H100-80GB"},
    "engine": {"maxModelLen": 8192},
}


def test_size_plans_a_valid_spec_with_the_operator_image():
    planned = plan_user_spec(body(GPU), load("Meta-Llama-3-8B"), "registry.example/engine:1")
    assert (
        planned.ok and planned.plan.tensor_parallel_size == 1 and planned.plan.max_model_len == 8192
    )
    assert planned.spec.image == "registry.example/engine:1"
    assert (
        plan_user_spec(body({**GPU, "image": "mine:2"}), load("Meta-Llama-3-8B"), "x").spec.image
        == "mine:2"
    )


def test_size_reports_invalid_specs_and_plan_failures():
    invalid = plan_user_spec(
        body({**GPU, "gpu": {"type": "L4"}, "tensorParallelSize": 0}), load("Meta-Llama-3-8B"), "x"
    )
    assert (invalid.ok, invalid.reason, invalid.spec) == (False, "InvalidSpec", None)
    assert "spec.tensorParallelSize" in invalid.message
    too_big = plan_user_spec(
        body({"model": {"source": "hf://x/y"}, "gpu": {"type": "L4"}, "tensorParallelSize": 2}),
        load("Meta-Llama-3-70B"),
        "x",
    )
    # At TP 2 a pipeline of four L4s holds the weights but not one 8,192-token sequence.
    assert (too_big.ok, too_big.reason) == (False, "InsufficientKVCache")
    assert too_big.message.endswith("; tensor parallel size 8 would fit")

    def unavailable(_source):
        raise PlanError("ConfigUnavailable", "offline")

    assert plan_user_spec(body(GPU), unavailable, "x").reason == "ConfigUnavailable"


def test_shaped_rolls_out_the_autoscalers_shape():
    spec = {
        "model": {"source": "hf://x/y"},
        "gpu": {"type": "L4"},
        "autoscaling": {"maxReplicas": 4},
    }
    obj = body(
        spec, annotations={SHAPE_ANNOTATION: json.dumps({"tensorParallelSize": 2, "gpuType": "L4"})}
    )
    loader = load("Meta-Llama-3-8B")
    result = with_chosen_shape(plan_user_spec(obj, loader, "x"), obj, loader)
    assert (result.plan.tensor_parallel_size, result.plan.gpus_per_replica) == (2, 2)
    bad = body(spec, annotations={SHAPE_ANNOTATION: "{}"})
    assert with_chosen_shape(plan_user_spec(bad, loader, "x"), bad, loader).reason == "InvalidShape"


def test_status_of_a_fresh_object_without_deployment():
    planned = plan_user_spec(body(GPU), load("Meta-Llama-3-8B"), "x")
    status = desired_status(body(GPU), planned, None, now=NOW)
    assert states(status) == {
        "Sized": ("True", "Planned"),
        "Progressing": ("True", "RollingOut"),
        "Ready": ("False", "NoDeployment"),
        "Degraded": ("False", "AsExpected"),
    }
    assert {c["observedGeneration"] for c in status["conditions"]} == {1}
    assert {c["lastTransitionTime"] for c in status["conditions"]} == {"2026-01-01T12:00:00Z"}
    assert status["plan"] == planned.plan.to_status()
    assert (status["selector"], status["endpoint"]) == (
        "kvpilot.dev/llmdeployment=llama",
        "http://llama.ml.svc.cluster.local:8000/v1",
    )
    assert (status["replicas"], status["readyReplicas"], status["observedGeneration"]) == (0, 0, 1)
    routed = desired_status(body(GPU), planned, None, now=NOW, router=True)
    assert routed["endpoint"] == "http://llama-router.ml.svc.cluster.local:8000/v1"


def test_status_follows_the_rollout_and_keeps_transition_times():
    planned = plan_user_spec(body(GPU), load("Meta-Llama-3-8B"), "x")
    rolling = desired_status(body(GPU), planned, deployment(2, 1, 2), now=NOW)
    assert states(rolling)["Ready"] == ("False", "ReplicasNotReady")
    assert states(rolling)["Progressing"] == ("True", "RollingOut")
    done = desired_status(body(GPU, status=rolling), planned, deployment(2, 2, 2), now=LATER)
    assert states(done)["Ready"] == ("True", "ReplicasReady") and states(done)["Progressing"] == (
        "False",
        "RolloutComplete",
    )
    times = {c["type"]: c["lastTransitionTime"] for c in done["conditions"]}
    assert times == {
        "Sized": "2026-01-01T12:00:00Z",
        "Progressing": "2026-01-01T12:05:00Z",
        "Ready": "2026-01-01T12:05:00Z",
        "Degraded": "2026-01-01T12:00:00Z",
    }
    stale = desired_status(
        body(GPU), planned, deployment(2, 2, 2, generation=3, observed=2), now=NOW
    )
    assert states(stale)["Progressing"] == (
        "True",
        "RollingOut",
    )  # the controller has not seen the new spec


def test_status_reports_failures():
    planned = plan_user_spec(body(GPU), load("Meta-Llama-3-8B"), "x")
    stuck = deployment(
        1,
        0,
        1,
        conditions=[
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": "timed out",
            }
        ],
    )
    assert states(desired_status(body(GPU), planned, stuck, now=NOW))["Degraded"] == (
        "True",
        "ProgressDeadlineExceeded",
    )
    conflict = desired_status(
        body(GPU), planned, None, now=NOW, apply_failure=("ChildConflict", "taken")
    )
    assert states(conflict)["Degraded"] == ("True", "ChildConflict")
    invalid = plan_user_spec(body({"gpu": {"type": "T4"}}), load("Meta-Llama-3-8B"), "x")
    status = desired_status(body({"gpu": {"type": "T4"}}), invalid, deployment(1, 1, 1), now=NOW)
    assert states(status) == {
        "Sized": ("False", "InvalidSpec"),
        "Progressing": ("False", "NotSized"),
        "Ready": ("True", "ReplicasReady"),  # the pods of the last valid spec still serve
        "Degraded": ("True", "InvalidSpec"),
    }
    assert "plan" not in status and "model" not in status


def test_zero_replicas_is_not_ready():
    spec = {**GPU, "replicas": 0}
    status = desired_status(
        body(spec),
        plan_user_spec(body(spec), load("Meta-Llama-3-8B"), "x"),
        deployment(0, 0, 0),
        now=NOW,
    )
    assert states(status)["Ready"] == ("False", "ScaledToZero")


def test_events_only_for_changes():
    planned = plan_user_spec(body(GPU), load("Meta-Llama-3-8B"), "x")
    first = desired_status(body(GPU), planned, None, now=NOW)
    assert transition_events([], first["conditions"]) == [
        Event("Normal", "Planned", "Sized=True: " + first["conditions"][0]["message"])
    ]
    assert transition_events(first["conditions"], first["conditions"]) == []
    ready = desired_status(body(GPU, status=first), planned, deployment(1, 1, 1), now=LATER)
    assert [
        (e.type, e.reason) for e in transition_events(first["conditions"], ready["conditions"])
    ] == [("Normal", "ReplicasReady")]
    invalid = plan_user_spec(body({"gpu": {"type": "T4"}}), load("Meta-Llama-3-8B"), "x")
    broken = desired_status(body({}, status=ready), invalid, deployment(1, 0, 1), now=LATER)
    assert [
        (e.type, e.reason) for e in transition_events(ready["conditions"], broken["conditions"])
    ] == [
        ("Warning", "InvalidSpec"),
        ("Warning", "ReplicasNotReady"),
    ]
    fixed = desired_status(body(GPU, status=broken), planned, deployment(1, 1, 1), now=LATER)
    assert [
        (e.type, e.reason) for e in transition_events(broken["conditions"], fixed["conditions"])
    ] == [
        ("Normal", "Planned"),
        ("Normal", "ReplicasReady"),
        ("Normal", "Recovered"),
    ]


def test_the_default_model_is_named_as_the_engine_serves_it():
    planned = plan_user_spec(body({}), load("SmolLM2-135M-Instruct"), "x")
    assert desired_status(body({}), planned, None, now=NOW)["model"] == DEFAULT_MODEL_NAME
    assert handlers.DEFAULT_MODEL_NAME is DEFAULT_MODEL_NAME  # one name, the engine's


TUNED = {**GPU, "replicas": 3, "autoscaling": {"maxReplicas": 4, "tuneEngine": True}}


def test_the_recorded_tuning_is_rendered_while_tuning_is_on():
    canary = Rollout("Canary", EngineSettings(0.95, 512), EngineSettings(0.92, 300), 5.0, "full")
    annotated = body(TUNED, annotations={TUNING_ANNOTATION: canary.to_annotation()})
    planned = plan_deployment(annotated, load("Meta-Llama-3-8B"), "x")
    assert tuning_rollout(annotated, planned) == canary
    assert tuning_rollout(body(TUNED), planned) is None
    # Tuning switched off (or mode external): every pod back on the plan, the canary retired.
    for autoscaling in ({"maxReplicas": 4}, {"maxReplicas": 4, "tuneEngine": True,
                                              "mode": "external"}):  # fmt: skip
        spec = {**TUNED, "autoscaling": autoscaling}
        off = body(spec, annotations={TUNING_ANNOTATION: canary.to_annotation()})
        retired = tuning_rollout(off, plan_deployment(off, load("Meta-Llama-3-8B"), "x"))
        assert (retired.phase, retired.previous, retired.in_force()) == ("RolledBack", None, None)
    broken = body(TUNED, annotations={TUNING_ANNOTATION: "{"})
    assert tuning_rollout(broken, planned) is None


def test_the_canary_counts_in_the_status():
    planned = plan_user_spec(body(TUNED), load("Meta-Llama-3-8B"), "x")
    both = desired_status(
        body(TUNED), planned, deployment(2, 2, 2), now=NOW, canary=deployment(1, 0, 1)
    )
    assert (both["replicas"], both["readyReplicas"]) == (3, 2)
    assert states(both)["Ready"] == ("False", "ReplicasNotReady")
    assert states(both)["Progressing"] == ("True", "RollingOut")
    ready = desired_status(
        body(TUNED), planned, deployment(2, 2, 2), now=NOW, canary=deployment(1, 1, 1)
    )
    assert states(ready)["Ready"] == ("True", "ReplicasReady")
    assert states(ready)["Progressing"] == ("False", "RolloutComplete")


def test_a_kv_dtype_rollout_is_retired_when_no_longer_allowed():
    allowed = {**TUNED, "autoscaling": {**TUNED["autoscaling"], "allowKvCacheDtype": True}}
    fp8 = Rollout("Applied", EngineSettings(0.9, 256, "fp8"), None, 5.0, "pressure")
    for spec, phase in ((allowed, "Applied"), (TUNED, "RolledBack")):
        annotated = body(spec, annotations={TUNING_ANNOTATION: fp8.to_annotation()})
        planned = plan_deployment(annotated, load("Meta-Llama-3-8B"), "x")
        assert tuning_rollout(annotated, planned).phase == phase
    # A spec that sets fp8 itself: the tuner's fp8 is the plan's, nothing to retire.
    own = {**TUNED, "engine": {**TUNED["engine"], "kvCacheDtype": "fp8"}}
    annotated = body(own, annotations={TUNING_ANNOTATION: fp8.to_annotation()})
    planned = plan_deployment(annotated, load("Meta-Llama-3-8B"), "x")
    assert planned.plan.kv_cache_dtype == "fp8"
    assert tuning_rollout(annotated, planned).phase == "Applied"


def test_a_plan_beyond_one_node_is_a_leader_worker_set():
    """Llama-3.1-405B in bf16 on H100s plans TP 8 x PP 2: one LeaderWorkerSet group of two
    8-GPU pods per replica, its progress read like a Deployment's; without the LWS CRD the
    conditions say so."""
    spec = {"model": {"source": "hf://meta-llama/Llama-3.1-405B"}, "gpu": {"type": "H100-80GB"}}
    planned = plan_user_spec(body(spec), load("Meta-Llama-3.1-405B"), "x")
    assert planned.ok
    assert (planned.plan.tensor_parallel_size, planned.plan.pipeline_parallel_size) == (8, 2)
    children = manifests.children("llama", "ml", planned.spec, planned.plan)
    assert [c["kind"] for c in children] == ["LeaderWorkerSet", "Service", "PodDisruptionBudget"]
    lws = children[0]
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == "8"

    missing = handlers.leader_worker_sets_missing(planned.plan)
    status = desired_status(body(spec), planned, None, now=NOW, apply_failure=missing)
    assert states(status) == {
        "Sized": ("True", "Planned"),
        "Progressing": ("True", "RollingOut"),
        "Ready": ("False", "NoDeployment"),
        "Degraded": ("True", "LeaderWorkerSetNotInstalled"),
    }
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["message"].startswith(
        "each replica needs 2 nodes (tensor parallel 8 x pipeline parallel 2)"
    )
    assert status["plan"]["pipelineParallelSize"] == 2 and status["plan"]["gpusPerReplica"] == 16
    sized = next(c for c in status["conditions"] if c["type"] == "Sized")
    assert (
        "16 x H100-80GB per replica (tensor_parallel_size 8 x pipeline_parallel_size 2"
        in (sized["message"])
    )

    # A live LeaderWorkerSet whose one group is ready: Ready like a Deployment's replicas.
    live = {
        **lws,
        "metadata": {**lws["metadata"], "generation": 1},
        "status": {
            "observedGeneration": 1,
            "replicas": 1,
            "readyReplicas": 1,
            "updatedReplicas": 1,
        },
    }
    status = desired_status(body(spec), planned, live, now=NOW)
    assert states(status)["Ready"] == ("True", "ReplicasReady")
    assert states(status)["Degraded"] == ("False", "AsExpected")
