"""PrometheusStatLogger: values computed by hand from request timestamps, read back as text;
then a live server's /metrics as requests with n > 1 run."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.metrics import PrometheusStatLogger, token_buckets
from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME as SERVED_MODEL
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


def hist(values: dict, name: str) -> tuple[float, float]:
    """A histogram's ``(count, sum)`` among ``read``'s values."""
    return values[(f"{name}_count", ())], values[(f"{name}_sum", ())]


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

    assert hist(values, "vllm:time_to_first_token_seconds") == (1, pytest.approx(1.0))
    # Steps that gave new tokens: at 101.2 (0.2 s after 101.0) and 102.0 (0.8 s after 101.2).
    assert hist(values, "vllm:inter_token_latency_seconds") == (2, pytest.approx(1.0))
    assert hist(values, "vllm:request_queue_time_seconds") == (1, pytest.approx(0.5))
    assert hist(values, "vllm:request_prefill_time_seconds") == (1, pytest.approx(0.5))
    assert hist(values, "vllm:request_decode_time_seconds") == (1, pytest.approx(0.9))
    assert hist(values, "vllm:request_inference_time_seconds") == (1, pytest.approx(1.4))
    assert hist(values, "vllm:e2e_request_latency_seconds") == (1, pytest.approx(2.0))
    assert hist(values, "vllm:request_time_per_output_token_seconds") == (1, pytest.approx(0.3))
    assert hist(values, "vllm:request_prompt_tokens") == (1, 5)
    assert hist(values, "vllm:request_generation_tokens") == (1, 4)
    assert values[("vllm:request_success_total", (("finished_reason", "length"),))] == 1
    assert values[("vllm:request_success_total", (("finished_reason", "stop"),))] == 0
    # The 1 s TTFT falls in the le=1.0 bucket, not in le=0.75.
    assert values[("vllm:time_to_first_token_seconds_bucket", (("le", "1.0"),))] == 1
    assert values[("vllm:time_to_first_token_seconds_bucket", (("le", "0.75"),))] == 0


def test_each_of_n_sequences_counts_as_a_request_and_aborts_count(logger_and_registry):
    logger, registry = logger_and_registry
    times = dict(arrival_time=0.0, first_scheduled_time=0.0, first_token_time=1.0)
    logger.record_step([output("a", 1, "stop", n=3, **times)], stats(), now=1.0)
    logger.record_step([output("b", 1, **times)], stats(), now=1.0)
    logger.record_abort("b")
    values = read(registry)
    assert values[("vllm:request_success_total", (("finished_reason", "stop"),))] == 3
    assert values[("vllm:request_success_total", (("finished_reason", "abort"),))] == 1
    # Every per-request metric counts the 3 sequences of "a" (vLLM's n child requests).
    for name in (
        "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds", "vllm:request_generation_tokens",
    ):  # fmt: skip
        assert values[(f"{name}_count", ())] == 3, name
    assert values[("vllm:request_prompt_tokens_count", ())] == 3
    assert values[("vllm:request_prompt_tokens_sum", ())] == 15  # 3 x 5 prompt tokens
    # Each sequence's first token, "b"'s included.
    assert values[("vllm:time_to_first_token_seconds_count", ())] == 4


def sequences_output(request_id, seqs, **times) -> RequestOutput:
    """An output whose sequence i has ``seqs[i] = (tokens, finish_reason)``."""
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[1, 2, 3, 4, 5],
        outputs=[
            CompletionOutput(index=i, text="", token_ids=list(range(n)), finish_reason=reason)
            for i, (n, reason) in enumerate(seqs)
        ],
        finished=all(reason is not None for _, reason in seqs),
        metrics=RequestMetrics(**times),
    )


def test_sequences_of_one_request_are_timed_each_on_its_own(logger_and_registry):
    """Sequence 0's times are the engine's (``RequestOutput.metrics``); the others' are when
    the step that advanced them was observed."""
    logger, registry = logger_and_registry
    times = dict(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0)
    steps = [
        (101.0, [(1, None), (0, None)], {}),
        (101.5, [(2, "length"), (1, None)], dict(last_token_time=101.4, finished_time=101.4)),
        (102.0, [(2, "length"), (2, None)], dict(last_token_time=101.4, finished_time=101.4)),
        (103.0, [(2, "length"), (3, "stop")], dict(last_token_time=101.4, finished_time=101.4)),
    ]
    for now, seqs, more in steps:
        logger.record_step([sequences_output("a", seqs, **times, **more)], stats(), now=now)
    values = read(registry)

    # TTFT: 1.0 (sequence 0, engine time) + 1.5 (sequence 1, first seen at 101.5).
    assert hist(values, "vllm:time_to_first_token_seconds") == (2, pytest.approx(2.5))
    # Sequence 0: 101.0 -> 101.5; sequence 1: 101.5 -> 102.0 -> 103.0.
    assert hist(values, "vllm:inter_token_latency_seconds") == (3, pytest.approx(2.0))
    # e2e: 1.4 (sequence 0 finished at 101.4) + 3.0 (sequence 1, seen finished at 103.0).
    assert hist(values, "vllm:e2e_request_latency_seconds") == (2, pytest.approx(4.4))
    assert hist(values, "vllm:request_queue_time_seconds") == (2, pytest.approx(1.0))
    # Prefill: 0.5 + 1.0; decode: 0.4 + 1.5; time per output token: 0.4 / 1 + 1.5 / 2.
    assert hist(values, "vllm:request_prefill_time_seconds") == (2, pytest.approx(1.5))
    assert hist(values, "vllm:request_decode_time_seconds") == (2, pytest.approx(1.9))
    assert hist(values, "vllm:request_time_per_output_token_seconds") == (2, pytest.approx(1.15))
    assert hist(values, "vllm:request_generation_tokens") == (2, 5)
    assert hist(values, "vllm:request_prompt_tokens") == (2, 10)
    assert values[("vllm:request_success_total", (("finished_reason", "length"),))] == 1
    assert values[("vllm:request_success_total", (("finished_reason", "stop"),))] == 1


def test_an_abort_counts_the_unfinished_sequences(logger_and_registry):
    logger, registry = logger_and_registry
    times = dict(arrival_time=0.0, first_scheduled_time=0.0, first_token_time=1.0)
    seqs = [(1, "stop"), (1, None), (1, None)]
    logger.record_step([sequences_output("a", seqs, **times)], stats(), now=1.0)
    logger.record_abort("a", num_sequences=3)
    logger.record_abort("b", num_sequences=2)  # aborted before any output
    values = read(registry)
    assert values[("vllm:request_success_total", (("finished_reason", "stop"),))] == 1
    assert values[("vllm:request_success_total", (("finished_reason", "abort"),))] == 4
    assert values[("vllm:e2e_request_latency_seconds_count", ())] == 1


def test_token_buckets_are_1_2_5_up_to_the_limit():
    assert token_buckets(600) == [1, 2, 5, 10, 20, 50, 100, 200, 500]
    assert token_buckets(1) == [1]


# A live ``kvpilot serve`` on the default model (SmolLM2), read over HTTP.


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--max-model-len", "512", "--max-num-seqs", "8")


def test_each_of_n_sequences_is_one_request_on_a_live_server(server):
    client = server.openai_client()
    before = server.metrics()
    several = client.completions.create(
        model=SERVED_MODEL,
        prompt="The capital of France is",
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=0,
        extra_body={"ignore_eos": True},
    )
    one = client.chat.completions.create(
        model=SERVED_MODEL,
        messages=[{"role": "user", "content": "Name three colors."}],
        max_tokens=5,
        temperature=0,
    )
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"model_name": SERVED_MODEL, **labels}.items())))
        return after[key] - before[key]

    assert len(several.choices) == 3
    successes = sum(
        delta("vllm:request_success_total", finished_reason=reason)
        for reason in ("stop", "length", "abort")
    )
    assert delta("vllm:request_success_total", finished_reason="abort") == 0
    # 3 + 1 requests in every per-request metric, as vLLM's n child requests.
    assert successes == 4
    for histogram in (
        "vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds",
        "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
        "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
    ):  # fmt: skip
        assert delta(f"{histogram}_count") == 4, histogram
    # Usage counts a prompt once per request; the engine once per sequence.
    prompt_tokens = 3 * several.usage.prompt_tokens + one.usage.prompt_tokens
    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:request_prompt_tokens_sum") == prompt_tokens
    completion_tokens = several.usage.completion_tokens + one.usage.completion_tokens
    assert several.usage.completion_tokens == 3 * 6  # ignore_eos: max_tokens each
    assert delta("vllm:generation_tokens_total") == completion_tokens
    assert delta("vllm:request_generation_tokens_sum") == completion_tokens
    # One token per step per sequence: a gap between each two tokens of each sequence.
    assert delta("vllm:inter_token_latency_seconds_count") == completion_tokens - 4
    # As vLLM: no *_created sample beside the counters and histograms.
    assert not [name for name, _ in after if name.endswith("_created")]
