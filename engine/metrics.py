"""Prometheus metrics with vLLM's names, so dashboards, KEDA triggers and our operator read them.

Every series carries the label ``model_name``. Gauges and counters that the engine keeps itself
(queue lengths, KV usage, token and preemption totals, prefix-cache totals) are read from the
latest ``EngineStats`` at scrape time; per-request latencies are histograms observed from the
``RequestOutput``s of each step. kvpilot adds the KV geometry the operator sizes replicas by:
``kvpilot:kv_cache_total_blocks``, ``kvpilot:kv_cache_free_blocks``,
``kvpilot:kv_cache_capacity_tokens`` and ``kvpilot:max_concurrency`` (sequences of
``max_model_len`` tokens that fit in the cache at once). With LoRA on, ``vllm:lora_requests_info``
names the adapters of running and waiting requests in its labels.
With speculative decoding on, the ``vllm:spec_decode_*`` counters follow the engine's
``SpecDecodingStats``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpilot.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpilot.engine.stats import EngineStats

# Bucket boundaries are vLLM's (vllm/v1/metrics/loggers.py), so histogram_quantile() queries
# written for vLLM give the same resolution here.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def token_buckets(max_value: int) -> list[float]:
    """1-2-5 buckets up to ``max_value`` tokens (vLLM's ``build_1_2_5_buckets``)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(float(value))
        exponent += 1


@dataclass
class _SequenceState:
    """What the stat logger has seen of one output sequence (one of a request's ``n``).

    Attributes:
        first_token_time: when its first token came (seconds): the engine's time for the
            sequence ``RequestOutput.metrics`` describes (index 0), else when the step that
            gave it was observed; None before its first token.
        last_token_time: when the last step that gave it tokens was observed (seconds).
        num_tokens: its output tokens so far.
        finished: whether its end was recorded (or it was counted as aborted).
    """

    first_token_time: float | None = None
    last_token_time: float = 0.0
    num_tokens: int = 0
    finished: bool = False


class _EngineStatsCollector(Collector):
    """Exposes the latest ``EngineStats`` snapshot: exact totals, no double counting."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        gauges = (
            ("vllm:num_requests_running", "Requests holding KV blocks.", stats.num_running_reqs),
            ("vllm:num_requests_waiting", "Requests waiting or preempted.", stats.num_waiting_reqs),
            ("vllm:kv_cache_usage_perc", "KV cache usage, 1 = full.", stats.kv_cache_usage),
            ("kvpilot:kv_cache_total_blocks", "KV cache blocks.", stats.num_total_blocks),
            ("kvpilot:kv_cache_free_blocks", "KV cache blocks not held.", stats.num_free_blocks),
            (
                "kvpilot:kv_cache_capacity_tokens",
                "Tokens the KV cache holds.",
                stats.kv_capacity_tokens,
            ),
            (
                "kvpilot:max_concurrency",
                "Sequences of max_model_len tokens that fit in the KV cache at once.",
                stats.max_concurrency,
            ),
        )
        yield from self._families(GaugeMetricFamily, gauges)
        if stats.max_lora:
            yield self._lora_info(stats)
        counters = (
            ("vllm:prompt_tokens", "Prefill tokens processed.", stats.prompt_tokens_total),
            (
                "vllm:generation_tokens",
                "Generation tokens produced.",
                stats.generation_tokens_total,
            ),
            ("vllm:num_preemptions", "Preemptions.", stats.num_preemptions_total),
            (
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                stats.prefix_cache_queries_total,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                stats.prefix_cache_hits_total,
            ),
        )
        spec = stats.spec_decode
        if spec is not None:
            counters += (
                (
                    "vllm:spec_decode_num_drafts",
                    "Verification steps of requests with draft tokens.",
                    spec.num_drafts,
                ),
                (
                    "vllm:spec_decode_num_draft_tokens",
                    "Draft tokens proposed.",
                    spec.num_draft_tokens,
                ),
                (
                    "vllm:spec_decode_num_accepted_tokens",
                    "Draft tokens accepted.",
                    spec.num_accepted_tokens,
                ),
            )
        yield from self._families(CounterMetricFamily, counters)
        if spec is not None:
            family = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted at each draft position (0: first draft of a step).",
                labels=["model_name", "position"],
            )
            for position, value in enumerate(spec.num_accepted_tokens_per_pos):
                family.add_metric([self.model_name, str(position)], float(value))
            yield family

    def _families(
        self,
        family_type: type[GaugeMetricFamily] | type[CounterMetricFamily],
        rows: tuple[tuple[str, str, float], ...],
    ) -> Iterator[Metric]:
        """One ``family_type`` family per ``(name, doc, value)`` row, labelled with the model."""
        for name, doc, value in rows:
            family = family_type(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(value))
            yield family

    def _lora_info(self, stats: EngineStats) -> Metric:
        # vLLM's info gauge: the labels name the adapters (comma-separated), the value is the
        # time they were observed (seconds since the epoch).
        family = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests.",
            labels=["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        family.add_metric(
            [
                self.model_name,
                str(stats.max_lora),
                ",".join(stats.running_lora_adapters),
                ",".join(stats.waiting_lora_adapters),
            ],
            time.time(),
        )
        return family


class PrometheusStatLogger:
    """Records engine state and request latencies into a Prometheus registry.

    Implements ``kvpilot.engine.async_llm.StatLogger``. Times are seconds (``time.time()``).

    Args:
        model_name: the served model name, the ``model_name`` label of every series.
        registry: where the metrics live (one per server; tests build several).
        max_model_len: longest sequence in tokens, the top of the token-count buckets.
        cache_config: labels of ``vllm:cache_config_info`` (block_size, num_gpu_blocks, ...).

    Per-request histograms follow vLLM V1: TTFT = first token - arrival; queue time = first
    scheduled - arrival; prefill = first token - first scheduled; decode = last token - first
    token; inference = last token - first scheduled; e2e = finished - arrival; time per output
    token = decode / (output tokens - 1); inter-token latency = time between consecutive steps
    that gave the request tokens. As in vLLM V1, where a request with ``n > 1`` becomes ``n``
    child requests, each of a request's ``n`` sequences is one request in every per-request
    metric: ``vllm:request_success_total`` (by ``finished_reason``: stop, length, abort), the
    latency histograms, ``vllm:request_prompt_tokens`` and ``vllm:request_generation_tokens``;
    so, with nothing aborted, ``vllm:request_prompt_tokens_sum`` equals the engine's
    ``vllm:prompt_tokens_total`` (each sequence's prompt counted once, prefix-cache hits
    included, a preempted sequence's recomputation not counted again).
    """

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry,
        max_model_len: int,
        cache_config: Mapping[str, object],
    ) -> None:
        self.model_name = model_name
        self._stats = _EngineStatsCollector(model_name)
        registry.register(self._stats)
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(
                model_name
            )

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency.", TOKEN_LATENCY_BUCKETS
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Mean time per output token of a request after its first.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Time waiting before scheduling.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds", "Time in prefill.", REQUEST_LATENCY_BUCKETS
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds", "Time in decode.", REQUEST_LATENCY_BUCKETS
        )
        self.inference = histogram(
            "vllm:request_inference_time_seconds",
            "Time from first scheduling to the last token.",
            REQUEST_LATENCY_BUCKETS,
        )
        token_buckets_ = token_buckets(max_model_len)
        self.prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", token_buckets_
        )
        self.generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", token_buckets_
        )
        self.success = Counter(
            "vllm:request_success",
            "Finished sequences by finish reason.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)
        info = Gauge(
            "vllm:cache_config_info",
            "KV cache configuration.",
            sorted(cache_config),
            registry=registry,
        )
        info.labels(**{k: str(v) for k, v in cache_config.items()}).set(1)
        # request id -> sequence index -> what was seen of it, until the request finishes.
        self._in_flight: dict[str, dict[int, _SequenceState]] = {}

    def record_stats(self, stats: EngineStats) -> None:
        """Take a new engine snapshot (gauges and totals)."""
        self._stats.stats = stats

    def record_step(self, outputs: list[RequestOutput], stats: EngineStats, now: float) -> None:
        """Observe one step: new stats, first tokens, inter-token gaps, finished sequences.

        Each of a request's ``n`` sequences counts as one request (vLLM V1 fans ``n > 1``
        out into ``n`` child requests), as the engine's ``vllm:prompt_tokens_total`` does.
        """
        self.record_stats(stats)
        for output in outputs:
            sequences = self._in_flight.setdefault(output.request_id, {})
            for seq in output.outputs:
                state = sequences.setdefault(seq.index, _SequenceState())
                self._observe_tokens(output, seq, state, now)
                if not state.finished and (seq.finish_reason is not None or output.finished):
                    state.finished = True
                    self._record_finished(output, seq, state, now)
            if output.finished:
                del self._in_flight[output.request_id]

    def record_abort(self, request_id: str, num_sequences: int = 1) -> None:
        """Count the unfinished sequences of a request its client abandoned (``num_sequences``:
        its ``n``)."""
        sequences = self._in_flight.pop(request_id, {})
        num_finished = sum(state.finished for state in sequences.values())
        self.success.labels(self.model_name, "abort").inc(max(num_sequences - num_finished, 0))

    def _observe_tokens(
        self, output: RequestOutput, seq: CompletionOutput, state: _SequenceState, now: float
    ) -> None:
        """TTFT at a sequence's first tokens, inter-token latency at each later step that
        gave it tokens."""
        num_tokens = len(seq.token_ids)
        if state.first_token_time is None:
            if num_tokens:
                times = output.metrics
                first = now
                if seq.index == 0 and times is not None and times.first_token_time:
                    first = times.first_token_time
                if times is not None:
                    self.ttft.observe(max(first - times.arrival_time, 0.0))
                state.first_token_time = first
                state.last_token_time, state.num_tokens = now, num_tokens
        elif num_tokens > state.num_tokens:
            self.itl.observe(now - state.last_token_time)
            state.last_token_time, state.num_tokens = now, num_tokens

    def _record_finished(
        self, output: RequestOutput, seq: CompletionOutput, state: _SequenceState, now: float
    ) -> None:
        """The per-request histograms and the success count of one finished sequence."""
        self.success.labels(self.model_name, seq.finish_reason or "stop").inc()
        self.prompt_tokens.observe(len(output.prompt_token_ids))
        self.generation_tokens.observe(len(seq.token_ids))
        times = _sequence_times(output, seq, state, now)
        if times is None:
            return
        finished = times.finished_time or now
        self.e2e.observe(max(finished - times.arrival_time, 0.0))
        if times.first_scheduled_time is not None:
            self.queue.observe(max(times.first_scheduled_time - times.arrival_time, 0.0))
        if times.first_token_time is None or times.first_scheduled_time is None:
            return
        last = times.last_token_time or times.first_token_time
        self.prefill.observe(max(times.first_token_time - times.first_scheduled_time, 0.0))
        self.decode.observe(max(last - times.first_token_time, 0.0))
        self.inference.observe(max(last - times.first_scheduled_time, 0.0))
        if len(seq.token_ids) > 1:
            self.tpot.observe(max(last - times.first_token_time, 0.0) / (len(seq.token_ids) - 1))


def _sequence_times(
    output: RequestOutput, seq: CompletionOutput, state: _SequenceState, now: float
) -> RequestMetrics | None:
    """The timestamps of one finished sequence of ``output``.

    ``RequestOutput.metrics`` holds the engine's timestamps of the request's first sequence
    (index 0). The others share its arrival and, added together and queued behind it, its first
    scheduling; their first and last tokens and their end are when the steps that gave them
    were observed (``now``), which trails the engine's time by the step's output handling.
    """
    times = output.metrics
    if times is None or seq.index == 0:
        return times
    return RequestMetrics(
        arrival_time=times.arrival_time,
        first_scheduled_time=times.first_scheduled_time,
        first_token_time=state.first_token_time,
        last_token_time=state.last_token_time if state.first_token_time is not None else None,
        finished_time=now,
    )
