"""The pure parts of the autoscaling loop: shapes from the planner, wake requests, status."""

import dataclasses
import datetime
import json
import pathlib

import pytest

from kvpilot.engine.model_shape import ModelShape
from kvpilot.operator import autoscaling_handlers, handlers
from kvpilot.operator.apply import status_changed
from kvpilot.operator.autoscaler import (
    SHAPE_ANNOTATION,
    AutoscalerMemory,
    AutoscalingPolicy,
    Decision,
    FleetState,
    Shape,
    apply_shape,
    decide,
    starting_hold_seconds,
)
from kvpilot.operator.autoscaling_handlers import (
    HELD_REQUESTS_ANNOTATION,
    WAKE_ANNOTATION,
    decision_status,
    held_requests,
    larger_shape,
    remembered,
    wake_time,
    without_nulls,
)
from kvpilot.operator.planner import plan_for_spec
from kvpilot.operator.pods import stalled, starting_pods, startup_seconds, unschedulable
from kvpilot.operator.signals import MetricSample, summarize
from kvpilot.operator.spec import SpecError, parse_spec

UTC = datetime.UTC
CONFIGS = pathlib.Path(__file__).parents[1] / "operator" / "configs"


@pytest.fixture(scope="module")
def llama():
    return ModelShape.from_hf_config(json.loads((CONFIGS / "Meta-Llama-3-8B.json").read_text()))


def spec_on(gpu: dict, **extra):
    return parse_spec(
        {"model": {"source": "hf://meta-llama/Meta-Llama-3-8B"}, "gpu": gpu,
         "engine": {"maxModelLen": 8192}, "autoscaling": {"maxReplicas": 4, **extra}}
    )  # fmt: skip


def test_larger_shape_is_the_next_tensor_parallel_size_the_planner_accepts(llama):
    spec = spec_on({"type": "L4"})
    current = plan_for_spec(spec, llama)
    shape = larger_shape(spec, current, llama, ())
    bigger = plan_for_spec(
        dataclasses.replace(spec, tensor_parallel_size=shape.tensor_parallel_size), llama
    )
    assert shape.tensor_parallel_size > current.tensor_parallel_size
    assert shape.gpu_type == "L4"
    assert shape.kv_cache_capacity_tokens == bigger.kv_capacity_tokens > current.kv_capacity_tokens


def test_larger_shape_moves_to_an_allowed_bigger_gpu_when_tp_is_exhausted(llama):
    spec = spec_on({"type": "L4", "perNode": 1}, allowedGpuTypes=["H100-80GB", "L40S", "L4"])
    current = plan_for_spec(spec, llama)
    shape = larger_shape(spec, current, llama, spec.autoscaling.allowed_gpu_types)
    # L40S is the smallest allowed GPU with more memory than an L4.
    assert shape.gpu_type == "L40S" and shape.tensor_parallel_size == 1
    assert shape.kv_cache_capacity_tokens > current.kv_capacity_tokens


def test_no_larger_shape_for_a_user_set_tensor_parallel_size(llama):
    spec = dataclasses.replace(spec_on({"type": "L4"}), tensor_parallel_size=2)
    assert larger_shape(spec, plan_for_spec(spec, llama), llama, ("H100-80GB",)) is None


def test_apply_shape_fills_only_what_the_planner_chooses():
    spec = spec_on({"type": "L4"}, allowedGpuTypes=["L40S"])
    shaped = apply_shape(spec, {SHAPE_ANNOTATION: Shape(2, "L40S", 1).to_annotation()})
    assert (shaped.tensor_parallel_size, shaped.gpu.type) == (2, "L40S")
    fixed = dataclasses.replace(spec, tensor_parallel_size=1)
    assert apply_shape(fixed, {SHAPE_ANNOTATION: Shape(2, "L40S", 1).to_annotation()}) is fixed
    with pytest.raises(SpecError, match="GPU type must be one of"):
        apply_shape(spec, {SHAPE_ANNOTATION: Shape(2, "B200", 1).to_annotation()})
    with pytest.raises(SpecError, match="not a shape"):
        apply_shape(spec, {SHAPE_ANNOTATION: "tp=2"})


def test_wake_time_reads_unix_seconds_and_rfc3339():
    assert wake_time({WAKE_ANNOTATION: "1700000000"}) == 1700000000.0
    assert wake_time({WAKE_ANNOTATION: "2023-11-14T22:13:20Z"}) == 1700000000.0
    assert wake_time({WAKE_ANNOTATION: "soon"}) is None
    assert wake_time({WAKE_ANNOTATION: "2023-11-14T22:13:20"}) is None  # no zone: ambiguous
    assert wake_time({}) is None


