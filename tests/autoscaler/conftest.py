"""Engine metrics as a real prometheus_client registry renders them, for the autoscaler tests."""

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def render_exposition(
    *,
    models=("llama",),
    kv=0.5,
    running=3,
    waiting=1,
    preemptions=0,
    ttft=(),
    capacity=None,
    concurrency=None,
    success=0,
):
    """Metrics text as a real engine's prometheus_client registry serves it."""
    registry = CollectorRegistry()
    gauges = {
        "vllm:kv_cache_usage_perc": kv,
        "vllm:num_requests_running": running,
        "vllm:num_requests_waiting": waiting,
    }
    if capacity is not None:
        gauges["kvpilot:kv_cache_capacity_tokens"] = capacity
    if concurrency is not None:
        gauges["kvpilot:max_concurrency"] = concurrency
    for name, value in gauges.items():
        gauge = Gauge(name, name, ["model_name"], registry=registry)
        for model in models:
            gauge.labels(model).set(value)
    counters = {"vllm:num_preemptions": preemptions, "vllm:request_success": success}
    for name, value in counters.items():
        counter = Counter(name, name, ["model_name"], registry=registry)
        for model in models:
            counter.labels(model).inc(value)
    histogram = Histogram(
        "vllm:time_to_first_token_seconds",
        "ttft",
        ["model_name"],
        buckets=TTFT_BUCKETS,
        registry=registry,
    )
    for model in models:
        for seconds in ttft:
            histogram.labels(model).observe(seconds)
    return generate_latest(registry).decode()


@pytest.fixture
def exposition():
    """``exposition(kv=..., running=..., ...)`` -> a /metrics body with the engine's names."""
    return render_exposition
