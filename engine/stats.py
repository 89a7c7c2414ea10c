"""A snapshot of the engine's state and counters, read by the metrics exporter and the tests."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.engine.spec_decode.metrics import SpecDecodingStats


@dataclass(frozen=True, kw_only=True)
class SchedulerStats:
    """The scheduler's part of :class:`EngineStats` (``Scheduler.make_stats``); the fields are
    described there."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    num_total_blocks: int
    num_free_blocks: int
    num_preemptions_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class EngineStats(SchedulerStats):
    """Engine gauges and counters at one moment (vLLM's metric meanings).

    Attributes:
        num_running_reqs: sequences holding KV blocks (``vllm:num_requests_running``).
        num_waiting_reqs: sequences queued or preempted (``vllm:num_requests_waiting``).
        kv_cache_usage: fraction of blocks held by sequences, 0..1
            (``vllm:kv_cache_usage_perc``); cached blocks at reference count 0 count as free.
        num_total_blocks: blocks in the cache.
        num_free_blocks: blocks at reference count 0 (fresh or cached).
        kv_capacity_tokens: tokens the cache holds.
        max_concurrency: sequences of ``max_model_len`` tokens that fit at once.
        num_preemptions_total: preemptions since start (``vllm:num_preemptions_total``).
        prefix_cache_queries_total: tokens looked up in the prefix cache (counter).
        prefix_cache_hits_total: tokens found there (counter).
        prompt_tokens_total: prompt tokens of requests that produced a first token (counter).
        generation_tokens_total: output tokens produced (counter).
        running_lora_adapters, waiting_lora_adapters: names of the LoRA adapters of running
            and of waiting sequences, sorted (``vllm:lora_requests_info`` labels).
        max_lora: ``max_loras``; 0 when LoRA is off.
        spec_decode: speculative decoding counters (``vllm:spec_decode_*``); None when
            speculative decoding is off.
        snapshot: the engine's count of snapshots taken when this one was, from 1; a larger
            number is a later state. Replies and step outputs reach the API process out of
            order (a request's add reply after the step that finished it), so it keeps the
            snapshot with the largest number (``AsyncLLM.stats``).
    """

    kv_capacity_tokens: int
    max_concurrency: float
    prompt_tokens_total: int
    generation_tokens_total: int
    max_lora: int = 0
    spec_decode: SpecDecodingStats | None = None
    snapshot: int = 0
