"""The burst forecast with plain values: history, onsets, period detection, seasonal naive."""

import math
import random

import numpy as np
import pytest

from kvpilot.operator.forecast import (
    BUCKET_SECONDS,
    HISTORY_SECONDS,
    DemandHistory,
    ExpectedBurst,
    ForecastMemory,
    burst_ceiling,
    burst_missed,
    detect_period,
    onset_strength,
    predict,
    seasonal_naive_peak,
    verified_predict,
)

PERIOD = 300.0
BURST = 60.0


def bursts(t, base=2.0, peak=13.0, first=240.0, period=PERIOD):
    """The bursty trace's shape in replicas: ``peak`` for 60 s every ``period`` from ``first``."""
    return peak if t >= first and (t - first) % period < BURST else base


def history_of(demand, until, *, tick=BUCKET_SECONDS, start=0.0):
    history = DemandHistory()
    t = start
    while t <= until:
        history = history.record(t, demand(t))
        t += tick
    return history


def test_a_bucket_keeps_its_largest_demand_and_skipped_buckets_hold_the_last():
    history = DemandHistory().record(100.0, 3).record(105.0, 5).record(110.0, 4)
    assert (history.start, history.values) == (100.0, (5,))
    # Nothing decided in the next two buckets: they hold 5; the third gets the new value.
    history = history.record(100.0 + 3 * BUCKET_SECONDS, 1)
    assert history.values == (5, 5, 5, 1)
    # A clock that stepped back counts in the last bucket.
    assert history.record(90.0, 7).values == (5, 5, 5, 7)


def test_a_long_gap_starts_afresh_and_bad_demand_is_refused():
    history = DemandHistory().record(0.0, 3).record(15.0, 4)
    assert history.record(15.0 + 300.0, 2) == DemandHistory(315.0, (2,))
    with pytest.raises(ValueError, match="demand"):
        history.record(30.0, -1)
    with pytest.raises(ValueError, match="demand"):
        history.record(30.0, math.nan)


