"""The pure decision function, with plain values and a fast-forwarded clock (looptime)."""

import asyncio
import math
import random
from dataclasses import replace

import pytest

from kvpilot.operator.autoscaler import (
    AutoscalerMemory,
    AutoscalingPolicy,
    FleetState,
    Shape,
    decide,
    replicas_for_load,
)
from kvpilot.operator.forecast import DemandHistory
from kvpilot.operator.signals import MetricSample, summarize
from kvpilot.operator.spec import parse_spec

REQUESTS_PER_REPLICA = 10  # each short request holds 10% of a replica's KV cache


def pod_samples(t, demand, ready, *, per_replica=REQUESTS_PER_REPLICA, served=0.0):
    """One scrape round of ``ready`` pods sharing ``demand`` (in full replicas of KV cache)."""
    usage = min(1.0, demand / ready)
    running = usage * per_replica
    waiting = max(0.0, demand - ready) * per_replica / ready
    return [
        MetricSample(
            f"p-{i}",
            t,
            usage,
            running,
            waiting,
            request_success_total=served,
            prompt_tokens_total=served * 100,
        )
        for i in range(ready)
    ]


class Fleet:
    """A toy cluster: pods become ready ``startup`` seconds after they are asked for (starting
    until then, never stuck); only ``room`` of them fit on the nodes, the rest stay Pending
    (unschedulable)."""

    def __init__(self, replicas, startup=30.0, room=None, **fleet):
        self.pods = [-math.inf] * replicas  # ready times
        self.startup = startup
        self.room = room
        self.fleet = fleet

    def scheduled(self):
        return self.pods if self.room is None else self.pods[: self.room]

    def ready(self, now):
        return sum(t <= now for t in self.scheduled())

    def state(self, now):
        pending = len(self.pods) - len(self.scheduled())
        starting = len(self.scheduled()) - self.ready(now)
        return FleetState(len(self.pods), self.ready(now), pending, starting, **self.fleet)

    def scale(self, desired, now):
        while len(self.pods) < desired:
            self.pods.append(now + self.startup)
        del self.pods[desired:]


