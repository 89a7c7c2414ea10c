"""Forecasting recurring bursts: a period found by autocorrelation, a seasonal-naive forecast.

A pod needs its start-up time to become ready, so a purely reactive autoscaler cannot serve a
burst shorter than that: the replicas it asks for arrive after the burst. Bursts that recur (a
batch client every five minutes, a cron job, the top of the hour) are predictable, and
:func:`kvpilot.operator.autoscaler.decide` uses this module to ask for their replicas one
start-up time ahead. Pure: no clock, no I/O.

The algorithm, in six steps:

1. **History** (:class:`DemandHistory`): the replicas the load needed, one value per
   ``BUCKET_SECONDS`` bucket (the largest demand decided in it; a bucket without a decision
   holds the previous value), at most ``HISTORY_SECONDS`` of them: memory stays bounded
   (240 floats).
2. **Onsets** (:func:`onset_strength`): what recurs about a burst is when the demand rises,
   more than how long its tail lasts (a burst the fleet could not serve leaves a backlog that
   a served one does not). The rises, half-wave rectified and summed over ``ONSET_BUCKETS``,
   are the onset strength envelope of tempo estimation (Ellis, "Beat tracking by dynamic
   programming", J. New Music Research, 2007).
3. **Period** (:func:`detect_period`): the sample autocorrelation function of the onsets (Box
   and Jenkins, *Time Series Analysis*, ch. 2), normalized per lag by its number of terms,
   ``r(k) = [sum_i (x_i - m)(x_{i+k} - m) / (N - k)] / [sum_i (x_i - m)^2 / N]``, over lags of
   at least ``MIN_PERIOD_SECONDS`` and at most half the history (the pattern was seen twice).
   The period is the first local maximum of ``r`` after ``r`` first fell below zero that
   reaches ``MIN_AUTOCORRELATION`` and stands ``SIGNIFICANCE`` standard errors above white
   noise (Bartlett: about ``1 / sqrt(N - k)``); the first, not the highest, because every
   multiple of the period correlates as well (the "octave error" of YIN, de Cheveigne and
   Kawahara, JASA 2002). It counts only when the last period holds a burst: a peak of at
   least ``BURST_RATIO`` times the median. Noise, a trend, or a ramp that rises in regular
   steps of one replica has no such period.
4. **Forecast** (:func:`seasonal_naive_peak`): seasonal naive (Hyndman and Athanasopoulos,
   *Forecasting: Principles and Practice*, 3rd ed., section 5.2): the demand at ``t`` is what
   it was at ``t - period``, one bucket wider on each side for the burst's jitter in phase.
5. **Late pods** (:func:`burst_ceiling`): a pod asked for now is ready a start-up time later.
   When the forecast says the burst ends before then, and the load seen now is the forecast
   one (not a surge above it), replicas beyond the forecast for that time would arrive after
   the burst: the decision asks for no more than that forecast.
6. **Verification** (:func:`verified_predict`): a forecast is judged against the data that
   came after it (Hyndman and Athanasopoulos, section 5.8). The first burst forecast over
   the horizon is remembered (:class:`ExpectedBurst`: from the forecast's peak for as long
   as the forecast stays above ``1 / BURST_RATIO`` of it, the "burst is over" of step 5).
   Once that window is over, the burst came if the demand recorded over it, one bucket
   wider on each side, rose above ``1 / BURST_RATIO`` of the forecast peak
   (:func:`burst_missed`). If it did not, the forecast missed, and the history before the
   burst it was read from (one period before the missed one) no longer counts: periods are
   detected, and bursts forecast, only from there on (:attr:`ForecastMemory.since`). That
   leaves less than two periods, so no period at first: a changed period is learned from
   the last burst of the old one and the new ones, as at start-up, instead of being
   outvoted by an hour of the old period; two one-off spikes that made a period give one
   phantom forecast, after which the one spike left is no period.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BUCKET_SECONDS = 15.0
"""Resolution of the demand history: one operator tick (``--autoscale-interval``)."""

HISTORY_SECONDS = 3600.0
"""How far back the history reaches: periods of up to 30 minutes are seen twice."""

MAX_GAP_SECONDS = 120.0
"""A longer gap between decisions (operator down, no metrics) starts the history afresh: the
demand in it is unknown, and holding the last value over it would invent a pattern."""

MIN_PERIOD_SECONDS = 120.0
"""Shorter periods are left to the reactive windows (the stable window is 60 s)."""

ONSET_BUCKETS = 3
"""Rises of demand are summed over this many buckets (45 s) before their autocorrelation is
taken: a burst's rise seen through the metric windows spreads over a few scrapes."""

MIN_AUTOCORRELATION = 0.6
"""The onsets' autocorrelation at the period must reach this to act on it (1: exact repeat)."""