def test_held_requests_count_only_with_a_recent_wake_time():
    fresh = {WAKE_ANNOTATION: "1700000000", HELD_REQUESTS_ANNOTATION: "40"}
    assert held_requests(fresh, now=1700000030.0) == 40
    assert held_requests(fresh, now=1700000061.0) == 0  # the router that wrote it is gone
    assert held_requests({HELD_REQUESTS_ANNOTATION: "40"}, now=1700000000.0) == 0  # no time
    assert held_requests({**fresh, HELD_REQUESTS_ANNOTATION: "0"}, now=1700000001.0) == 0
    assert held_requests({**fresh, HELD_REQUESTS_ANNOTATION: "-3"}, now=1700000001.0) == 0
    assert held_requests({**fresh, HELD_REQUESTS_ANNOTATION: "many"}, now=1700000001.0) == 0
    assert held_requests({WAKE_ANNOTATION: "1700000000"}, now=1700000001.0) == 0


def test_unschedulable_reads_pod_scheduled():
    assert unschedulable({"status": {"conditions": [{"type": "PodScheduled", "status": "False",
                                                     "reason": "Unschedulable"}]}})  # fmt: skip
    assert not unschedulable({"status": {"conditions": [{"type": "PodScheduled",
                                                         "status": "True"}]}})  # fmt: skip
    assert not unschedulable({"status": {}})


NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def pod_at(age, scheduled="True", ready="False", **metadata):
    """A pod created ``age`` seconds before ``NOW`` with these conditions."""
    created = datetime.datetime.fromtimestamp(NOW - age, UTC).isoformat().replace("+00:00", "Z")
    conditions = [{"type": "PodScheduled", "status": scheduled}, {"type": "Ready", "status": ready}]
    return {"metadata": {"creationTimestamp": created, **metadata},
            "status": {"conditions": conditions}}  # fmt: skip


def test_starting_pods_are_placed_not_ready_and_younger_than_the_bound():
    pods = [
        pod_at(60),  # starting
        pod_at(299),  # starting, just inside the bound
        pod_at(301),  # stuck past the bound (crash loop, failed model load)
        pod_at(60, ready="True"),  # serving
        pod_at(60, scheduled="False"),  # unschedulable: Pending, not starting
        pod_at(60, deletionTimestamp="2027-01-15T08:00:00Z"),  # terminating
        {"metadata": {}, "status": {"conditions": [{"type": "PodScheduled", "status": "True"}]}},
    ]
    assert starting_pods(pods, NOW, 300.0) == 2
    assert starting_pods(pods, NOW, 302.0) == 3
    assert starting_pods([], NOW, 300.0) == 0
    # The bound: twice the start-up time, never under the floor (5 minutes).
    assert starting_hold_seconds(0.0) == starting_hold_seconds(150.0) == 300.0
    assert starting_hold_seconds(200.0) == 400.0


def stamp(seconds_ago: float) -> str:
    return (
        datetime.datetime.fromtimestamp(NOW - seconds_ago, UTC).isoformat().replace("+00:00", "Z")
    )


def engine_pod(started: float | None, ready: str, turned: float, **metadata):
    """A placed pod whose container runs since ``started`` seconds ago (None: waiting), with
    ``Ready`` ``ready`` since ``turned`` seconds ago."""
    pod = pod_at(600, ready=ready, **metadata)
    pod["status"]["conditions"][1]["lastTransitionTime"] = stamp(turned)
    state = (
        {"running": {"startedAt": stamp(started)}}
        if started is not None
        else {"waiting": {"reason": "ContainerCreating"}}
    )
    pod["status"]["containerStatuses"] = [{"name": "engine", "state": state}]
    return pod


def test_a_pod_that_was_ready_and_stopped_answering_its_probe_is_stalled_not_starting():
    overloaded = engine_pod(started=120, ready="False", turned=20)  # Ready at ~110 s, then not
    fresh = engine_pod(started=30, ready="False", turned=40)  # not Ready since it was placed
    creating = engine_pod(started=None, ready="False", turned=40)
    restarted = engine_pod(started=5, ready="False", turned=20)  # crashed and runs again
    serving = engine_pod(started=120, ready="True", turned=110)
    leaving = engine_pod(started=120, ready="False", turned=20,
                         deletionTimestamp="2027-01-15T08:00:00Z")  # fmt: skip
    assert [stalled(p) for p in (overloaded, fresh, creating, restarted, serving, leaving)] == [
        True, False, False, False, False, False,
    ]  # fmt: skip
    # Young as it is, the stalled pod is not capacity on its way: it holds no scale-up.
    assert starting_pods([overloaded, fresh, creating, restarted], NOW, 3600.0) == 3


def test_a_pod_stuck_starting_past_the_bound_stops_holding_scale_ups():
    policy = AutoscalingPolicy(max_replicas=8)
    busy = [MetricSample(f"p-{i}", NOW, 1.0, 10, 30) for i in range(2)]  # 2 pods, queues grow

    def decided(*pods):
        bound = starting_hold_seconds(startup_seconds([]))
        fleet = FleetState(
            replicas=2 + len(pods),
            ready_replicas=2,
            pending_replicas=sum(1 for pod in pods if unschedulable(pod)),
            starting_replicas=starting_pods(list(pods), NOW, bound),
        )
        return decide(busy, policy, fleet, AutoscalerMemory(), NOW)

    assert decided(pod_at(120)).reason == "StartingPods"
    assert decided(pod_at(120)).desired_replicas == 3
    assert decided(pod_at(900)).desired_replicas == 6  # stuck: up, as if it were not there
    assert decided(pod_at(900, scheduled="False")).reason == "PendingPods"  # however old


