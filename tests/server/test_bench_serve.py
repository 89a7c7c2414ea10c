"""benchmarks/serve.py's metric definitions (vLLM ``bench serve``) on hand-made results."""

from __future__ import annotations

import importlib.util
import pathlib
import statistics
import sys

import pytest

_PATH = pathlib.Path(__file__).parents[2] / "benchmarks" / "serve.py"
_SPEC = importlib.util.spec_from_file_location("kvpilot_bench_serve", _PATH)
bench = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = bench  # dataclasses look their module up while the file runs
_SPEC.loader.exec_module(bench)


def result(ttft, latency, output_tokens, itl, prompt_len=10):
    return bench.RequestResult(
        success=True,
        prompt_len=prompt_len,
        output_tokens=output_tokens,
        ttft=ttft,
        latency=latency,
        itl=itl,
    )


def test_summary_follows_vllm_definitions():
    results = [
        result(0.5, 2.5, 5, [0.5, 0.5, 0.5, 0.5]),  # TPOT (2.5 - 0.5) / 4 = 0.5 s
        result(1.5, 2.0, 2, [0.5]),  # TPOT 0.5 s
        bench.RequestResult(error="HTTP 503"),
    ]
    slos = bench.parse_slos(["ttft:1000", "tpot:600"])
    summary = bench.summarize(results, duration=4.0, slos=slos, percentiles=[50, 99])
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["total_output_tokens"] == 7
    assert summary["request_throughput"] == 0.5
    assert summary["output_throughput"] == 7 / 4
    assert summary["total_token_throughput"] == (7 + 20) / 4
    assert summary["mean_ttft_ms"] == pytest.approx(1000.0)
    assert summary["p50_ttft_ms"] == pytest.approx(1000.0)
    assert summary["mean_tpot_ms"] == pytest.approx(500.0)
    assert summary["mean_itl_ms"] == pytest.approx(500.0)
    assert summary["p99_e2el_ms"] == pytest.approx(2495.0)
    assert summary["goodput"] == 1 / 4  # only the first meets TTFT <= 1 s


def test_poisson_gaps_have_the_requested_mean_and_inf_means_all_at_once():
    gaps = bench.arrival_gaps(4000, rate=4.0, burstiness=1.0, seed=0)
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.1)  # exponential: sd == mean
    assert bench.arrival_gaps(3, rate=float("inf"), burstiness=1.0, seed=0) == [0.0] * 3


@pytest.mark.parametrize("item", ["latency:100", "ttft", "ttft:-1"])
def test_bad_slos_are_named(item):
    with pytest.raises(ValueError, match="--goodput"):
        bench.parse_slos([item])
