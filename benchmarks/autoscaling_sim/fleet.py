"""A fleet of simulated replicas behind a router, scaled by a policy, replaying one trace.

Events in time order: request arrivals (routed to the ready replica with the fewest running +
waiting requests, Envoy's ``LEAST_REQUEST``; held at the router while no replica is ready),
replicas becoming ready ``startup_seconds`` after they were asked for, and the policy's ticks.
At a tick the policy sees what a scraper would (per ready replica: KV usage, queue lengths,
counters) and returns the replicas it wants; extra replicas start, surplus ones stop taking
requests and leave once drained (SIGTERM with a grace period), not-yet-ready ones first.

Replica-hours count every replica from the moment it is asked for (its GPU is held while it
starts) until it has drained, over the trace's duration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from replica import Replica, ReplicaModel
from traces import Request


@dataclass(frozen=True)
class PodView:
    """One ready replica as a metrics scrape shows it (counters since start)."""

    name: str
    kv_cache_usage: float
    num_requests_running: int
    num_requests_waiting: int
    num_preemptions_total: int
    request_success_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    busy_seconds_total: float


@dataclass(frozen=True)
class FleetView:
    """What a policy sees at a tick."""

    time: float
    replicas: int  # asked for, not draining
    starting: int
    pods: list[PodView]


class Policy(Protocol):
    name: str
    interval: float

    def decide(self, view: FleetView) -> int: ...


@dataclass
class _Member:
    name: str
    replica: Replica
    ready_at: float
    draining: bool = False
    gone_at: float | None = None


@dataclass
class Result:
    """What one policy did on one trace."""

    policy: str
    trace: str
    requests: list[Request]
    replica_seconds: float
    peak_replicas: int
    timeline: list[tuple[float, int]] = field(default_factory=list)

    def slo_attainment(self, slo_seconds: float) -> float:
        met = sum(1 for r in self.requests if r.ttft is not None and r.ttft <= slo_seconds)
        return met / len(self.requests)

    def ttft_quantile(self, q: float) -> float:
        values = sorted(r.ttft if r.ttft is not None else math.inf for r in self.requests)
        return values[min(len(values) - 1, int(q * len(values)))]

    @property
    def replica_hours(self) -> float:
        return self.replica_seconds / 3600


def simulate(
    trace_name: str,
    requests: list[Request],
    policy: Policy,
    model: ReplicaModel,
    *,
    duration: float,
    initial_replicas: int = 1,
    drain_seconds: float = 600.0,
) -> Result:
    """Replay ``requests`` (sorted by arrival) against a fleet scaled by ``policy``.

    Args:
        trace_name: for the result.
        requests: the trace; their ``first_token`` and ``finished`` are filled in.
        policy: the autoscaler under test.
        model: every replica's capacity and speed.
        duration: seconds of the trace; replica-hours are counted over it.
        initial_replicas: ready at time 0.
        drain_seconds: after the trace, how long requests still in flight may finish.
    """
    members: list[_Member] = []
    counter = 0

    def start(now: float, ready_at: float) -> None:
        nonlocal counter
        replica = Replica(model, time=now)
        members.append(_Member(f"pod-{counter}", replica, ready_at))
        counter += 1

    for _ in range(initial_replicas):
        start(0.0, 0.0)
    held: list[Request] = []
    next_tick = policy.interval
    replica_seconds, last_time, peak = 0.0, 0.0, initial_replicas
    timeline = [(0.0, initial_replicas)]
    index = 0
    end = duration + drain_seconds

    def alive(now: float) -> list[_Member]:
        return [m for m in members if m.gone_at is None]

    def ready(now: float) -> list[_Member]:
        return [m for m in alive(now) if not m.draining and m.ready_at <= now]

    def route(request: Request, now: float) -> None:
        candidates = ready(now)
        if not candidates:
            held.append(request)
            return
        target = min(candidates, key=lambda m: m.replica.num_running + m.replica.num_waiting)
        target.replica.add(request)

    now = 0.0
    while now < end:
        arrival = requests[index].arrival if index < len(requests) else math.inf
        pending_ready = [m.ready_at for m in alive(now) if m.ready_at > now]
        now = min(arrival, next_tick, min(pending_ready, default=math.inf), end)
        for member in alive(now):
            member.replica.advance(now)
        span_end = min(now, duration)
        if span_end > last_time:
            replica_seconds += len(alive(now)) * (span_end - last_time)
            last_time = span_end
        for member in alive(now):
            if member.draining and member.replica.idle:
                member.gone_at = now
        if held and ready(now):
            waiting, held = held, []
            for request in waiting:
                route(request, now)
        if arrival == now:
            route(requests[index], now)
            index += 1
        if next_tick == now:
            next_tick += policy.interval
            if now <= duration:
                _apply(policy, alive(now), now, model, start)
                count = len([m for m in alive(now) if not m.draining])
                peak = max(peak, count)
                timeline.append((now, count))
        if (
            index >= len(requests)
            and now > duration
            and all(m.replica.idle for m in alive(now))
            and not held
        ):
            break
    return Result(policy.name, trace_name, requests, replica_seconds, peak, timeline)


def _apply(policy: Policy, alive: list[_Member], now: float, model: ReplicaModel, start) -> None:
    serving = [m for m in alive if not m.draining]
    pods = [
        PodView(
            m.name,
            m.replica.kv_usage,
            m.replica.num_running,
            m.replica.num_waiting,
            m.replica.preemptions,
            m.replica.finished,
            m.replica.prompt_tokens,
            m.replica.generated_tokens,
            m.replica.busy_seconds,
        )
        for m in serving
        if m.ready_at <= now
    ]
    starting = sum(1 for m in serving if m.ready_at > now)
    desired = policy.decide(FleetView(now, len(serving), starting, pods))
    if desired > len(serving):
        for _ in range(desired - len(serving)):
            start(now, now + model.startup_seconds)
    elif desired < len(serving):
        # Not-yet-ready replicas go first, then the least loaded ones.
        order = sorted(
            serving,
            key=lambda m: (m.ready_at <= now, m.replica.num_running + m.replica.num_waiting),
        )
        for member in order[: len(serving) - desired]:
            member.draining = True
            if member.ready_at > now:
                member.gone_at = now
