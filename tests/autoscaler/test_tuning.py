"""Engine tuning recommendations and the rollback rule."""

import pytest

from kvpilot.operator.signals import MetricSample
from kvpilot.operator.tuning import (
    EngineSettings,
    Observation,
    Rollout,
    next_rollout,
    observe,
    recommend,
    rollback_reason,
)

CURRENT = EngineSettings(gpu_memory_utilization=0.85, max_num_seqs=64)


def test_preemption_gets_more_kv_memory():
    seen = Observation(
        peak_kv_cache_usage=1.0,
        peak_num_requests_running=40,
        num_requests_waiting=3,
        preemptions_per_second=0.2,
    )
    rec = recommend(CURRENT, seen)
    assert rec.settings == EngineSettings(0.9, 64) and rec.changes(CURRENT)
    # Near the ceiling only the room that is left is given.
    assert recommend(EngineSettings(0.93, 64), seen).settings.gpu_memory_utilization == 0.95


def test_memory_overhead_limits_the_raise_then_fewer_sequences():
    # The engine peaks at 97% of the device: no room to give, so admit fewer sequences.
    seen = Observation(1.0, 40, 3, 0.2, peak_memory_fraction=0.97)
    rec = recommend(CURRENT, seen)
    assert rec.settings == EngineSettings(0.85, 30)
    assert "fewer sequences" in rec.reason


def test_sequence_bound_admits_more_sequences():
    seen = Observation(
        peak_kv_cache_usage=0.35,
        peak_num_requests_running=64,
        num_requests_waiting=10,
        preemptions_per_second=0.0,
    )
    assert recommend(CURRENT, seen).settings == EngineSettings(0.85, 128)
    half_full = Observation(0.5, 64, 10, 0.0)
    assert recommend(CURRENT, half_full).settings.max_num_seqs == 90  # ceil(64 * 0.7 / 0.5)


def test_a_comfortable_fleet_keeps_its_settings():
    seen = Observation(0.6, 20, 0, 0.0)
    assert not recommend(CURRENT, seen).changes(CURRENT)
    with pytest.raises(ValueError, match="out of range"):
        recommend(EngineSettings(1.2, 8), seen)


def test_rollback_on_worse_ttft_or_preemptions():
    base = Observation(0.9, 30, 1, 0.10, ttft_p90_seconds=0.50)
    assert rollback_reason(base, Observation(0.9, 30, 1, 0.10, ttft_p90_seconds=0.54)) is None
    assert "TTFT p90" in rollback_reason(base, Observation(0.9, 30, 1, 0.1, ttft_p90_seconds=0.6))
    assert "preemptions" in rollback_reason(base, Observation(0.9, 30, 1, 0.2, 0.5))
    assert rollback_reason(Observation(0.9, 30, 1, 0.0), Observation(0.9, 30, 1, 0.0)) is None


def test_observe_reads_per_pod_peaks():
    samples = [
        MetricSample("a", 0.0, 0.5, 10, 2, num_preemptions_total=0),
        MetricSample("b", 0.0, 0.9, 30, 0, num_preemptions_total=0),
        MetricSample("a", 10.0, 0.7, 12, 4, num_preemptions_total=5),
        MetricSample("b", 10.0, 0.8, 20, 0, num_preemptions_total=5),
    ]
    seen = observe(samples)
    assert seen.peak_kv_cache_usage == 0.9 and seen.peak_num_requests_running == 30
    assert seen.num_requests_waiting == pytest.approx(1.5)
    assert seen.preemptions_per_second == pytest.approx(0.5)
    assert observe(samples, start=20.0) is None


PLAN = EngineSettings(0.9, 256)
PREEMPTING = Observation(1.0, 200, 5, 0.5)


def test_a_rollout_starts_as_a_canary_then_is_applied_when_it_holds_up():
    more_memory = recommend(PLAN, PREEMPTING)
    canary = next_rollout(None, more_memory, PLAN, None, None, 0.0, canary_seconds=120)
    assert (canary.phase, canary.settings, canary.previous) == (
        "Canary",
        EngineSettings(0.95, 256),
        None,
    )
    # Judged only after its time, and only with both sides observed.
    same = Observation(0.9, 100, 0, 0.0, ttft_p90_seconds=0.4)
    assert next_rollout(canary, more_memory, PLAN, same, same, 60.0, canary_seconds=120) is canary
    assert next_rollout(canary, more_memory, PLAN, same, None, 200.0, canary_seconds=120) is canary
    applied = next_rollout(canary, more_memory, PLAN, same, same, 200.0, canary_seconds=120)
    assert (applied.phase, applied.in_force()) == ("Applied", EngineSettings(0.95, 256))
    # The applied settings are the new base: the same recommendation changes nothing.
    settled = recommend(applied.in_force(), Observation(0.8, 100, 0, 0.0))
    assert next_rollout(applied, settled, PLAN, same, same, 300.0, canary_seconds=120) is applied


def test_a_worse_canary_is_rolled_back_and_not_tried_again():
    more_memory = recommend(PLAN, PREEMPTING)
    canary = next_rollout(None, more_memory, PLAN, None, None, 0.0, canary_seconds=60)
    base = Observation(0.9, 100, 0, 0.0, ttft_p90_seconds=0.4)
    slow = Observation(0.9, 100, 0, 0.0, ttft_p90_seconds=0.9)
    back = next_rollout(canary, more_memory, PLAN, base, slow, 61.0, canary_seconds=60)
    assert back.phase == "RolledBack" and "TTFT p90" in back.reason
    assert back.in_force() is None  # the plan's settings again
    assert next_rollout(back, more_memory, PLAN, base, base, 200.0, canary_seconds=60) is back


def test_rollout_annotation_round_trip_and_errors():
    rollout = Rollout("Applied", EngineSettings(0.95, 128), EngineSettings(0.9, 256), 12.5, "ok")
    assert Rollout.from_annotation(rollout.to_annotation()) == rollout
    with pytest.raises(ValueError, match="phase 'Paused'"):
        Rollout.from_annotation(rollout.to_annotation().replace("Applied", "Paused"))
    with pytest.raises(ValueError, match="not a rollout"):
        Rollout.from_annotation('{"phase": "Canary"}')