def test_status_carries_the_decision_and_the_learned_capacity():
    signals = summarize([MetricSample("p", 0.0, 0.5, 3, 1), MetricSample("p", 10.0, 0.7, 5, 1)])
    memory = AutoscalerMemory(replica_tokens_per_second=9000.0)
    decision = Decision(3, "ScaleUp", "KV load ...", signals, None, memory)
    now = datetime.datetime(2026, 11, 30, 10, 0, tzinfo=datetime.UTC)
    status = decision_status(decision, {"desiredReplicas": 2}, now)
    assert status["desiredReplicas"] == 3
    assert status["lastScaleTime"] == "2026-11-30T10:00:00Z"
    assert status["kvCacheUsage"] == pytest.approx(0.6)
    assert status["lastDecision"]["reason"] == "ScaleUp"
    assert status["lastDecision"]["signals"]["requestsRunning"] == pytest.approx(4.0)
    # A restarted operator starts from what the last one learned.
    assert remembered({"status": status}).replica_tokens_per_second == 9000.0
    assert remembered({}).replica_tokens_per_second is None
    # Same replicas: the last scale time stays.
    same = decision_status(decision, {"desiredReplicas": 3, "lastScaleTime": "earlier"}, now)
    assert same["lastScaleTime"] == "earlier"


def test_an_unchanged_decision_changes_no_status_field():
    """The loop writes status only when a field differs: the same decision an interval later
    keeps its time; a different one (here: other signals) gets the new time."""
    signals = summarize([MetricSample("p", 0.0, 0.5, 3, 1), MetricSample("p", 10.0, 0.7, 5, 1)])
    decision = Decision(2, "Stable", "KV load 1.2 replicas", signals, None, AutoscalerMemory())
    first = decision_status(decision, {}, datetime.datetime(2026, 11, 30, 10, 0, tzinfo=UTC))
    # As the API server stores the merge patch: its nulls (no capacity learned yet) removed.
    stored = without_nulls(first)
    assert "replicaTokensPerSecond" not in stored["lastDecision"]
    later = datetime.datetime(2026, 11, 30, 10, 0, 15, tzinfo=UTC)
    again = decision_status(decision, stored, later)
    assert again == first and not status_changed(stored, again)
    assert again["lastDecision"]["time"] == "2026-11-30T10:00:00Z"
    busier = summarize([MetricSample("p", 0.0, 0.9, 3, 1), MetricSample("p", 10.0, 0.9, 5, 1)])
    moved = decision_status(dataclasses.replace(decision, signals=busier), stored, later)
    assert moved["lastDecision"]["time"] == "2026-11-30T10:00:15Z"
    assert status_changed(stored, moved)
    assert moved["kvCacheUsage"] == pytest.approx(0.9)


def test_the_loop_sizes_with_the_reconcilers_function(monkeypatch, llama):
    """``AutoscalingLoop.planned`` is ``handlers.plan_deployment``: the shape the autoscaler chose is
    planned, and the spec as written (the TP the user left open) is kept beside it."""
    calls = []

    def plan_deployment(body, load, image):
        calls.append((body, image))
        return handlers.plan_deployment(body, lambda _source: llama, image)

    monkeypatch.setattr(autoscaling_handlers, "plan_deployment", plan_deployment)
    config = handlers.HandlerConfig(engine_image="engine:1")
    runtime = handlers.Runtime(
        client=object(), models=object(), metrics=object(), config=config, post_event=print
    )
    loop = autoscaling_handlers.AutoscalingLoop(autoscaling_handlers.AutoscalerConfig(), runtime)
    shape = json.dumps({"tensorParallelSize": 2, "gpuType": "L4"})
    body = {
        "metadata": {"name": "llama", "namespace": "ml", "annotations": {SHAPE_ANNOTATION: shape}},
        "spec": {"model": {"source": "hf://x/y"}, "gpu": {"type": "L4"},
                 "autoscaling": {"maxReplicas": 4}},
    }  # fmt: skip
    planned = loop.planned(body)
    assert calls == [(body, "engine:1")]
    assert planned.plan.tensor_parallel_size == 2 and planned.spec.tensor_parallel_size == 2
    assert planned.user_spec.tensor_parallel_size is None
    assert planned.spec.image == "engine:1"


def test_startup_seconds_from_creation_to_ready():
    def pod(created, ready):
        return {
            "metadata": {"creationTimestamp": created},
            "status": {"conditions": [
                {"type": "Ready", "status": "True", "lastTransitionTime": ready}
            ]},
        }  # fmt: skip

    pods = [pod("2026-11-30T10:00:00Z", "2026-11-30T10:01:30Z"),
            pod("2026-11-30T10:05:00Z", "2026-11-30T10:07:00Z")]  # fmt: skip
    assert startup_seconds(pods) == 120.0
    assert startup_seconds([{"metadata": {}, "status": {}}]) == 0.0