async def drive(
    demand, policy, *, minutes, replicas=1, tick=5.0, startup=30.0, room=None, memory=None, **fleet
):
    """Run the control loop against ``demand(t)`` on the loop's (fast-forwarded) clock."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    cluster = Fleet(replicas, startup, room, **fleet)
    memory = memory or AutoscalerMemory()
    window, history, served = [], [], 0.0
    while loop.time() - start < minutes * 60:
        now = loop.time() - start
        ready = cluster.ready(now)
        load = demand(now)
        served += load * tick
        if ready:
            window += pod_samples(now, load, ready, served=served if load else 0.0)
        window = [s for s in window if s.timestamp >= now - policy.stable_window_seconds]
        decision = decide(window, policy, cluster.state(now), memory, now)
        memory = decision.memory
        cluster.scale(decision.desired_replicas, now)
        history.append((now, decision))
        await asyncio.sleep(tick)
    return history


def replicas_at(history, t):
    return [d.desired_replicas for when, d in history if when <= t][-1]


POLICY = AutoscalingPolicy(
    min_replicas=1,
    max_replicas=20,
    target_kv_cache_usage=0.7,
    stable_window_seconds=60,
    panic_window_seconds=10,
    scale_down_stabilization_seconds=120,
)


def test_load_in_replica_units():
    signals = summarize(pod_samples(0.0, 2.1, 2))
    # 2.1 replicas of KV in 2 pods: each full, 1 replica's worth (10 requests) waiting.
    assert signals.kv_load == pytest.approx(2.0)
    assert replicas_for_load(signals, POLICY, 2) == max(math.ceil(2.0 / 0.7), 3)
    calm = summarize(pod_samples(0.0, 0.7, 2))
    assert replicas_for_load(calm, POLICY, 2) == 1


@pytest.mark.looptime
async def test_burst_panics_up_at_once_and_never_down_while_panicking():
    history = await drive(lambda t: 6.0 if 120 <= t < 300 else 0.5, POLICY, minutes=6, replicas=1)
    assert asyncio.get_running_loop().time() >= 360  # six minutes passed on the loop's clock
    first_panic = next(when for when, d in history if d.reason == "Panic")
    assert 120 <= first_panic <= 130
    assert replicas_at(history, first_panic) == 2  # maxScaleUpRate 2 from one ready pod
    assert replicas_at(history, 240) >= math.ceil(6.0 / 0.7)
    # Replicas never drop while panicking.
    panicking = [d.desired_replicas for _, d in history if d.reason == "Panic"]
    assert panicking == sorted(panicking)


@pytest.mark.looptime
async def test_slow_ramp_follows_the_load_one_step_at_a_time():
    history = await drive(lambda t: 1.0 + t / 120.0, POLICY, minutes=12, replicas=2)
    assert not [d for _, d in history if d.reason == "Panic"]
    counts = [d.desired_replicas for _, d in history]
    assert counts == sorted(counts)
    steps = [b - a for a, b in zip(counts, counts[1:], strict=False) if b != a]
    assert max(steps) <= 2
    final_demand = 1.0 + 715 / 120.0
    assert math.ceil(final_demand / 0.7) - 2 <= counts[-1] <= math.ceil(final_demand / 0.7) + 1


@pytest.mark.looptime
async def test_noise_does_not_flap():
    rng = random.Random(7)
    noise = {}

    def demand(t):
        return noise.setdefault(t, 3.0 * (1 + rng.uniform(-0.15, 0.15)))

    history = await drive(demand, POLICY, minutes=20, replicas=5)
    counts = [d.desired_replicas for when, d in history if when >= 300]
    changes = sum(a != b for a, b in zip(counts, counts[1:], strict=False))
    assert changes <= 2
    assert all(math.ceil(3.0 * 0.85 / 0.7) <= c <= math.ceil(3.0 * 1.15 / 0.7) for c in counts)


@pytest.mark.looptime
async def test_dip_scales_down_only_after_the_stabilization_window():
    history = await drive(lambda t: 4.0 if t < 300 else 1.0, POLICY, minutes=10, replicas=6)
    assert replicas_at(history, 295) == 6
    assert replicas_at(history, 300 + 110) == 6
    down = next(when for when, d in history if when > 300 and d.desired_replicas < 6)
    assert 420 <= down <= 430
    # A replica's capacity was never learned (no saturation), so it probes down one replica
    # per stable window, never back up.
    after = [d.desired_replicas for when, d in history if when >= 300]
    assert after == sorted(after, reverse=True)
    assert replicas_at(history, down + 55) == 5
    assert replicas_at(history, down + 60) == 4


@pytest.mark.looptime
async def test_limits_and_gpu_budget_hold():
    policy = AutoscalingPolicy(
        min_replicas=2,
        max_replicas=5,
        gpu_budget=12,
        stable_window_seconds=60,
        panic_window_seconds=10,
    )
    history = await drive(
        lambda t: 50.0 if t < 300 else 0.0, policy, minutes=15, replicas=2, gpus_per_replica=2
    )
    counts = [d.desired_replicas for _, d in history]
    assert max(counts) == 5 and min(counts) == 2
    assert history[-1][1].reason == "BelowMinimum"
    # A tighter budget than maxReplicas: 3 replicas of 4 GPUs, less what others hold.
    tight = AutoscalingPolicy(min_replicas=1, max_replicas=10, gpu_budget=16)
    history = await drive(
        lambda t: 50.0, tight, minutes=5, replicas=1, gpus_per_replica=4, gpus_used_elsewhere=4
    )
    assert max(d.desired_replicas for _, d in history) == 3
    assert history[-1][1].reason == "GPUBudget"


def test_budget_below_minimum_wins_and_scales_down_an_oversized_fleet():
    policy = AutoscalingPolicy(min_replicas=3, max_replicas=8, gpu_budget=8)
    samples = pod_samples(0.0, 1.0, 6)
    decision = decide(
        samples, policy, FleetState(6, 6, gpus_per_replica=4), AutoscalerMemory(), now=0.0
    )
    assert decision.desired_replicas == 2 and decision.reason == "GPUBudget"


@pytest.mark.looptime
async def test_no_scale_up_while_pods_are_pending():
    # The nodes have room for 3 pods; the load wants 12. Doubling asks for 2, then, once that
    # pod is ready (30 s), 4; the 4th pod cannot be scheduled, so it never asks for more.
    history = await drive(lambda t: 8.0, POLICY, minutes=4, replicas=1, room=3)
    counts = [d.desired_replicas for _, d in history]
    four = counts.index(4)
    assert set(counts[:four]) == {2} and history[four][0] == 30
    assert set(counts[four:]) == {4}
    assert {d.reason for _, d in history[four + 1 :]} == {"PendingPods"}
    assert "1 pods not scheduled yet" in history[-1][1].message


@pytest.mark.looptime
async def test_starting_pods_hold_scale_up_until_they_are_ready():
    history = await drive(lambda t: 8.0, POLICY, minutes=4, replicas=1, startup=90.0)
    # The pod asked for at 0 s loads its weights until 90 s; the one ready pod looks
    # overloaded meanwhile, but asking for more on top of the one coming would overshoot.
    assert [d.desired_replicas for when, d in history if when < 90] == [2] * 18
    assert {d.reason for when, d in history if 0 < when < 90} == {"StartingPods"}
    assert "1 pods still starting (up to 300s)" in history[1][1].message
    # Each step waits for the last one's pods: 4 at 90 s, 8 at 180 s.
    assert (replicas_at(history, 175), replicas_at(history, 180)) == (4, 8)


OVERLOADED = pod_samples(0.0, 8.0, 2)  # 2 ready pods, 8 replicas of KV demand


def test_a_starting_pod_holds_a_scale_up_and_says_for_how_long():
    starting = FleetState(3, 2, starting_replicas=1, startup_seconds=200.0)
    held = decide(OVERLOADED, POLICY, starting, AutoscalerMemory(), now=0.0)
    assert (held.desired_replicas, held.reason) == (3, "StartingPods")
    assert held.message.endswith("; holding at 3: 1 pods still starting (up to 400s)")
    # Without it (none starting, or the one that was has passed the bound): up at once.
    free = decide(OVERLOADED, POLICY, replace(starting, starting_replicas=0), AutoscalerMemory(),
                  now=0.0)  # fmt: skip
    assert free.desired_replicas == 6 and free.reason == "Panic"


def test_an_unschedulable_pod_holds_first_and_neither_holds_a_scale_down():
    both = FleetState(3, 2, pending_replicas=1, starting_replicas=2)
    held = decide(OVERLOADED, POLICY, both, AutoscalerMemory(), now=0.0)
    assert (held.desired_replicas, held.reason) == (3, "PendingPods")
    assert held.message.endswith("; holding at 3: 1 pods not scheduled yet")
    idle = pod_samples(0.0, 0.1, 2)
    memory = AutoscalerMemory(first_decision=-1000.0, replica_tokens_per_second=1000.0)
    down = decide(idle, POLICY, both, memory, now=0.0)
    assert down.desired_replicas < 3 and down.reason == "ScaleDown"


@pytest.mark.looptime
async def test_scale_to_zero_after_idle_then_wake():
    policy = AutoscalingPolicy(min_replicas=0, max_replicas=4, idle_seconds=120)
    history = await drive(lambda t: 1.0 if t < 60 else 0.0, policy, minutes=5, replicas=1)
    zero = next(when for when, d in history if d.desired_replicas == 0)
    assert history[[w for w, _ in history].index(zero)][1].reason == "ScaleToZero"
    assert 175 <= zero <= 190  # last traffic at ~55 s, plus idleSeconds

    memory = history[-1][1].memory
    asleep = decide([], policy, FleetState(0, 0), memory, now=400.0)
    assert (asleep.desired_replicas, asleep.reason) == (0, "Idle")
    stale_wake = FleetState(0, 0, wake_requested_at=10.0)  # older than the scale to zero
    assert decide([], policy, stale_wake, memory, now=400.0).desired_replicas == 0
    woken = decide([], policy, FleetState(0, 0, wake_requested_at=399.0), memory, now=400.0)
    assert (woken.desired_replicas, woken.reason) == (1, "WakeFromZero")
    # Woken pods are not sent back to sleep before they had a chance to serve.
    starting = decide(
        [], policy, FleetState(1, 0, 1, wake_requested_at=399.0), woken.memory, now=450.0
    )
    assert starting.desired_replicas == 1


def test_a_whole_second_wake_stamp_in_the_second_of_the_scale_to_zero_wakes():
    # `date +%s` written 0.3 s after a scale to zero at 400.5 reads 400: it may be the newer.
    policy = AutoscalingPolicy(min_replicas=0, max_replicas=4, idle_seconds=120)
    asleep = AutoscalerMemory(last_active=200.0, last_scale_time=400.5, first_decision=0.0)
    woken = decide([], policy, FleetState(0, 0, wake_requested_at=400.0), asleep, now=401.0)
    assert (woken.desired_replicas, woken.reason) == (1, "WakeFromZero")
    # A stamp a whole second before the scaling is older than it.
    stale = decide([], policy, FleetState(0, 0, wake_requested_at=399.0), asleep, now=401.0)
    assert (stale.desired_replicas, stale.reason) == (0, "Idle")


def test_a_ready_pod_not_scraped_holds_a_scale_down_and_the_scale_to_zero():
    idle = pod_samples(0.0, 0.1, 1)  # the one pod that answered; its busy peer did not
    memory = AutoscalerMemory(first_decision=-1000.0, replica_tokens_per_second=1000.0)
    fleet = FleetState(2, 2, unscraped_replicas=1)
    held = decide(idle, POLICY, fleet, memory, now=0.0)
    assert (held.desired_replicas, held.reason) == (2, "Unscraped")
    assert held.message.endswith("; holding at 2: 1 serving pods not scraped")
    assert decide(idle, POLICY, replace(fleet, unscraped_replicas=0), memory, now=0.0).reason == (
        "ScaleDown"
    )
    policy = AutoscalingPolicy(min_replicas=0, max_replicas=4, idle_seconds=60)
    quiet = pod_samples(0.0, 0.0, 1) + pod_samples(100.0, 0.0, 1)
    asleep = replace(memory, last_active=-500.0)
    one = FleetState(1, 1, unscraped_replicas=1)
    assert decide(quiet, policy, one, asleep, now=100.0).desired_replicas == 1
    assert decide(quiet, policy, replace(one, unscraped_replicas=0), asleep, now=100.0).reason == (
        "ScaleToZero"
    )
    # It never holds a scale-up.
    up = decide(OVERLOADED, POLICY, replace(fleet, unscraped_replicas=1), AutoscalerMemory(), 0.0)
    assert up.desired_replicas > 2


def test_held_requests_size_the_wake_and_keep_it_awake():
    policy = AutoscalingPolicy(min_replicas=0, max_replicas=5, idle_seconds=60)
    asleep = AutoscalerMemory(last_active=0.0, last_scale_time=100.0, first_decision=0.0)
    held = FleetState(0, 0, max_num_seqs=16, wake_requested_at=399.0, held_requests=40)
    woken = decide([], policy, held, asleep, now=400.0)
    assert (woken.desired_replicas, woken.reason) == (3, "WakeFromZero")  # ceil(40 / 16)
    assert woken.message == "wake requested: starting 3 replicas for 40 held requests"
    crowd = decide([], policy, replace(held, held_requests=200), asleep, now=400.0)
    assert (crowd.desired_replicas, crowd.reason) == (5, "AboveMaximum")
    # Pods starting, none ready, and the router now holds more than their slots take.
    more = replace(held, replicas=3, starting_replicas=3, wake_requested_at=405.0, held_requests=70)
    grown = decide([], policy, more, woken.memory, now=406.0)
    assert (grown.desired_replicas, grown.reason) == (5, "HeldRequests")
    # A Pending pod (no GPU for it) holds: more would only wait too.
    pending = decide([], policy, replace(more, pending_replicas=1), woken.memory, now=406.0)
    assert (pending.desired_replicas, pending.reason) == (3, "NoMetrics")
    # A held count that the last scaling already answered (wake older than it) is no demand.
    stale = decide([], policy, replace(more, wake_requested_at=399.0), woken.memory, now=406.0)
    assert stale.desired_replicas == 3
    # Renewed wake requests keep a ready but quiet deployment from going to zero.
    quiet = pod_samples(400.0, 0.0, 1) + pod_samples(480.0, 0.0, 1)
    memory = replace(woken.memory, last_active=300.0)
    renewed = FleetState(1, 1, max_num_seqs=16, wake_requested_at=470.0, held_requests=1)
    assert decide(quiet, policy, renewed, memory, now=480.0).desired_replicas == 1
    gone = replace(renewed, wake_requested_at=399.0, held_requests=0)
    assert decide(quiet, policy, gone, memory, now=480.0).reason == "ScaleToZero"
    # The last renewal is activity at its own time, not for ever after.
    long_ago = replace(renewed, wake_requested_at=410.0, held_requests=0)
    assert decide(quiet, policy, long_ago, memory, now=480.0).reason == "ScaleToZero"


@pytest.mark.looptime
async def test_only_idle_seconds_of_silence_reach_zero():
    policy = AutoscalingPolicy(
        min_replicas=0, max_replicas=4, idle_seconds=600, scale_down_stabilization_seconds=30
    )
    history = await drive(lambda t: 2.0 if t < 60 else 0.0, policy, minutes=12, replicas=3)
    assert replicas_at(history, 600) == 1
    assert history[-1][1].desired_replicas == 0


def test_a_start_longer_than_idle_seconds_still_gets_idle_seconds_once_ready():
    # A new deployment at minReplicas 0 whose model takes 200 s to load: no client could
    # reach it, so those 200 s are not idle time.
    policy = AutoscalingPolicy(min_replicas=0, max_replicas=4, idle_seconds=60)
    memory = AutoscalerMemory()
    for now in range(0, 200, 5):
        loading = decide([], policy, FleetState(1, 0, 0, 1), memory, now=float(now))
        assert (loading.desired_replicas, loading.reason) == (1, "NoMetrics")
        memory = loading.memory
    decisions = {}
    for now in range(200, 300, 5):
        quiet = pod_samples(float(now), 0.0, 1)
        decision = decide(quiet, policy, FleetState(1, 1), memory, now=float(now))
        decisions[now], memory = decision, decision.memory
    assert {d.desired_replicas for t, d in decisions.items() if t < 255} == {1}, decisions
    zero = min(t for t, d in decisions.items() if d.desired_replicas == 0)
    # 195 (the last round without a report) + idleSeconds
    assert zero == 255 and decisions[zero].reason == "ScaleToZero"


def test_minimum_above_zero_never_sleeps():
    policy = AutoscalingPolicy(min_replicas=1, max_replicas=3, idle_seconds=0)
    quiet = pod_samples(0.0, 0.0, 2) + pod_samples(30.0, 0.0, 2)
    memory = AutoscalerMemory(last_active=-1e6, first_decision=-1e6)
    decision = decide(quiet, policy, FleetState(2, 2), memory, 30.0)
    assert decision.desired_replicas == 1


def test_a_restarted_operator_waits_a_window_before_scaling_down():
    policy = AutoscalingPolicy(max_replicas=8, scale_down_stabilization_seconds=300)
    quiet = pod_samples(0.0, 0.5, 6)
    fresh = decide(quiet, policy, FleetState(6, 6), AutoscalerMemory(), 0.0)
    assert fresh.desired_replicas == 6
    later = decide(pod_samples(300.0, 0.5, 6), policy, FleetState(6, 6), fresh.memory, 300.0)
    assert later.desired_replicas == 5  # capacity unknown: probe down by one
    learned = replace(fresh.memory, replica_tokens_per_second=1000.0)
    later = decide(pod_samples(300.0, 0.5, 6), policy, FleetState(6, 6), learned, 300.0)
    assert later.desired_replicas == 3  # halved at most by maxScaleDownRate


def test_capacity_is_learned_when_saturated_and_scales_the_token_load():
    policy = AutoscalingPolicy(max_replicas=20, target_kv_cache_usage=0.5)
    # Two replicas, every slot of 64 taken, 10 waiting: saturated at 3000 tokens/s each.
    saturated = [
        MetricSample(f"p-{i}", t, 0.6, 64, 5, prompt_tokens_total=t * 2000,
                     generation_tokens_total=t * 1000)
        for t in (0.0, 10.0) for i in range(2)
    ]  # fmt: skip
    fleet = FleetState(2, 2, max_num_seqs=64)
    decision = decide(saturated, policy, fleet, AutoscalerMemory(), 10.0)
    assert decision.memory.replica_tokens_per_second == pytest.approx(3000.0)
    # Later 4 replicas carry 9000 tokens/s at half their slots: the token load asks for
    # 9000 / 3000 / 0.5 = 6 replicas even though slots and KV alone would ask for 4.
    busy = [
        MetricSample(f"p-{i}", t, 0.3, 32, 0, prompt_tokens_total=t * 1500,
                     generation_tokens_total=t * 750)
        for t in (100.0, 110.0) for i in range(4)
    ]  # fmt: skip
    signals = summarize(busy)
    assert replicas_for_load(signals, policy, 4, 64) == 4
    assert replicas_for_load(signals, policy, 4, 64, 3000.0) == 6


LONG = dict(per_replica=2)  # each request holds half a replica's KV cache


def long_context_window(now, ready):
    rounds = [pod_samples(t, 1.5 * ready, ready, **LONG) for t in (now - 40, now - 20, now)]
    return [s for r in rounds for s in r]


def test_long_contexts_replan_a_larger_shape_instead_of_replicas():
    policy = AutoscalingPolicy(min_replicas=1, max_replicas=8, gpu_budget=8)
    bigger = Shape(
        tensor_parallel_size=2, gpu_type="nvidia-h100-80gb", kv_cache_capacity_tokens=400_000
    )
    fleet = FleetState(2, 2, gpus_per_replica=1, larger_shape=bigger)
    decision = decide(long_context_window(100.0, 2), policy, fleet, AutoscalerMemory(), 100.0)
    assert decision.reason == "LongContext"
    assert decision.replan == bigger
    assert decision.desired_replicas == 2
    assert "50%" in decision.message
    # Within the cool-down the next decision waits for the rollout instead of replanning again.
    again = decide(long_context_window(110.0, 2), policy, fleet, decision.memory, 110.0)
    assert again.replan is None


def test_long_contexts_with_a_fixed_tensor_parallel_size_add_replicas():
    policy = AutoscalingPolicy(min_replicas=1, max_replicas=8)
    bigger = Shape(2, "nvidia-h100-80gb", 400_000)
    fleet = FleetState(2, 2, tensor_parallel_fixed=True, larger_shape=bigger)
    decision = decide(long_context_window(100.0, 2), policy, fleet, AutoscalerMemory(), 100.0)
    assert decision.replan is None
    assert decision.desired_replicas > 2
    assert "tensorParallelSize is set" in decision.message


def test_many_short_requests_add_replicas_not_shape():
    policy = AutoscalingPolicy(min_replicas=1, max_replicas=8)
    fleet = FleetState(2, 2, larger_shape=Shape(2, "nvidia-h100-80gb", 400_000))
    rounds = [pod_samples(t, 3.0, 2) for t in (60.0, 80.0, 100.0)]
    decision = decide([s for r in rounds for s in r], policy, fleet, AutoscalerMemory(), 100.0)
    assert decision.replan is None and decision.reason in ("ScaleUp", "Panic")
    assert decision.desired_replicas == 4


def test_no_metrics_holds():
    decision = decide([], POLICY, FleetState(3, 0, 3), AutoscalerMemory(), 0.0)
    assert (decision.desired_replicas, decision.reason) == (3, "NoMetrics")


@pytest.mark.parametrize(
    "field, value",
    [
        ("target_kv_cache_usage", 0.0),
        ("max_replicas", 0),
        ("panic_window_seconds", 120.0),
        ("max_scale_up_rate", 1.0),
        ("min_replicas", -1),
    ],
)
def test_policy_rejects_out_of_range(field, value):
    with pytest.raises(ValueError, match=field):
        AutoscalingPolicy(**{field: value})


def test_policy_from_a_parsed_spec_keeps_defaults_for_unset_knobs():
    spec = parse_spec(
        {"autoscaling": {"minReplicas": 0, "maxReplicas": 6, "targetKVCacheUsage": 0.8,
                         "stableWindowSeconds": 120, "gpuBudget": 8}}
    )  # fmt: skip
    policy = AutoscalingPolicy.from_spec(spec.autoscaling)
    assert policy == AutoscalingPolicy(
        min_replicas=0, max_replicas=6, target_kv_cache_usage=0.8, stable_window_seconds=120,
        gpu_budget=8,
    )  # fmt: skip
    assert policy.scale_down_stabilization_seconds == 300.0


def recurring_bursts(t):
    """6 replicas of KV for 60 s every 5 minutes from 240 s, 1 otherwise (the bursty trace)."""
    return 6.0 if t >= 240 and (t - 240) % 300 < 60 else 1.0


BURST_REPLICAS = math.ceil(6.0 / 0.7)
STARTUP = dict(tick=15.0, startup=120.0, startup_seconds=120.0)
# A replica's capacity known (no probing down), and far above the toy's token counters: the
# toy's load is KV-cache load only.
LEARNED = AutoscalerMemory(replica_tokens_per_second=1e12)


async def drive_bursts(demand, minutes):
    """``drive`` from 2 replicas with a pod start-up of 120 s, up to 20 replicas: the
    decisions, and the times of those the forecast made (``PredictedBurst``)."""
    policy = AutoscalingPolicy(max_replicas=20)
    history = await drive(demand, policy, minutes=minutes, replicas=2, memory=LEARNED, **STARTUP)
    return history, [when for when, d in history if d.reason == "PredictedBurst"]


@pytest.mark.looptime
async def test_recurring_bursts_get_their_replicas_one_startup_time_ahead():
    history, predicted = await drive_bursts(recurring_bursts, minutes=30)
    # Two bursts (240 s, 540 s) teach the period; from the third on, pods are asked for a
    # start-up time (plus a tick) ahead, so they are ready when the burst comes. (The forecast
    # grows over two ticks; the pods of its first step, still starting, do not hold the next.)
    assert predicted and 600 <= predicted[0] < 840 - 120
    for burst in (1140, 1440, 1740):
        asked = [when for when in predicted if burst - 150 <= when <= burst - 120]
        assert asked, f"no pre-scale for the burst at {burst} s: {predicted}"
        assert replicas_at(history, burst - 120) >= BURST_REPLICAS
        # After the previous burst the fleet went back down instead of holding a period.
        assert replicas_at(history, burst - 160) <= 3
    message = next(d.message for when, d in history if d.reason == "PredictedBurst")
    assert "predicted recurring burst in" in message and "(period 300s)" in message


def changing_bursts(t):
    """The bursts of ``recurring_bursts`` up to the one at 1740 s, then every 420 s."""
    return recurring_bursts(t) if t < 1800 else 6.0 if (t - 1740) % 420 < 60 else 1.0


@pytest.mark.looptime
async def test_a_changed_period_is_learned_again_from_two_new_bursts():
    history, predicted = await drive_bursts(changing_bursts, minutes=60)
    # The old period's last forecast burst (2040 s) does not come; then no forecast until
    # the new bursts (2160, 2580, 3000 s, ...) show their period (before the check, the old
    # period forecast 2460 s and 2880 s too, and took 46 minutes to find 420 s).
    assert [when for when in predicted if 1905 < when < 2550] == []
    period = [when for when, d in history if "(period 420s)" in d.message]
    assert period[0] == 2550  # too late for pods to be ready by the burst at 2580 s
    # The third new burst is the first one pre-scaled a start-up time ahead.
    assert [when for when in predicted if 2580 < when <= 3000 - 120][0] == 2850
    # ... with what the unserved burst at 2580 s was measured to need (2 pods, full, with a
    # queue: 8); the burst at 3420 s, with what the served one at 3000 s needed.
    assert replicas_at(history, 3000 - 120) == 8
    assert replicas_at(history, 3420 - 120) == BURST_REPLICAS
    assert history[-1][1].memory.forecast.since == 1680


@pytest.mark.looptime
async def test_predicted_bursts_stay_within_max_replicas_and_the_gpu_budget():
    capped = AutoscalingPolicy(max_replicas=6)
    history = await drive(
        recurring_bursts, capped, minutes=20, replicas=2, memory=LEARNED, **STARTUP
    )
    assert any(d.reason == "PredictedBurst" for _, d in history)
    assert max(d.desired_replicas for _, d in history) == 6
    budget = AutoscalingPolicy(max_replicas=20, gpu_budget=10)
    history = await drive(
        recurring_bursts, budget, minutes=20, replicas=2, memory=LEARNED,
        gpus_per_replica=2, **STARTUP,
    )  # fmt: skip
    assert max(d.desired_replicas for _, d in history) == 5
    assert {d.reason for _, d in history} >= {"GPUBudget"}


def in_a_predicted_burst(kv, policy, *, history=True):
    """One decision at 870 s, in the third of bursts of 10 replicas (2 between, every 300 s
    from 240 s), with 10 replicas ready (pre-scaled by the forecast) and ``kv`` replicas of
    KV load over the last minute; pods take 120 s to start."""
    demand = DemandHistory()
    for t in range(0, 870, 15) if history else ():
        demand = demand.record(t, 10.0 if t >= 240 and (t - 240) % 300 < 60 else 2.0)
    memory = replace(LEARNED, demand=demand)
    window = [s for t in range(810, 871, 5) for s in pod_samples(float(t), kv, 10)]
    fleet = FleetState(replicas=10, ready_replicas=10, startup_seconds=120.0)
    return decide(window, policy, fleet, memory, 870.0)


def test_a_scale_up_for_a_predicted_burst_that_ends_first_is_held():
    policy = AutoscalingPolicy(max_replicas=20)
    # 9 replicas of KV in 10 pods asks for ceil(9 / 0.7) = 13; 13 <= 10 x 1.25 + 1 is the
    # forecast burst, over before pods asked for now are ready: hold at 10.
    decision = in_a_predicted_burst(9.0, policy)
    assert (decision.desired_replicas, decision.reason) == (10, "BurstEndsFirst")
    assert decision.message.endswith(
        "holding at 10: the predicted burst ends before new pods are ready (in 120s)"
    )
    # Without a period, or with predictiveScaling off, the same load scales up.
    for plain in (
        in_a_predicted_burst(9.0, policy, history=False),
        in_a_predicted_burst(9.0, replace(policy, predictive_scaling=False)),
    ):
        assert (plain.desired_replicas, plain.reason) == (13, "ScaleUp")


def test_a_surge_above_the_forecast_is_served_within_the_limits():
    # 15 replicas of KV (10 in the caches, 50 requests waiting) ask for 19 > 13.5: not the
    # forecast burst, so it scales up as without a forecast, within maxReplicas and the budget.
    decision = in_a_predicted_burst(15.0, AutoscalingPolicy(max_replicas=20))
    assert (decision.desired_replicas, decision.reason) == (19, "ScaleUp")
    decision = in_a_predicted_burst(15.0, AutoscalingPolicy(max_replicas=16))
    assert (decision.desired_replicas, decision.reason) == (16, "AboveMaximum")
    decision = in_a_predicted_burst(15.0, AutoscalingPolicy(max_replicas=20, gpu_budget=12))
    assert (decision.desired_replicas, decision.reason) == (12, "GPUBudget")


NOISE = random.Random(11)
NOISE_AT: dict[float, float] = {}


def noisy(t):
    """3 replicas of KV +-15%, the same value at the same time in every run."""
    return NOISE_AT.setdefault(t, 3.0 * (1 + NOISE.uniform(-0.15, 0.15)))


@pytest.mark.looptime
@pytest.mark.parametrize(
    "demand",
    [noisy, lambda t: 1.0 + t / 120.0, lambda t: 4.0 if t < 300 else 1.0],
    ids=["noise", "ramp", "dip"],
)
async def test_without_recurring_bursts_nothing_changes(demand):
    on = await drive(demand, POLICY, minutes=20, replicas=3, memory=LEARNED, **STARTUP)
    off = await drive(
        demand, replace(POLICY, predictive_scaling=False), minutes=20, replicas=3,
        memory=LEARNED, **STARTUP,
    )  # fmt: skip
    assert [(w, d.desired_replicas, d.reason, d.message) for w, d in on] == [
        (w, d.desired_replicas, d.reason, d.message) for w, d in off
    ]


def test_predictive_scaling_is_a_spec_knob_on_by_default():
    spec = parse_spec({"autoscaling": {"maxReplicas": 4}})
    assert AutoscalingPolicy.from_spec(spec.autoscaling).predictive_scaling is True
    spec = parse_spec({"autoscaling": {"maxReplicas": 4, "predictiveScaling": False}})
    assert AutoscalingPolicy.from_spec(spec.autoscaling).predictive_scaling is False


# ---- the rules one at a time (decide() applies them in autoscaler.RULES' order) ----


def rule_moment(replicas=4, **fleet):
    from kvpilot.operator import autoscaler

    policy = AutoscalingPolicy(min_replicas=0, max_replicas=16, idle_seconds=60.0)
    return autoscaler._Moment(
        policy=policy,
        fleet=FleetState(replicas=replicas, ready_replicas=replicas, **fleet),
        now=1000.0,
        woken=False,
        last_active=990.0,
        first_decision=0.0,
    )


def verdict(desired, reason="ScaleUp", message="m"):
    from kvpilot.operator import autoscaler

    return autoscaler._Verdict(desired, reason, message, AutoscalerMemory())


def test_the_rules_are_applied_in_the_documented_order():
    from kvpilot.operator import autoscaler

    assert [rule.__name__ for rule in autoscaler.RULES] == [
        "_rate_limits", "_burst_ends_first", "_predicted_burst", "_keep_one",
        "_hold_for_pods", "_scale_to_zero", "_long_context", "_hold_for_unscraped",
    ]  # fmt: skip


def test_rate_limits_alone():
    from kvpilot.operator.autoscaler import _rate_limits

    moment = rule_moment(replicas=4)
    assert _rate_limits(moment, verdict(100)).desired == 8  # maxScaleUpRate 2x
    assert "limited to 8 by maxScaleUpRate" in _rate_limits(moment, verdict(100)).message
    assert _rate_limits(moment, verdict(0)).desired == 2  # maxScaleDownRate 2x
    assert _rate_limits(moment, verdict(5)) == verdict(5)


def test_hold_for_pods_alone():
    from kvpilot.operator.autoscaler import _hold_for_pods

    pending = rule_moment(replicas=4, pending_replicas=1)
    held = _hold_for_pods(pending, verdict(6))
    assert (held.desired, held.reason) == (4, "PendingPods")
    starting = rule_moment(replicas=4, starting_replicas=2)
    assert _hold_for_pods(starting, verdict(6)).reason == "StartingPods"
    assert _hold_for_pods(starting, verdict(3)) == verdict(3)  # scale-downs are not held
    assert _hold_for_pods(rule_moment(), verdict(6)) == verdict(6)


def test_scale_to_zero_and_keep_one_alone():
    from kvpilot.operator.autoscaler import _keep_one, _scale_to_zero

    assert _keep_one(rule_moment(), verdict(0)).desired == 1
    idle = replace(rule_moment(), last_active=900.0)  # 100 s without traffic, idleSeconds 60
    zero = _scale_to_zero(idle, verdict(1))
    assert (zero.desired, zero.reason) == (0, "ScaleToZero")
    assert _scale_to_zero(rule_moment(), verdict(1)) == verdict(1)  # active 10 s ago
    # A wake request counts as activity at its time (``_activity`` folds it into
    # ``last_active``), not as a flag that keeps the deployment awake after it.
    assert _scale_to_zero(replace(idle, woken=True), verdict(1)).desired == 0
