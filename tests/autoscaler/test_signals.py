"""Parsing real Prometheus text and folding windows into signals."""

import math

import pytest

from kvpilot.operator.signals import (
    MetricSample,
    MetricsParseError,
    histogram_quantile,
    parse_metrics,
    summarize,
)


def test_parse_reads_every_signal_back(exposition):
    text = exposition(
        kv=0.83,
        running=7,
        waiting=4,
        preemptions=5,
        ttft=(0.07, 0.3, 0.3, 3.0),
        capacity=131072,
        concurrency=16,
        success=12,
    )
    sample = parse_metrics(text, pod="p-0", timestamp=10.0)
    assert sample.pod == "p-0" and sample.timestamp == 10.0
    assert sample.kv_cache_usage == pytest.approx(0.83)
    assert (sample.num_requests_running, sample.num_requests_waiting) == (7, 4)
    assert sample.num_preemptions_total == 5
    assert sample.request_success_total == 12
    assert sample.kv_cache_capacity_tokens == 131072
    assert sample.max_concurrency == 16
    assert sample.ttft_buckets == (
        (0.05, 0),
        (0.1, 1),
        (0.25, 1),
        (0.5, 3),
        (1.0, 3),
        (2.5, 3),
        (5.0, 4),
        (math.inf, 4),
    )


def test_parse_sums_model_names_but_not_kv_usage(exposition):
    text = exposition(models=("base", "lora-a"), kv=0.4, running=2, waiting=1, preemptions=3)
    sample = parse_metrics(text, pod="p", timestamp=0.0)
    assert sample.kv_cache_usage == pytest.approx(0.4)
    assert (sample.num_requests_running, sample.num_requests_waiting) == (4, 2)
    assert sample.num_preemptions_total == 6
    assert sample.kv_cache_capacity_tokens is None


def test_parse_names_missing_metrics():
    text = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n"
    with pytest.raises(MetricsParseError, match="kv_cache_usage_perc, vllm:num_requests_waiting"):
        parse_metrics(text, pod="p-1", timestamp=0.0)


def test_parse_rejects_garbage():
    with pytest.raises(MetricsParseError, match="pod p-2"):
        parse_metrics("<html>502 Bad Gateway</html>", pod="p-2", timestamp=0.0)


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = [(0.1, 0), (0.5, 10), (1.0, 20), (math.inf, 20)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.5)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.75)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.3)
    # Observations above the last finite bound: the bound is the best answer there is.
    assert histogram_quantile(0.99, [(1.0, 5), (math.inf, 10)]) == 1.0
    assert histogram_quantile(0.5, [(1.0, 0), (math.inf, 0)]) is None
    with pytest.raises(ValueError, match="quantile"):
        histogram_quantile(1.5, buckets)
    with pytest.raises(ValueError, match="Inf"):
        histogram_quantile(0.5, [(1.0, 3)])


@pytest.fixture
def at(exposition):
    """``at(pod, t, **values)`` -> the sample a scrape of that engine at ``t`` gives."""
    return lambda pod, t, **values: parse_metrics(exposition(**values), pod=pod, timestamp=t)


def test_summarize_rates_and_resets(at):
    samples = [
        at("a", 0.0, kv=0.2, running=2, waiting=0, preemptions=10, success=100),
        at("b", 0.0, kv=0.6, running=4, waiting=2, preemptions=0, success=0),
        at("a", 10.0, kv=0.4, running=2, waiting=0, preemptions=14, success=120),
        # b restarted: its counter starts again from 0, so the 3 it shows are all new.
        at("b", 10.0, kv=0.8, running=6, waiting=4, preemptions=3, success=5),
    ]
    signals = summarize(samples)
    assert signals.window_seconds == 10.0 and signals.num_rounds == 2 and signals.num_pods == 2
    assert signals.kv_load == pytest.approx((0.8 + 1.2) / 2)
    assert signals.kv_cache_usage == pytest.approx((0.4 + 0.6) / 2)
    assert signals.num_requests_running == pytest.approx(7.0)
    assert signals.num_requests_waiting == pytest.approx(3.0)
    assert signals.preemptions_per_second == pytest.approx((4 + 3) / 10)
    assert signals.requests_per_second == pytest.approx((20 + 5) / 10)
    assert signals.kv_share_per_request == pytest.approx(1.0 / 7.0)
    assert summarize(samples, start=5.0).num_rounds == 1
    assert summarize(samples, start=11.0) is None


def test_summarize_ttft_counts_only_the_window(at):
    slow_history = (4.0,) * 50
    samples = [
        at("a", 0.0, ttft=slow_history),
        at("a", 30.0, ttft=slow_history + (0.07,) * 9 + (0.3,)),
    ]
    signals = summarize(samples)
    # 50 slow requests happened before the window: only the 10 fast ones count.
    assert signals.ttft_seconds[0.5] == pytest.approx(0.05 + 0.05 * (5 / 9))
    assert signals.ttft_seconds[0.99] == pytest.approx(0.25 + 0.25 * (0.9 / 1))
    assert summarize(samples[:1]).ttft_seconds == {}


def test_idle_window_is_not_active():
    quiet = [MetricSample("a", 0.0, 0.0, 0, 0), MetricSample("a", 5.0, 0.0, 0, 0)]
    assert not summarize(quiet).active
    busy = [
        MetricSample("a", 0.0, 0.0, 0, 0, request_success_total=1),
        MetricSample("a", 5.0, 0.0, 0, 0, request_success_total=2),
    ]
    assert summarize(busy).active
