"""The autoscaling policies compared: kvpilot's and four baselines, re-implemented from their
published algorithms and defaults (docs/benchmarks.md lists the sources and settings).

Each policy is called every ``interval`` seconds with a :class:`~fleet.FleetView` and returns
the replicas it wants; minimum and maximum replicas are the same for all.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from fleet import FleetView, PodView

from kvpilot.operator.autoscaler import (
    AutoscalerMemory,
    AutoscalingPolicy,
    FleetState,
    decide,
)
from kvpilot.operator.signals import MetricSample


class Kvpilot:
    """kvpilot's decision function (``kvpilot.operator.autoscaler.decide``), fed the samples
    its scraper would read, every ``interval`` seconds."""

    def __init__(
        self,
        policy: AutoscalingPolicy,
        max_num_seqs: int,
        startup_seconds: float,
        *,
        interval: float = 15.0,
        replica_tokens_per_second: float | None = None,
        name: str = "kvpilot",
    ) -> None:
        self.name = name
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.startup_seconds = startup_seconds
        self.interval = interval
        self.samples: list[MetricSample] = []
        self.memory = AutoscalerMemory(replica_tokens_per_second=replica_tokens_per_second)

    def decide(self, view: FleetView) -> int:
        self.samples += [
            MetricSample(
                pod.name,
                view.time,
                pod.kv_cache_usage,
                pod.num_requests_running,
                pod.num_requests_waiting,
                num_preemptions_total=pod.num_preemptions_total,
                request_success_total=pod.request_success_total,
                prompt_tokens_total=pod.prompt_tokens_total,
                generation_tokens_total=pod.generation_tokens_total,
            )
            for pod in view.pods
        ]
        horizon = view.time - self.policy.stable_window_seconds
        self.samples = [s for s in self.samples if s.timestamp >= horizon]
        # The fleet state the operator computes from its pods: every simulated pod is placed
        # at once (none unschedulable), and each is Ready exactly ``startup_seconds`` after it
        # was asked for, well within the bound after which a starting pod stops counting.
        fleet = FleetState(
            replicas=view.replicas,
            ready_replicas=len(view.pods),
            pending_replicas=0,
            starting_replicas=view.starting,
            tensor_parallel_fixed=True,
            max_num_seqs=self.max_num_seqs,
            startup_seconds=self.startup_seconds,
        )
        decision = decide(self.samples, self.policy, fleet, self.memory, view.time)
        self.memory = decision.memory
        return decision.desired_replicas


@dataclass
class _HpaBehavior:
    """The HPA controller's default ``behavior`` (autoscaling/v2): scale-down stabilization
    300 s; scale-up at most max(100%, 4 pods) per 15 s; no scale-up stabilization; a 10%
    tolerance around the target."""

    min_replicas: int
    max_replicas: int
    down_window: float = 300.0
    tolerance: float = 0.1
    history: deque[tuple[float, int]] = field(default_factory=deque)

    def recommend(self, now: float, current: int, ratio: float) -> int:
        raw = current if abs(ratio - 1.0) <= self.tolerance else math.ceil(current * ratio)
        raw = max(self.min_replicas, min(self.max_replicas, raw))
        self.history.append((now, raw))
        while self.history and self.history[0][0] < now - self.down_window:
            self.history.popleft()
        desired = raw
        if raw < current:
            desired = min(current, max(r for _, r in self.history))
        return min(desired, max(2 * current, current + 4), self.max_replicas)


class HpaCpu:
    """Kubernetes HPA on CPU utilization (target 80% of a 1-CPU request), sync every 15 s.

    The engine's host process is busy whenever its loop has work, so a pod's CPU utilization is
    modelled as 10% idle overhead plus 90% of the fraction of the period its engine was
    stepping. Replicas not ready count as 0% on scale-up, as the HPA does.
    """

    name = "hpa-cpu"
    interval = 15.0

    def __init__(self, min_replicas: int, max_replicas: int, target: float = 0.8) -> None:
        self.target = target
        self.behavior = _HpaBehavior(min_replicas, max_replicas)
        self.busy: dict[str, float] = {}

    def decide(self, view: FleetView) -> int:
        total = 0.0
        for pod in view.pods:
            busy = pod.busy_seconds_total - self.busy.get(pod.name, pod.busy_seconds_total)
            self.busy[pod.name] = pod.busy_seconds_total
            total += 0.1 + 0.9 * min(1.0, busy / self.interval)
        utilization = total / max(view.replicas, 1)
        return self.behavior.recommend(view.time, view.replicas, utilization / self.target)


class KedaWaiting:
    """KEDA's Prometheus scaler on ``sum(vllm:num_requests_waiting)`` with threshold 5 (the
    vLLM production-stack's default), an ``AverageValue`` target: the HPA it drives wants
    ``ceil(total / 5)`` replicas; polling every 15 s; HPA default behavior."""

    name = "keda-waiting>5"
    interval = 15.0

    def __init__(self, min_replicas: int, max_replicas: int, threshold: float = 5.0) -> None:
        self.threshold = threshold
        self.behavior = _HpaBehavior(min_replicas, max_replicas)

    def decide(self, view: FleetView) -> int:
        waiting = sum(pod.num_requests_waiting for pod in view.pods)
        per_replica = waiting / max(view.replicas, 1)
        return self.behavior.recommend(view.time, view.replicas, per_replica / self.threshold)


class KubeAI:
    """KubeAI's model autoscaler: every 10 s, the in-flight requests of the model (its load
    balancer's count) go into a simple moving average over ``timeWindow`` (10 min: 60
    samples); desired = ceil(average / targetRequests) with targetRequests 100; a scale-down
    happens only after ``scaleDownDelaySeconds`` (30 s) of consecutive scale-down answers."""

    name = "kubeai"
    interval = 10.0

    def __init__(
        self,
        min_replicas: int,
        max_replicas: int,
        target_requests: float = 100.0,
        time_window: float = 600.0,
        scale_down_delay: float = 30.0,
    ) -> None:
        self.min_replicas, self.max_replicas = min_replicas, max_replicas
        self.target = target_requests
        self.window: deque[float] = deque(maxlen=int(time_window / self.interval))
        self.required_downs = math.ceil(scale_down_delay / self.interval)
        self.downs = 0

    def decide(self, view: FleetView) -> int:
        in_flight = sum(p.num_requests_running + p.num_requests_waiting for p in view.pods)
        self.window.append(in_flight)
        desired = math.ceil(sum(self.window) / len(self.window) / self.target)
        desired = max(self.min_replicas, min(self.max_replicas, desired))
        if desired < view.replicas:
            self.downs += 1
            if self.downs < self.required_downs:
                return view.replicas
        self.downs = 0
        return desired


class AibrixKpa:
    """AIBrix's KPA (Knative's algorithm) as AIBrix's own KPA example configures it: per-pod
    ``gpu_cache_usage_perc`` with ``targetValue`` 0.3 and the
    ``kpa.autoscaling.aibrix.ai/scale-down-delay`` annotation at 5 minutes; AIBrix's KPA
    windows (stable 180 s, panic 60 s), panic threshold 200%, max scale-up rate 1000, max
    scale-down rate 2, ticking every 15 s. A scale-down happens only once every recommendation
    of the last ``scale_down_delay`` seconds was at most the new size."""

    name = "aibrix-kpa"
    interval = 15.0

    def __init__(
        self,
        min_replicas: int,
        max_replicas: int,
        target: float = 0.3,
        stable_window: float = 180.0,
        panic_window: float = 60.0,
        scale_down_delay: float = 300.0,
    ) -> None:
        self.min_replicas, self.max_replicas = min_replicas, max_replicas
        self.target = target
        self.stable_window, self.panic_window = stable_window, panic_window
        self.scale_down_delay = scale_down_delay
        self.points: deque[tuple[float, float]] = deque()
        self.recommendations: deque[tuple[float, int]] = deque()
        self.panic_since: float | None = None
        self.max_panic = 0

    def _average(self, now: float, window: float) -> float:
        values = [total for t, total in self.points if t >= now - window]
        return sum(values) / len(values)

    def decide(self, view: FleetView) -> int:
        pods: list[PodView] = view.pods
        self.points.append((view.time, sum(p.kv_cache_usage for p in pods)))
        while self.points[0][0] < view.time - self.stable_window:
            self.points.popleft()
        ready = max(len(pods), 1)
        up_limit, down_limit = math.ceil(1000 * ready), math.floor(ready / 2)
        stable = math.ceil(self._average(view.time, self.stable_window) / self.target)
        panic = math.ceil(self._average(view.time, self.panic_window) / self.target)
        stable = max(down_limit, min(up_limit, stable))
        panic = max(down_limit, min(up_limit, panic))
        if panic / ready >= 2.0:
            if self.panic_since is None:
                self.max_panic = view.replicas
            self.panic_since = view.time
        elif self.panic_since is not None and view.time - self.panic_since >= self.stable_window:
            self.panic_since = None
        if self.panic_since is not None:
            self.max_panic = max(self.max_panic, panic)
            desired = self.max_panic
        else:
            desired = stable
        desired = max(self.min_replicas, min(self.max_replicas, desired))
        # Scale-down delay: the largest recommendation of the delay window wins.
        self.recommendations.append((view.time, desired))
        while self.recommendations[0][0] < view.time - self.scale_down_delay:
            self.recommendations.popleft()
        if desired < view.replicas:
            desired = min(view.replicas, max(r for _, r in self.recommendations))
        return desired