def test_memory_stays_bounded():
    history = history_of(lambda t: t // 60 % 7, 3 * 3600.0, tick=5.0)
    assert len(history.values) == HISTORY_SECONDS / BUCKET_SECONDS == 240
    # The newest bucket is the last decision's; the window slid forward.
    assert history.end == pytest.approx(3 * 3600.0 + BUCKET_SECONDS)
    assert history.start == pytest.approx(3 * 3600.0 + BUCKET_SECONDS - HISTORY_SECONDS)


def test_onsets_are_the_rises_summed_over_three_buckets():
    onsets = onset_strength([2, 2, 6, 9, 9, 3, 3, 4])
    # rises: 0, 4, 3, 0, 0, 0, 1 -> sums over 3: 7, 7, 3, 0, 1
    assert onsets.tolist() == [7, 7, 3, 0, 1]
    assert onset_strength([1, 2, 3]).size == 0


def test_periodic_bursts_are_found_with_their_period():
    rng = random.Random(3)
    values = [bursts(i * 15.0) + rng.choice((-1, 0, 0, 1)) for i in range(60)]
    lag, r = detect_period(onset_strength(values), 8)
    assert lag * BUCKET_SECONDS == PERIOD
    assert r > 0.8


@pytest.mark.parametrize(
    "name, values",
    [
        ("constant", [4.0] * 120),
        ("white noise", [4 + random.Random(5).gauss(0, 1) for _ in range(120)]),
        ("integer noise", [random.Random(6).choice((3, 4, 4, 5)) for _ in range(120)]),
        ("a rise then a fall", [min(i, 120 - i) / 6 for i in range(120)]),
        ("too short for two periods", [bursts(i * 15.0) for i in range(38)]),
    ],
)
def test_aperiodic_series_have_no_period(name, values):
    assert detect_period(onset_strength(values), 8) is None, name


def test_a_ramp_in_regular_steps_is_no_burst():
    # +1 replica every 3 minutes: the rises recur exactly, but nothing bursts.
    steps = DemandHistory(0.0, tuple(2 + i // 12 for i in range(120)))
    assert detect_period(onset_strength(steps.values), 8) is not None
    assert predict(steps, steps.end, 135.0) is None


def test_detect_period_refuses_a_zero_lag():
    with pytest.raises(ValueError, match="min_lag"):
        detect_period([1.0, 2.0], 0)


def test_the_next_burst_is_forecast_one_startup_time_ahead():
    # Bursts at 240, 540, 840, ...; a pod takes 120 s to start; decisions every 15 s.
    startup, horizon = 120.0, 120.0 + BUCKET_SECONDS
    history, t, first = DemandHistory(), 0.0, None
    while first is None and t < 840.0:
        history = history.record(t, bursts(t))
        prediction = predict(history, t, horizon)
        if prediction is not None and prediction.replicas >= 13.0:
            first = t, prediction
        t += BUCKET_SECONDS
    when, prediction = first
    # Asked for one start-up time (plus a tick and a bucket of slack) before the burst: the
    # pods are ready when it comes, not a period early.
    assert 840.0 - startup - 2 * BUCKET_SECONDS <= when <= 840.0 - startup
    assert prediction.period_seconds == PERIOD
    assert 840.0 - 2 * BUCKET_SECONDS <= when + prediction.eta_seconds <= 840.0
    assert prediction.autocorrelation >= 0.6
    # Between bursts the forecast is the base load.
    assert predict(history, 660.0, horizon).replicas == 2.0


def test_seasonal_naive_reads_one_period_back_with_a_bucket_of_slack():
    history = DemandHistory(0.0, (1, 1, 1, 8, 1, 1, 1, 1, 1, 1))
    period = 4 * BUCKET_SECONDS  # the 8 sat at 45..60 s, so it is due at 105..120 s
    assert seasonal_naive_peak(history, period, 150.0, 165.0) == (1, 150.0)
    # Due at 105 s; with a bucket of slack either side, forecast from 90 s.
    assert seasonal_naive_peak(history, period, 60.0, 120.0) == (8, 90.0)
    # No time of the horizon has a period-ago bucket in the history.
    assert seasonal_naive_peak(history, period, 500.0, 520.0) is None


def test_a_negative_horizon_is_refused():
    with pytest.raises(ValueError, match="horizon"):
        predict(DemandHistory(), 0.0, -1.0)


def test_numpy_and_the_docstring_formula_agree():
    values = np.array([bursts(i * 15.0) for i in range(80)])
    x = onset_strength(values)
    lag, r = detect_period(x, 8)
    d = x - x.mean()
    expected = (d[:-lag] @ d[lag:]) / (len(x) - lag) / (d @ d / len(x))
    assert r == pytest.approx(expected)


def test_a_burst_that_ends_before_new_pods_are_ready_caps_them_at_the_forecast():
    history = history_of(bursts, 870.0)  # in the third burst (840..900 s)
    # Pods asked for at 870 s are ready at 990 s, when the forecast is the base load again.
    assert burst_ceiling(history, PERIOD, 870.0, 120.0, observed=13.0) == 2.0
    # Up to 1.25 x the forecast for now + 1 replica is the forecast burst; above, a surge.
    assert burst_ceiling(history, PERIOD, 870.0, 120.0, observed=17.25) == 2.0
    assert burst_ceiling(history, PERIOD, 870.0, 120.0, observed=17.5) is None
    # Pods that start in 30 s are ready within the burst: no cap.
    assert burst_ceiling(history, PERIOD, 870.0, 30.0, observed=13.0) is None
    # Before a burst the load rises, it does not fall back: no cap.
    assert burst_ceiling(history_of(bursts, 800.0), PERIOD, 800.0, 120.0, observed=2.0) is None
    # No period-ago bucket for the pods' time: no cap.
    assert burst_ceiling(history, 3000.0, 870.0, 120.0, observed=13.0) is None


def test_since_keeps_the_buckets_that_begin_at_or_after_a_time():
    history = DemandHistory(100.0, (1, 2, 3, 4))
    assert history.since(130.0) == history.since(125.0) == DemandHistory(130.0, (3, 4))
    assert history.since(None) == history.since(50.0) == history
    assert history.since(1000.0) == DemandHistory(160.0, ())


def test_a_burst_is_missed_when_the_demand_stays_at_half_its_forecast_or_below():
    # The burst was forecast at 45..90 s (13 replicas); it is judged from 30 s to 105 s.
    expected = ExpectedBurst(start=45.0, end=90.0, replicas=13.0, basis=0.0)
    came = DemandHistory(0.0, (2, 2, 2, 13, 13, 13, 13, 2, 2, 2))
    assert burst_missed(came, expected) is False
    assert burst_missed(DemandHistory(0.0, (2,) * 10), expected) is True
    # Half the forecast (6.5) is no burst; a bucket above it is.
    assert burst_missed(DemandHistory(0.0, (2, 2, 6.5, 2, 2, 2, 2, 6.5, 2, 2)), expected) is True
    assert burst_missed(DemandHistory(0.0, (2, 2, 7, 2, 2, 2, 2, 2, 2, 2)), expected) is False
    # Outside the window (one bucket either side) does not count.
    assert burst_missed(DemandHistory(0.0, (13, 2, 2, 2, 2, 2, 2, 2, 13, 2)), expected) is True
    # Not judged before a bucket after the window is recorded.
    assert burst_missed(DemandHistory(0.0, (2,) * 7), expected) is None
    # A gap restarted the history after the window: nothing to judge.
    assert burst_missed(DemandHistory(600.0, (2,)), expected) is False


def forecasts(demand, until):
    """``verified_predict`` every 15 s against ``demand(t)``, 135 s ahead: the memory after
    each call and the forecast bursts, as ``(time, period, due)``."""
    history, memory, memories, predicted = DemandHistory(), ForecastMemory(), [], []
    t = 0.0
    while t <= until:
        history = history.record(t, demand(t))
        prediction, memory = verified_predict(history, memory, t, 135.0)
        memories.append((t, memory))
        if prediction is not None and prediction.replicas >= 13.0:
            predicted.append((t, prediction.period_seconds, t + prediction.eta_seconds))
        t += BUCKET_SECONDS
    return memories, predicted


def test_a_burst_that_comes_keeps_the_period():
    memories, predicted = forecasts(bursts, 1800.0)
    expected = [m.expected for _, m in memories if m.expected is not None]
    # The third burst (840..900 s) is awaited from 690 s: forecast from 825 s (a bucket of
    # slack) to 900 s, 13 replicas, read from the burst one period before.
    assert expected[0] == ExpectedBurst(start=825.0, end=900.0, replicas=13.0, basis=480.0)
    # Four bursts awaited and checked, all came: the whole history still counts.
    assert sorted({e.start for e in expected}) == [825.0, 1125.0, 1425.0, 1725.0]
    assert all(m.since is None for _, m in memories)
    assert [p for p in predicted if p[0] == 1590.0] == [(1590.0, PERIOD, 1725.0)]


def changing(t):
    """Bursts every 300 s from 240 s to the one at 1740 s, then every 420 s."""
    return bursts(t) if t < 1800.0 else bursts(t, first=1740.0, period=420.0)


def test_a_missed_burst_drops_the_old_period_and_the_new_one_is_learned_from_two_bursts():
    memories, predicted = forecasts(changing, 3600.0)
    since = dict(memories)
    # The burst due at 2040 s (300 s after the last old one) did not come: judged at 2115 s,
    # the history before the last burst of the old period (1740 s, less 60 s) stops counting.
    assert since[2100.0].since is None and since[2115.0].since == 1680.0
    after = [p for p in predicted if p[0] > 2115.0]
    # No forecast from the old period after the miss (without the check it would forecast
    # the old phase, 300 s after each new burst: 2460 s, 2880 s).
    assert {period for _, period, _ in after} == {420.0}
    # The new bursts come at 2160, 2580, 3000 s; the two first teach the period (found at
    # 2550 s, too late to start pods for 2580 s); the third gets its pods a start-up time
    # ahead.
    assert after[0] == (2550.0, 420.0, 2565.0)
    timely = [p for p in after if p[2] - p[0] >= 120.0]
    assert timely[0] == (2850.0, 420.0, 2985.0)


def one_off_spikes(t):
    """Two spikes of 13 replicas, 600 s apart, never again."""
    return 13.0 if 600.0 <= t < 660.0 or 1200.0 <= t < 1260.0 else 2.0


def test_two_one_off_spikes_give_one_phantom_forecast_and_the_miss_ends_it():
    memories, predicted = forecasts(one_off_spikes, 3600.0)
    # The spikes make a 600 s period: one phantom burst forecast, due at 1785 s.
    ahead = [p for p in predicted if p[2] - p[0] >= 120.0]
    assert {due for _, _, due in ahead} == {1785.0}
    # It did not come: from then on only the second spike counts, and one spike is no period.
    assert dict(memories)[3600.0] == ForecastMemory(expected=None, since=1140.0)
    assert not [p for p in predicted if p[0] > 1875.0]
