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


# With no memory left to give (peak device memory 97%), a preempting fleet is under sustained
# KV pressure: a fp8 KV cache (twice the tokens) comes before admitting fewer sequences, and
# only when the user allowed it (autoscaling.allowKvCacheDtype).
SUSTAINED = Observation(1.0, 40, 3, 0.2, peak_memory_fraction=0.97)


def test_fp8_kv_cache_only_when_allowed():
    assert recommend(CURRENT, SUSTAINED).settings == EngineSettings(0.85, 30)
    allowed = recommend(CURRENT, SUSTAINED, allow_kv_cache_dtype=True)
    assert allowed.settings == EngineSettings(0.85, 64, "fp8")
    assert "fp8 KV cache holds twice the tokens" in allowed.reason
    assert allowed.settings.as_dict() == {
        "gpuMemoryUtilization": 0.85,
        "maxNumSeqs": 64,
        "kvCacheDtype": "fp8",
    }
    # Raising the memory comes first, numerics unchanged, while there is room.
    roomy = Observation(1.0, 40, 3, 0.2)
    assert recommend(CURRENT, roomy, allow_kv_cache_dtype=True).settings == EngineSettings(0.9, 64)
    # Already fp8: fewer sequences, as without the permission.
    fp8 = EngineSettings(0.85, 64, "fp8")
    assert recommend(fp8, SUSTAINED, allow_kv_cache_dtype=True).settings == EngineSettings(
        0.85, 30, "fp8"
    )
    # The other rules keep the KV dtype they find.
    waiting = Observation(0.35, 64, 10, 0.0)
    assert recommend(fp8, waiting).settings == EngineSettings(0.85, 128, "fp8")


def test_a_fp8_kv_cache_goes_through_the_canary_and_rolls_back():
    plan = EngineSettings(0.9, 256)
    to_fp8 = recommend(plan, SUSTAINED, allow_kv_cache_dtype=True)
    canary = next_rollout(None, to_fp8, plan, None, None, 0.0, canary_seconds=60)
    assert (canary.phase, canary.settings.kv_cache_dtype) == ("Canary", "fp8")
    base = Observation(0.9, 100, 0, 0.1, ttft_p90_seconds=0.4)
    worse = Observation(0.9, 100, 0, 0.5, ttft_p90_seconds=0.4)
    back = next_rollout(canary, to_fp8, plan, base, worse, 61.0, canary_seconds=60)
    assert back.phase == "RolledBack" and "preemptions" in back.reason
    assert back.in_force() is None
    assert next_rollout(back, to_fp8, plan, base, base, 200.0, canary_seconds=60) is back
    # The annotation keeps the KV dtype; one without it (older operators) reads as auto.
    assert Rollout.from_annotation(back.to_annotation()) == back
    assert EngineSettings.from_dict({"gpuMemoryUtilization": 0.9, "maxNumSeqs": 8}) == (
        EngineSettings(0.9, 8, "auto")
    )
    with pytest.raises(ValueError, match="unknown kvCacheDtype"):
        EngineSettings.from_dict(
            {"gpuMemoryUtilization": 0.9, "maxNumSeqs": 8, "kvCacheDtype": "int4"}
        )
