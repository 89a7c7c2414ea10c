"""Request traces for the autoscaling simulator: deterministic for a given seed.

Four shapes, each ``duration`` seconds long:

- ``steady``: Poisson arrivals at a constant rate; chat-sized prompts and answers.
- ``diurnal``: a day compressed into the trace: the rate follows a raised cosine from a night
  low to a midday peak and back.
- ``bursty``: a low base rate with short bursts at several times the base rate (flash crowds).
- ``long_context``: a steady chat load that shifts, halfway through, to a lower rate of
  long-document requests (12k-30k prompt tokens).

Arrivals of a time-varying rate are drawn by thinning (Lewis and Shedler, 1979): candidates at
the peak rate, each kept with probability rate(t) / peak. Lengths are log-normal (prompt
median 600 tokens, answer median 200), clipped to the model's context, as in public chat
traces (e.g. ShareGPT's, which are roughly log-normal).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

TRACES = ("steady", "diurnal", "bursty", "long_context")


@dataclass
class Request:
    """One request of a trace and, once simulated, what happened to it (times in seconds)."""

    arrival: float
    prompt_tokens: int
    output_tokens: int
    first_token: float | None = None
    finished: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


def _arrivals(
    rng: np.random.Generator, rate: Callable[[float], float], peak: float, duration: float
) -> list[float]:
    times, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / peak)
        if t >= duration:
            return times
        if rng.random() * peak <= rate(t):
            times.append(t)


def _lengths(
    rng: np.random.Generator, n: int, median: float, sigma: float, low: int, high: int
) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(math.log(median), sigma, n)), low, high).astype(int)


def make_trace(
    name: str,
    *,
    duration: float = 1800.0,
    rate: float = 12.0,
    seed: int = 0,
    max_model_len: int = 32768,
) -> list[Request]:
    """The requests of trace ``name``, sorted by arrival.

    Args:
        name: one of ``TRACES``.
        duration: seconds.
        rate: the trace's mean chat rate, requests/s (steady: exactly; diurnal: the mean of
            the cosine; bursty: the base rate is a third of it; long context: before the shift).
        seed: random seed; the same arguments give the same trace.
        max_model_len: longest prompt + answer, tokens.

    Raises:
        ValueError: an unknown trace name or a non-positive duration or rate.
    """
    if name not in TRACES:
        raise ValueError(f"unknown trace {name!r}; known: {', '.join(TRACES)}")
    if duration <= 0 or rate <= 0:
        raise ValueError("duration and rate must be positive")
    rng = np.random.default_rng([seed, TRACES.index(name)])
    if name == "steady":
        shape, peak = (lambda t: rate), rate
    elif name == "diurnal":
        low, high = 0.2 * rate, 1.8 * rate
        shape = lambda t: low + (high - low) * 0.5 * (1 - math.cos(2 * math.pi * t / duration))  # noqa: E731
        peak = high
    elif name == "bursty":
        base, burst, length, every = rate / 3, 4 * rate, 60.0, 300.0
        shape = lambda t: burst if (t % every) >= every - length else base  # noqa: E731
        peak = burst
    else:
        shape, peak = (lambda t: rate), rate
    times = _arrivals(rng, shape, peak, duration)
    n = len(times)
    prompts = _lengths(rng, n, 600, 0.8, 16, max_model_len // 4)
    outputs = _lengths(rng, n, 200, 0.7, 8, 1024)
    requests = [Request(t, int(p), int(o)) for t, p, o in zip(times, prompts, outputs, strict=True)]
    if name == "long_context":
        shift = duration / 2
        chat = [r for r in requests if r.arrival < shift]
        docs = _arrivals(rng, lambda t: rate / 8, rate / 8, duration - shift)
        lengths = rng.integers(12_000, min(30_000, max_model_len - 1024), len(docs))
        outputs = _lengths(rng, len(docs), 300, 0.5, 32, 1024)
        requests = chat + [
            Request(shift + t, int(p), int(o))
            for t, p, o in zip(docs, lengths, outputs, strict=True)
        ]
    return requests