SIGNIFICANCE = 3.0
"""... and stand this many standard errors above white noise's (Bartlett's 1 / sqrt(N - k))."""

BURST_RATIO = 2.0
"""Only a burst is forecast: over the last period, the demand's peak is at least this many
times its median (Knative's panic threshold, 200%). The same ratio says a burst is over: the
forecast falls to at most ``1 / BURST_RATIO`` of its level."""

SURGE_TOLERANCE = 1.25
"""Demand seen now up to this many times the forecast for now (plus ``SURGE_SLACK_REPLICAS``)
is the forecast burst; above it, a surge the history did not show, served reactively."""

SURGE_SLACK_REPLICAS = 1.0
"""... plus this many replicas: a small forecast's rounding is no surge."""


@dataclass(frozen=True)
class DemandHistory:
    """Replicas the load needed, one value per ``BUCKET_SECONDS``, oldest first.

    Attributes:
        start: start of the first bucket, seconds on the decision's clock.
        values: replicas needed per bucket, at most ``HISTORY_SECONDS / BUCKET_SECONDS``.
    """

    start: float = 0.0
    values: tuple[float, ...] = ()

    @property
    def end(self) -> float:
        """End of the last bucket, seconds."""
        return self.start + len(self.values) * BUCKET_SECONDS

    def since(self, start: float | None) -> DemandHistory:
        """The buckets that begin at ``start`` or later (all of them when ``start`` is None)."""
        if start is None or start <= self.start:
            return self
        dropped = min(math.ceil((start - self.start) / BUCKET_SECONDS - 1e-9), len(self.values))
        return DemandHistory(self.start + dropped * BUCKET_SECONDS, self.values[dropped:])

    def record(self, now: float, demand: float) -> DemandHistory:
        """This history with ``demand`` (replicas) decided at ``now`` (seconds).

        A bucket keeps the largest demand decided in it; buckets skipped since the last
        decision hold the last value; a gap of ``MAX_GAP_SECONDS`` or more starts afresh; a
        ``now`` before the last bucket (the clock stepped back) counts in the last bucket.

        Raises:
            ValueError: ``demand`` is negative or not finite.
        """
        if not (math.isfinite(demand) and demand >= 0):
            raise ValueError(f"demand must be a finite number of replicas >= 0, got {demand!r}")
        if not self.values or now - self.end >= MAX_GAP_SECONDS:
            return DemandHistory(now, (demand,))
        index = max(int((now - self.start) // BUCKET_SECONDS), len(self.values) - 1)
        values = list(self.values)
        values += [values[-1]] * (index + 1 - len(values))
        values[index] = max(values[index], demand) if index < len(self.values) else demand
        dropped = max(0, len(values) - round(HISTORY_SECONDS / BUCKET_SECONDS))
        return DemandHistory(self.start + dropped * BUCKET_SECONDS, tuple(values[dropped:]))


@dataclass(frozen=True)
class Prediction:
    """What the forecast expects over the coming horizon.

    Attributes:
        period_seconds: the period of the recurring bursts.
        autocorrelation: the onsets' ``r`` at that period (about 0..1: normalized per lag, it
            can pass 1 slightly).
        replicas: the largest demand forecast over the horizon, replicas (not rounded).
        eta_seconds: seconds from now until the forecast first reaches ``replicas``.
    """

    period_seconds: float
    autocorrelation: float
    replicas: float
    eta_seconds: float


def onset_strength(values: Sequence[float]) -> np.ndarray:
    """How much ``values`` rose around each sample (step 2 of the module docstring).

    Returns:
        float64 array ``[len(values) - ONSET_BUCKETS]`` (empty for a shorter series):
        element ``i`` sums ``max(0, values[j + 1] - values[j])`` for ``j`` in
        ``i .. i + ONSET_BUCKETS - 1``.
    """
    if len(values) <= ONSET_BUCKETS:
        return np.zeros(0)
    rises = np.maximum(np.diff(np.asarray(values, dtype=np.float64)), 0.0)
    return np.convolve(rises, np.ones(ONSET_BUCKETS), mode="valid")


def detect_period(series: Sequence[float], min_lag: int) -> tuple[int, float] | None:
    """The period of ``series`` by autocorrelation (step 3 of the module docstring).

    Args:
        series: an evenly spaced series, oldest first.
        min_lag: the shortest period to consider, in samples.

    Returns:
        ``(lag in samples, autocorrelation at it)``, or None when the series is constant, too
        short to hold ``min_lag`` twice, or has no significant peak.

    Raises:
        ValueError: ``min_lag`` < 1.
    """
    if min_lag < 1:
        raise ValueError(f"min_lag must be >= 1, got {min_lag}")
    x = np.asarray(series, dtype=np.float64)
    n = len(x)
    longest = n // 2
    if longest < min_lag:
        return None
    deviations = x - x.mean()
    variance = float(np.dot(deviations, deviations)) / n
    if variance <= 1e-12:
        return None
    # r[k] for k = 0 .. longest + 1: one lag past the longest to see whether it is a peak.
    r = np.array(
        [
            float(np.dot(deviations[: n - k], deviations[k:])) / (n - k) / variance
            for k in range(min(longest + 1, n - 1) + 1)
        ]
    )
    below_zero = np.flatnonzero(r < 0)
    if len(below_zero) == 0:
        return None
    for k in range(max(min_lag, int(below_zero[0])), longest + 1):
        peak = r[k] >= r[k - 1] and (k + 1 >= len(r) or r[k] >= r[k + 1])
        if peak and r[k] >= max(MIN_AUTOCORRELATION, SIGNIFICANCE / math.sqrt(n - k)):
            return k, float(r[k])
    return None


def seasonal_naive_peak(
    history: DemandHistory, period_seconds: float, start: float, end: float
) -> tuple[float, float] | None:
    """The largest seasonal-naive forecast of demand over ``[start, end]`` (step 4).

    Args:
        history: the demand history.
        period_seconds: the period, seconds.
        start: first time of the horizon, seconds.
        end: last time of the horizon, seconds (>= ``start``).

    Returns:
        ``(replicas, when)``: the largest demand recorded one period before any time of the
        horizon (one bucket either side), and the first time of the horizon with that
        forecast; None when no time of the horizon has its period-ago bucket in the history.
    """
    peak: tuple[float, float] | None = None
    steps = max(0, math.ceil((end - start) / BUCKET_SECONDS))
    for step in range(steps + 1):
        t = min(start + step * BUCKET_SECONDS, end)
        index = math.floor((t - period_seconds - history.start) / BUCKET_SECONDS)
        if not 0 <= index < len(history.values):
            continue
        seen = max(history.values[max(index - 1, 0) : index + 2])
        if peak is None or seen > peak[0]:
            peak = (seen, t)
    return peak


def predict(history: DemandHistory, now: float, horizon_seconds: float) -> Prediction | None:
    """The recurring burst's demand over ``[now, now + horizon_seconds]``, or None when the
    history shows no recurring burst (then the autoscaler is purely reactive).

    Args:
        history: the demand history, recorded up to ``now``.
        now: the current time, seconds.
        horizon_seconds: how far ahead, seconds: a pod's start-up time plus a tick.

    Raises:
        ValueError: ``horizon_seconds`` is negative.
    """
    if horizon_seconds < 0:
        raise ValueError(f"horizon_seconds must be >= 0, got {horizon_seconds!r}")
    min_lag = math.ceil(MIN_PERIOD_SECONDS / BUCKET_SECONDS)
    found = detect_period(onset_strength(history.values), min_lag)
    if found is None:
        return None
    lag, correlation = found
    if max(history.values[-lag:]) < BURST_RATIO * _level(history, lag):
        return None
    period = lag * BUCKET_SECONDS
    peak = seasonal_naive_peak(history, period, now, now + horizon_seconds)
    if peak is None:
        return None
    replicas, when = peak
    return Prediction(period, correlation, replicas, when - now)


def _level(history: DemandHistory, lag: int) -> float:
    """The demand's level over the last ``lag`` buckets (their median): what a burst rises
    ``BURST_RATIO`` times above."""
    return float(np.median(history.values[-lag:]))


def burst_ceiling(
    history: DemandHistory,
    period_seconds: float,
    now: float,
    startup_seconds: float,
    observed: float,
) -> float | None:
    """The most replicas worth asking for now, when the forecast burst ends before new pods
    would be ready (step 5 of the module docstring); None when no such limit applies.

    Pods asked for now serve from ``now + startup_seconds``; the limit is the seasonal-naive
    forecast over ``[now + startup_seconds, now + startup_seconds + BUCKET_SECONDS]``. It
    applies only when (1) the burst ends first: that forecast is at most ``1 / BURST_RATIO``
    of the forecast for ``now``; and (2) the load seen now is the forecast one: ``observed``
    is at most ``forecast(now) * SURGE_TOLERANCE + SURGE_SLACK_REPLICAS``. A surge above the
    forecast, or a load that stays, is left to the reactive rules.

    Args:
        history: the demand history, recorded up to ``now``.
        period_seconds: the period of the bursts (from :func:`predict`).
        now: the current time, seconds.
        startup_seconds: how long a pod asked for now takes to be ready, seconds.
        observed: the replicas the load seen now needs (what ``history`` records).

    Returns:
        Replicas (not rounded), or None.
    """
    expected = seasonal_naive_peak(history, period_seconds, now, now)
    ready = now + startup_seconds
    later = seasonal_naive_peak(history, period_seconds, ready, ready + BUCKET_SECONDS)
    if expected is None or later is None:
        return None
    ends_first = later[0] * BURST_RATIO <= expected[0]
    foreseen = observed <= expected[0] * SURGE_TOLERANCE + SURGE_SLACK_REPLICAS
    return later[0] if ends_first and foreseen else None


@dataclass(frozen=True)
class ExpectedBurst:
    """A burst the forecast expects, checked once its time has passed (step 6).

    Attributes:
        start: first time the forecast is at its peak, seconds.
        end: last time, from ``start`` on, that the forecast is above ``1 / BURST_RATIO`` of
            its peak, seconds.
        replicas: the forecast peak, replicas.
        basis: a time just before the burst the forecast was read from (``start`` less a
            period and ``ONSET_BUCKETS`` buckets, so that its rise is kept): on a miss, the
            history before it stops counting.
    """

    start: float
    end: float
    replicas: float
    basis: float


@dataclass(frozen=True)
class ForecastMemory:
    """What the verification (step 6) keeps between decisions; start from ``ForecastMemory()``.

    Attributes:
        expected: the burst forecast and not yet checked, or None.
        since: periods are detected and bursts forecast only from the history recorded from
            this time on (seconds), set by the last miss; None: the whole history counts.
    """

    expected: ExpectedBurst | None = None
    since: float | None = None


def expected_burst(
    history: DemandHistory, period_seconds: float, now: float, horizon_seconds: float
) -> ExpectedBurst | None:
    """The burst the seasonal-naive forecast expects within ``[now, now + horizon_seconds]``,
    or None when the forecast over it stays below ``BURST_RATIO`` times the level (the median
    of the last period): no burst is due, only the level.

    Args:
        history: the demand history the period was detected on.
        period_seconds: the period (from :func:`predict`).
        now: the current time, seconds.
        horizon_seconds: how far ahead, seconds.
    """
    peak = seasonal_naive_peak(history, period_seconds, now, now + horizon_seconds)
    lag = round(period_seconds / BUCKET_SECONDS)
    if peak is None or peak[0] < BURST_RATIO * _level(history, lag):
        return None
    replicas, start = peak
    end = start
    while end < start + period_seconds:
        later = seasonal_naive_peak(
            history, period_seconds, end + BUCKET_SECONDS, end + BUCKET_SECONDS
        )
        if later is None or later[0] * BURST_RATIO <= replicas:
            break
        end += BUCKET_SECONDS
    basis = start - period_seconds - ONSET_BUCKETS * BUCKET_SECONDS
    return ExpectedBurst(start, end, replicas, basis)


def burst_missed(history: DemandHistory, expected: ExpectedBurst) -> bool | None:
    """Whether the expected burst failed to come (step 6).

    Returns:
        None while its window (plus a bucket, for the metric windows' lag) is not over; True
        when the demand recorded from a bucket before ``expected.start`` to a bucket after
        ``expected.end`` stayed at or below ``1 / BURST_RATIO`` of ``expected.replicas``;
        False when it rose above, or when the history does not hold the window (a gap
        restarted it: nothing to judge).
    """
    if history.end <= expected.end + BUCKET_SECONDS:
        return None
    first = max(math.floor((expected.start - history.start) / BUCKET_SECONDS) - 1, 0)
    last = math.floor((expected.end - history.start) / BUCKET_SECONDS) + 1
    seen = history.values[first : last + 1]
    return bool(seen) and max(seen) * BURST_RATIO <= expected.replicas


def verified_predict(
    history: DemandHistory, memory: ForecastMemory, now: float, horizon_seconds: float
) -> tuple[Prediction | None, ForecastMemory]:
    """:func:`predict` on the history the verification still trusts (step 6).

    In order: the expected burst, once its window is over, is checked (:func:`burst_missed`;
    a miss moves ``since`` to its ``basis``); the prediction is made from the history since
    ``since``; when none is awaited, the burst it forecasts over the horizon (if any) is.

    Args:
        history: the demand history, recorded up to ``now``.
        memory: the previous call's (``ForecastMemory()`` the first time).
        now: the current time, seconds.
        horizon_seconds: how far ahead, seconds.

    Returns:
        ``(prediction or None, memory for the next call)``.
    """
    expected, since = memory.expected, memory.since
    if expected is not None and (missed := burst_missed(history, expected)) is not None:
        if missed:
            since = max(expected.basis, since if since is not None else -math.inf)
        expected = None
    trusted = history.since(since)
    prediction = predict(trusted, now, horizon_seconds)
    if prediction is not None and expected is None:
        expected = expected_burst(trusted, prediction.period_seconds, now, horizon_seconds)
    return prediction, ForecastMemory(expected, since)
