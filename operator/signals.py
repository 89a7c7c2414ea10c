"""Engine metrics -> the load signals the autoscaler decides on.

Two steps, both pure:

1. :func:`parse_metrics` reads one pod's ``/metrics`` text (Prometheus exposition format, parsed
   by ``prometheus_client``'s own parser) into a :class:`MetricSample`.
2. :func:`summarize` turns the samples of a time window (several pods, several scrape rounds)
   into one :class:`Signals`: fleet load in replica units, queue lengths, the preemption rate
   from the counter, and TTFT quantiles from the histogram buckets, the way Prometheus'
   ``rate()`` and ``histogram_quantile()`` compute them.

Metric names are vLLM's (``vllm:...``, labelled ``model_name``) plus kvpilot's own
(``kvpilot:...``); a pod serving several model names (LoRA adapters) has its series summed,
except the KV-cache usage, which belongs to the one engine and is read as the maximum.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
NUM_PREEMPTIONS = "vllm:num_preemptions_total"
REQUEST_SUCCESS = "vllm:request_success_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
TTFT_BUCKET = "vllm:time_to_first_token_seconds_bucket"
KV_CACHE_CAPACITY_TOKENS = "kvpilot:kv_cache_capacity_tokens"
MAX_CONCURRENCY = "kvpilot:max_concurrency"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"

TTFT_QUANTILES = (0.5, 0.9, 0.99)


class MetricsParseError(ValueError):
    """A ``/metrics`` body that is not Prometheus text or lacks a metric the autoscaler needs."""


@dataclass(frozen=True)
class MetricSample:
    """One scrape of one engine pod.

    Attributes:
        pod: pod name.
        timestamp: when the scrape round started, seconds on the operator's clock; all pods of
            one round share it, which is how :func:`summarize` groups them.
        kv_cache_usage: fraction of KV-cache blocks in use, 0..1.
        num_requests_running: requests in the running queue.
        num_requests_waiting: requests in the waiting queue.
        num_preemptions_total: preemptions since the engine started (counter).
        request_success_total: finished requests since start (counter).
        prompt_tokens_total: prefilled prompt tokens since start (counter).
        generation_tokens_total: generated tokens since start (counter).
        ttft_buckets: time-to-first-token histogram as ``(upper bound in seconds, cumulative
            count)`` pairs sorted by bound, ``+inf`` last; empty when not exported.
        kv_cache_capacity_tokens: tokens the replica's KV cache holds, or None.
        max_concurrency: requests of ``max_model_len`` tokens that fit at once, or None.
        prefix_cache_hits_total: prompt tokens found in the prefix cache since start (counter).
    """

    pod: str
    timestamp: float
    kv_cache_usage: float
    num_requests_running: float
    num_requests_waiting: float
    num_preemptions_total: float = 0.0
    request_success_total: float = 0.0
    prompt_tokens_total: float = 0.0
    generation_tokens_total: float = 0.0
    ttft_buckets: tuple[tuple[float, float], ...] = ()
    kv_cache_capacity_tokens: float | None = None
    max_concurrency: float | None = None
    prefix_cache_hits_total: float = 0.0


@dataclass(frozen=True)
class Signals:
    """The fleet's load over one window, as the autoscaler reads it.

    Attributes:
        window_seconds: time between the first and last scrape round in the window.
        num_rounds: scrape rounds in the window.
        num_pods: pods per round, averaged over rounds.
        kv_cache_usage: per-pod KV-cache usage averaged over pods, then rounds, 0..1.
        kv_load: the sum over pods of KV-cache usage, averaged over rounds: load in units of
            one full replica's KV cache.
        num_requests_running: fleet total, averaged over rounds.
        num_requests_waiting: fleet total, averaged over rounds.
        preemptions_per_second: fleet preemption rate over the window (counter increase per
            pod, resets handled as Prometheus' ``rate()`` does), preemptions/s.
        requests_per_second: fleet rate of finished requests, requests/s.
        prompt_tokens_per_second: fleet prefill rate, tokens/s.
        generation_tokens_per_second: fleet decode rate, tokens/s.
        ttft_seconds: TTFT quantile (0.5, 0.9, 0.99) -> seconds, from the histogram buckets'
            increase over the window; empty when no request got its first token in it.
        kv_cache_capacity_tokens: smallest replica KV capacity in the latest round, tokens, or
            None when the engine does not export it.
        max_concurrency: smallest replica max concurrency in the latest round, or None.
    """

    window_seconds: float
    num_rounds: int
    num_pods: float
    kv_cache_usage: float
    kv_load: float
    num_requests_running: float
    num_requests_waiting: float
    preemptions_per_second: float
    requests_per_second: float
    prompt_tokens_per_second: float
    generation_tokens_per_second: float
    ttft_seconds: dict[float, float]
    kv_cache_capacity_tokens: float | None
    max_concurrency: float | None

    @property
    def active(self) -> bool:
        """Whether the fleet saw any traffic in the window."""
        return (
            self.num_requests_running > 0
            or self.num_requests_waiting > 0
            or self.requests_per_second > 0
            or self.prompt_tokens_per_second > 0
        )

    @property
    def tokens_per_second(self) -> float:
        """Work the fleet did, prompt plus generated tokens per second."""
        return self.prompt_tokens_per_second + self.generation_tokens_per_second

    @property
    def kv_share_per_request(self) -> float | None:
        """Mean fraction of one replica's KV cache a running request holds, or None if idle."""
        if self.num_requests_running <= 0:
            return None
        return self.kv_load / self.num_requests_running

    def as_dict(self) -> dict[str, float | int | None | dict[str, float]]:
        """JSON-ready form for ``status.lastDecision.signals`` (camelCase keys, rounded)."""
        return {
            # Whole seconds: the spacing of scrape rounds jitters by milliseconds, which is no
            # change worth a status write.
            "windowSeconds": round(self.window_seconds),
            "pods": round(self.num_pods, 3),
            "kvCacheUsage": round(self.kv_cache_usage, 4),
            "kvLoad": round(self.kv_load, 4),
            "requestsRunning": round(self.num_requests_running, 3),
            "requestsWaiting": round(self.num_requests_waiting, 3),
            "preemptionsPerSecond": round(self.preemptions_per_second, 4),
            "requestsPerSecond": round(self.requests_per_second, 4),
            "tokensPerSecond": round(self.tokens_per_second, 2),
            "ttftSeconds": {
                f"p{round(q * 100)}": round(v, 4) for q, v in self.ttft_seconds.items()
            },
            "kvCacheCapacityTokens": self.kv_cache_capacity_tokens,
            "maxConcurrency": self.max_concurrency,
        }


def parse_metrics(text: str, pod: str, timestamp: float) -> MetricSample:
    """Parse one engine's ``/metrics`` body into a :class:`MetricSample`.

    Args:
        text: Prometheus text exposition format, as served by the engine.
        pod: the pod's name, kept on the sample.
        timestamp: scrape round start, seconds.

    Raises:
        MetricsParseError: the text does not parse, or lacks one of ``vllm:kv_cache_usage_perc``,
            ``vllm:num_requests_running``, ``vllm:num_requests_waiting``.
    """
    sums: dict[str, float] = defaultdict(float)
    kv_usage: float | None = None
    ttft: dict[float, float] = defaultdict(float)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == KV_CACHE_USAGE:
                    kv_usage = max(sample.value, kv_usage or 0.0)
                elif sample.name == TTFT_BUCKET:
                    ttft[float(sample.labels["le"])] += sample.value
                else:
                    sums[sample.name] += sample.value
    except (ValueError, KeyError, TypeError) as error:
        raise MetricsParseError(f"pod {pod}: /metrics is not Prometheus text: {error}") from error
    missing = [name for name in (NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING) if name not in sums]
    if kv_usage is None:
        missing.insert(0, KV_CACHE_USAGE)
    if missing:
        raise MetricsParseError(f"pod {pod}: /metrics lacks {', '.join(missing)}")
    return MetricSample(
        pod=pod,
        timestamp=timestamp,
        kv_cache_usage=min(max(kv_usage or 0.0, 0.0), 1.0),
        num_requests_running=sums[NUM_REQUESTS_RUNNING],
        num_requests_waiting=sums[NUM_REQUESTS_WAITING],
        num_preemptions_total=sums.get(NUM_PREEMPTIONS, 0.0),
        request_success_total=sums.get(REQUEST_SUCCESS, 0.0),
        prompt_tokens_total=sums.get(PROMPT_TOKENS, 0.0),
        generation_tokens_total=sums.get(GENERATION_TOKENS, 0.0),
        ttft_buckets=tuple(sorted(ttft.items())),
        kv_cache_capacity_tokens=sums.get(KV_CACHE_CAPACITY_TOKENS),
        max_concurrency=sums.get(MAX_CONCURRENCY),
        prefix_cache_hits_total=sums.get(PREFIX_CACHE_HITS, 0.0),
    )


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The ``q``-quantile of a cumulative histogram, as Prometheus' ``histogram_quantile``.

    Linear interpolation inside the bucket the rank falls into; the first bucket starts at 0;
    a rank in the ``+inf`` bucket returns the largest finite bound.

    Args:
        q: quantile, 0..1.
        buckets: ``(upper bound, cumulative count)`` pairs sorted by bound, ``+inf`` last.

    Returns:
        The quantile in the buckets' unit, or None when the histogram holds no observations.

    Raises:
        ValueError: ``q`` is outside 0..1, or the last bound is not ``+inf``.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    if not buckets:
        return None
    if not math.isinf(buckets[-1][0]):
        raise ValueError("histogram buckets must end with le=+Inf")
    total = buckets[-1][1]
    if total <= 0:
        return None
    if len(buckets) == 1:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


def _increase(first: float, last: float) -> float:
    """Counter increase between two readings; a drop means the engine restarted (reset)."""
    return last - first if last >= first else last


def summarize(
    samples: Iterable[MetricSample], start: float | None = None, end: float | None = None
) -> Signals | None:
    """Fold a window's samples into :class:`Signals`.

    Args:
        samples: samples of any pods and rounds; rounds are grouped by ``timestamp``.
        start: only samples stamped at or after this time (seconds) count; None for all.
        end: only samples stamped before this time (seconds) count; None for all.

    Returns:
        The window's signals, or None when no sample falls in it.
    """
    rounds: dict[float, list[MetricSample]] = defaultdict(list)
    for sample in samples:
        if (start is None or sample.timestamp >= start) and (end is None or sample.timestamp < end):
            rounds[sample.timestamp].append(sample)
    if not rounds:
        return None
    times = sorted(rounds)
    window = times[-1] - times[0]
    per_round = [rounds[t] for t in times]

    def mean(values: Iterable[float]) -> float:
        values = list(values)
        return sum(values) / len(values)

    by_pod: dict[str, list[MetricSample]] = defaultdict(list)
    for t in times:
        for sample in rounds[t]:
            by_pod[sample.pod].append(sample)

    def rate(field: str) -> float:
        if window <= 0:
            return 0.0
        total = 0.0
        for pod_samples in by_pod.values():
            values = [getattr(s, field) for s in pod_samples]
            total += sum(_increase(a, b) for a, b in zip(values, values[1:], strict=False))
        return total / window

    ttft = _ttft_increase(by_pod)
    latest = per_round[-1]
    capacities = [s.kv_cache_capacity_tokens for s in latest if s.kv_cache_capacity_tokens]
    concurrencies = [s.max_concurrency for s in latest if s.max_concurrency]
    return Signals(
        window_seconds=window,
        num_rounds=len(times),
        num_pods=mean(len(r) for r in per_round),
        kv_cache_usage=mean(mean(s.kv_cache_usage for s in r) for r in per_round),
        kv_load=mean(sum(s.kv_cache_usage for s in r) for r in per_round),
        num_requests_running=mean(sum(s.num_requests_running for s in r) for r in per_round),
        num_requests_waiting=mean(sum(s.num_requests_waiting for s in r) for r in per_round),
        preemptions_per_second=rate("num_preemptions_total"),
        requests_per_second=rate("request_success_total"),
        prompt_tokens_per_second=rate("prompt_tokens_total"),
        generation_tokens_per_second=rate("generation_tokens_total"),
        ttft_seconds={
            q: value for q in TTFT_QUANTILES if (value := histogram_quantile(q, ttft)) is not None
        },
        kv_cache_capacity_tokens=min(capacities) if capacities else None,
        max_concurrency=min(concurrencies) if concurrencies else None,
    )


def _ttft_increase(by_pod: dict[str, list[MetricSample]]) -> list[tuple[float, float]]:
    """Summed per-pod increase of the TTFT buckets over the window (cumulative pairs)."""
    increase: dict[float, float] = defaultdict(float)
    for pod_samples in by_pod.values():
        first, last = pod_samples[0].ttft_buckets, pod_samples[-1].ttft_buckets
        if len(pod_samples) < 2 or not last:
            continue
        before = dict(first)
        reset = last[-1][1] < before.get(math.inf, 0.0)
        for bound, count in last:
            increase[bound] += count if reset else count - before.get(bound, 0.0)
    return sorted(increase.items())
