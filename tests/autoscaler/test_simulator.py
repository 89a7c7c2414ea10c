"""The autoscaling simulator's engine and fleet model (benchmarks/autoscaling_sim)."""

import pathlib
import sys

import pytest

SIM = pathlib.Path(__file__).parents[2] / "benchmarks" / "autoscaling_sim"
sys.path.insert(0, str(SIM))

from fleet import simulate  # noqa: E402
from replica import Replica, ReplicaModel  # noqa: E402
from traces import TRACES, Request, make_trace  # noqa: E402


def run_alone(model, requests, until):
    replica = Replica(model)
    for request in requests:
        replica.advance(request.arrival)
        replica.add(request)
    replica.advance(until)
    return replica


def test_a_light_load_is_served_and_the_cache_is_returned():
    requests = make_trace("steady", duration=120, rate=4, seed=3)
    model = ReplicaModel(kv_capacity_tokens=400_000)
    replica = run_alone(model, requests, 400)
    assert replica.finished == len(requests) and replica.kv_used == 0
    assert replica.generated_tokens == sum(r.output_tokens for r in requests)
    # A first token takes at least the step that prefills the prompt.
    assert all(r.ttft >= model.step_time(r.prompt_tokens, 0) - 1e-9 for r in requests)
    assert replica.preemptions == 0


def test_a_small_cache_preempts_and_recomputes_yet_finishes_everything():
    requests = [Request(0.0, 1000, 600) for _ in range(6)]
    model = ReplicaModel(kv_capacity_tokens=6000)  # 6 x 1600 tokens do not fit at once
    replica = run_alone(model, requests, 600)
    assert replica.preemptions > 0
    assert replica.finished == 6 and replica.kv_used == 0
    # Recomputation re-prefills what a preempted request had: more prompt work than prompts.
    assert replica.prompt_tokens > 6000


def test_traces_are_deterministic_and_distinct():
    for name in TRACES:
        first = make_trace(name, duration=300, rate=10, seed=1)
        again = make_trace(name, duration=300, rate=10, seed=1)
        assert [(r.arrival, r.prompt_tokens) for r in first] == [
            (r.arrival, r.prompt_tokens) for r in again
        ]
    late = [r for r in make_trace("long_context", duration=300, rate=10) if r.arrival >= 150]
    assert late and min(r.prompt_tokens for r in late) >= 12_000
    with pytest.raises(ValueError, match="unknown trace"):
        make_trace("weekly")


class Fixed:
    name, interval = "fixed", 15.0

    def __init__(self, replicas):
        self.replicas = replicas

    def decide(self, view):
        return self.replicas


def test_replica_hours_count_every_replica_asked_for():
    requests = make_trace("steady", duration=600, rate=5, seed=2)
    model = ReplicaModel(kv_capacity_tokens=400_000, startup_seconds=60)
    result = simulate("steady", requests, Fixed(3), model, duration=600, initial_replicas=1)
    # One replica from 0 s, two more asked for at the first tick (15 s).
    assert result.replica_seconds == pytest.approx(600 + 2 * (600 - 15))
    assert result.peak_replicas == 3
    assert result.slo_attainment(2.0) == 1.0
