"""PrometheusStatLogger: values computed by hand from request timestamps, read back as text."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.metrics import PrometheusStatLogger, token_buckets
from kvpilot.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpilot.engine.stats import EngineStats

MODEL = "m"


def stats(**overrides) -> EngineStats:
    values = dict(
        num_running_reqs=2, num_waiting_reqs=3, kv_cache_usage=0.25, num_total_blocks=100,
        num_free_blocks=75, kv_capacity_tokens=1600, max_concurrency=3.125,
        num_preemptions_total=4, prefix_cache_queries_total=50, prefix_cache_hits_total=20,
        prompt_tokens_total=70, generation_tokens_total=30,
    )  # fmt: skip
    return EngineStats(**{**values, **overrides})


def output(request_id, tokens, finish_reason=None, n=1, **times) -> RequestOutput:
    seqs = [
        CompletionOutput(
            index=i, text="", token_ids=list(range(tokens)), finish_reason=finish_reason
        )
        for i in range(n)
    ]
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[1, 2, 3, 4, 5],
        outputs=seqs,
        finished=finish_reason is not None,
        metrics=RequestMetrics(**times),
    )


def read(registry: CollectorRegistry) -> dict:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("model_name", MODEL) == MODEL
    }


@pytest.fixture
def logger_and_registry():
    registry = CollectorRegistry()
    cache = {"block_size": 16, "num_gpu_blocks": 100, "enable_prefix_caching": True}
    return PrometheusStatLogger(MODEL, registry, 2048, cache), registry


def test_engine_stats_become_vllm_gauges_and_counters(logger_and_registry):
    logger, registry = logger_and_registry
    logger.record_stats(stats())
    values = read(registry)
    info = (("block_size", "16"), ("enable_prefix_caching", "True"), ("num_gpu_blocks", "100"))
    expected = {
        ("vllm:num_requests_running", ()): 2,
        ("vllm:num_requests_waiting", ()): 3,
        ("vllm:kv_cache_usage_perc", ()): 0.25,
        ("vllm:num_preemptions_total", ()): 4,
        ("vllm:prefix_cache_queries_total", ()): 50,
        ("vllm:prefix_cache_hits_total", ()): 20,
        ("vllm:prompt_tokens_total", ()): 70,
        ("vllm:generation_tokens_total", ()): 30,
        ("kvpilot:kv_cache_total_blocks", ()): 100,
        ("kvpilot:kv_cache_free_blocks", ()): 75,
        ("kvpilot:kv_cache_capacity_tokens", ()): 1600,
        ("kvpilot:max_concurrency", ()): 3.125,
        ("vllm:cache_config_info", info): 1,
    }
    assert {key: values[key] for key in expected} == expected
    # Totals are the engine's own: a new snapshot replaces, never adds.
    logger.record_stats(stats(prompt_tokens_total=71))
    assert read(registry)[("vllm:prompt_tokens_total", ())] == 71


def test_request_latencies_follow_vllm_definitions(logger_and_registry):
    logger, registry = logger_and_registry
    times = dict(arrival_time=100.0, first_scheduled_time=100.5)
    logger.record_step([output("a", 1, first_token_time=101.0, **times)], stats(), now=101.0)
    logger.record_step([output("a", 2, first_token_time=101.0, **times)], stats(), now=101.2)
    logger.record_step([output("a", 2, first_token_time=101.0, **times)], stats(), now=101.3)
    logger.record_step(
        [
            output(
                "a", 4, "length", first_token_time=101.0, last_token_time=101.9,
                finished_time=102.0, **times,
            )
        ],
        stats(),
        now=102.0,
    )  # fmt: skip
    values = read(registry)

    def hist(name):
        return values[(f"{name}_count", ())], values[(f"{name}_sum", ())]

    assert hist("vllm:time_to_first_token_seconds") == (1, pytest.approx(1.0))
    # Steps that gave new tokens: at 101.2 (0.2 s after 101.0) and 102.0 (0.8 s after 101.2).
    assert hist("vllm:inter_token_latency_seconds") == (2, pytest.approx(1.0))
    assert hist("vllm:request_queue_time_seconds") == (1, pytest.approx(0.5))
    assert hist("vllm:request_prefill_time_seconds") == (1, pytest.approx(0.5))
    assert hist("vllm:request_decode_time_seconds") == (1, pytest.approx(0.9))
    assert hist("vllm:request_inference_time_seconds") == (1, pytest.approx(1.4))
    assert hist("vllm:e2e_request_latency_seconds") == (1, pytest.approx(2.0))
    assert hist("vllm:request_time_per_output_token_seconds") == (1, pytest.approx(0.3))
    assert hist("vllm:request_prompt_tokens") == (1, 5)
    assert hist("vllm:request_generation_tokens") == (1, 4)
    assert values[("vllm:request_success_total", (("finished_reason", "length"),))] == 1
    assert values[("vllm:request_success_total", (("finished_reason", "stop"),))] == 0
    # The 1 s TTFT falls in the le=1.0 bucket, not in le=0.75.
    assert values[("vllm:time_to_first_token_seconds_bucket", (("le", "1.0"),))] == 1
    assert values[("vllm:time_to_first_token_seconds_bucket", (("le", "0.75"),))] == 0


def test_each_of_n_sequences_counts_and_aborts_count(logger_and_registry):
    logger, registry = logger_and_registry
    times = dict(arrival_time=0.0, first_scheduled_time=0.0, first_token_time=1.0)
    logger.record_step([output("a", 1, "stop", n=3, **times)], stats(), now=1.0)
    logger.record_step([output("b", 1, **times)], stats(), now=1.0)
    logger.record_abort("b")
    values = read(registry)
    assert values[("vllm:request_success_total", (("finished_reason", "stop"),))] == 3
    assert values[("vllm:request_success_total", (("finished_reason", "abort"),))] == 1


def test_token_buckets_are_1_2_5_up_to_the_limit():
    assert token_buckets(600) == [1, 2, 5, 10, 20, 50, 100, 200, 500]
    assert token_buckets(1) == [1]
