"""Trace-driven autoscaling simulation: kvpilot's policy against four baselines.

    .venv/bin/python benchmarks/autoscaling_sim/run.py [--duration 1800] [--rate 40] [--seed 0]

Prints one Markdown table per trace (TTFT SLO attainment, TTFT quantiles, replica-hours,
peak replicas) for kvpilot cold (nothing learned yet) and with the replica capacity it learned
on a warm-up trace (what a running operator keeps in status), and the check of the target: the SLO met at least as often as the best
baseline with at least 20% fewer replica-hours, never above the GPU budget. Deterministic for
a seed. Replica capacity comes from kvpilot's planner; step-time coefficients are
``ReplicaModel``'s defaults (assumed for an H100, derived in docs/benchmarks.md) unless
``--step-base``/``--per-batch-token``/``--per-context-token`` give the ones ``calibrate.py``
measured on a device.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time

from fleet import Result, simulate
from policies import AibrixKpa, HpaCpu, KedaWaiting, KubeAI, Kvpilot
from replica import ReplicaModel
from traces import TRACES, make_trace

from kvpilot.engine.model_shape import ModelShape
from kvpilot.operator.autoscaler import AutoscalingPolicy
from kvpilot.operator.gpus import CATALOGUE
from kvpilot.operator.planner import plan

# Llama-3.1-8B-Instruct's config.json (the sizes the planner reads).
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
MAX_MODEL_LEN = 32768
REPLICA_RPS = 11.0
"""Chat requests/s one replica serves at 70% of its saturation rate (16/s, measured with
``replica.py`` on the steady trace's mix)."""
GPU = "H100-80GB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds per trace")
    parser.add_argument("--rate", type=float, default=40.0, help="mean chat requests/s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo", type=float, default=2.0, help="TTFT SLO, seconds")
    parser.add_argument("--max-replicas", type=int, default=16, help="= GPU budget (TP 1)")
    parser.add_argument("--startup", type=float, default=120.0, help="pod start, seconds")
    parser.add_argument("--traces", nargs="*", default=list(TRACES), choices=TRACES)
    assumed = ReplicaModel(kv_capacity_tokens=1)
    parser.add_argument(
        "--step-base",
        type=float,
        default=assumed.step_base,
        help="seconds per step (calibrate.py prints it for a device)",
    )
    parser.add_argument(
        "--per-batch-token",
        type=float,
        default=assumed.per_batch_token,
        help="seconds per scheduled token",
    )
    parser.add_argument("--per-context-token", type=float, default=assumed.per_context_token,
                        help="seconds per cached token attended to")  # fmt: skip
    args = parser.parse_args(argv)

    sized = plan(
        ModelShape.from_hf_config(LLAMA_3_1_8B), gpu=CATALOGUE[GPU], max_model_len=MAX_MODEL_LEN
    )
    model = ReplicaModel(
        kv_capacity_tokens=sized.kv_capacity_tokens,
        max_num_seqs=sized.max_num_seqs,
        max_num_batched_tokens=sized.max_num_batched_tokens,
        step_base=args.step_base,
        per_batch_token=args.per_batch_token,
        per_context_token=args.per_context_token,
        startup_seconds=args.startup,
    )
    budget = args.max_replicas * sized.gpus_per_replica
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"machine: {platform.platform()}, Python {platform.python_version()}")
    print(
        f"replica: Llama-3.1-8B bf16 on 1 x {GPU}, max_model_len {MAX_MODEL_LEN}: "
        f"{model.kv_capacity_tokens} KV tokens (planner), max_num_seqs {model.max_num_seqs}, "
        f"step = {model.step_base * 1e3:g} ms + {model.per_batch_token * 1e6:g} us/token + "
        f"{model.per_context_token * 1e6:g} us/cached token, start-up {model.startup_seconds:g} s"
    )
    print(
        f"traces: {args.duration:g} s, mean chat rate {args.rate:g}/s, seed {args.seed}; "
        f"TTFT SLO {args.slo:g} s; 1..{args.max_replicas} replicas; GPU budget {budget}\n"
    )

    low, high = 1, args.max_replicas
    ours = AutoscalingPolicy(min_replicas=low, max_replicas=high, gpu_budget=budget)
    learned = _learned_capacity(ours, model, args)
    print(f"kvpilot's learned replica capacity (warm-up): {learned:.0f} tokens/s\n")

    def policies():
        return [
            Kvpilot(ours, model.max_num_seqs, model.startup_seconds, name="kvpilot (cold)"),
            Kvpilot(
                ours,
                model.max_num_seqs,
                model.startup_seconds,
                replica_tokens_per_second=learned,
            ),
            HpaCpu(low, high),
            KedaWaiting(low, high),
            KubeAI(low, high),
            AibrixKpa(low, high),
        ]

    verdicts = []
    for trace in args.traces:
        results: list[Result] = []
        for policy in policies():
            requests = make_trace(trace, duration=args.duration, rate=args.rate, seed=args.seed,
                                  max_model_len=MAX_MODEL_LEN)  # fmt: skip
            started = time.perf_counter()
            result = simulate(
                trace,
                requests,
                policy,
                model,
                duration=args.duration,
                initial_replicas=_initial_replicas(requests, args.max_replicas),
            )
            print(f"  {trace} / {policy.name}: simulated in {time.perf_counter() - started:.1f}s",
                  file=sys.stderr)  # fmt: skip
            results.append(result)
        verdicts.append(_table(trace, results, args.slo, budget))
    print("| trace | kvpilot SLO | best baseline (SLO) | replica-hours vs it | target met |")
    print("| --- | --- | --- | --- | --- |")
    for line in verdicts:
        print(line)
    return 0


def _learned_capacity(policy: AutoscalingPolicy, model: ReplicaModel, args) -> float:
    """What kvpilot learns about a replica on a day before: a 15-minute diurnal warm-up trace
    (another seed), whose rise saturates the fleet once."""
    warm = Kvpilot(policy, model.max_num_seqs, model.startup_seconds)
    requests = make_trace("diurnal", duration=900.0, rate=args.rate, seed=args.seed + 1000,
                          max_model_len=MAX_MODEL_LEN)  # fmt: skip
    simulate("warm-up", requests, warm, model, duration=900.0)
    if warm.memory.replica_tokens_per_second is None:
        raise SystemExit("the warm-up never saturated a replica: raise --rate")
    return warm.memory.replica_tokens_per_second


def _initial_replicas(requests, max_replicas: int) -> int:
    """Every policy starts from the replicas the first minute's rate needs at
    ``REPLICA_RPS`` requests/s each, as if the fleet had been serving before the trace."""
    first_minute = sum(1 for r in requests if r.arrival < 60.0) / 60.0
    return max(1, min(max_replicas, math.ceil(first_minute / REPLICA_RPS)))


def _table(trace: str, results: list[Result], slo: float, budget: int) -> str:
    print(f"### {trace} ({len(results[0].requests)} requests)\n")
    print("| policy | TTFT <= SLO | TTFT p50 (s) | TTFT p99 (s) | replica-hours | peak replicas |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        p99 = r.ttft_quantile(0.99)
        print(
            f"| {r.policy} | {r.slo_attainment(slo):.1%} | {r.ttft_quantile(0.5):.2f} | "
            f"{'unserved' if p99 == float('inf') else f'{p99:.2f}'} | {r.replica_hours:.2f} | "
            f"{r.peak_replicas} |"
        )
    print()
    ours, baselines = results[1], results[2:]
    best = max(baselines, key=lambda r: (r.slo_attainment(slo), -r.replica_hours))
    saving = 1 - ours.replica_hours / best.replica_hours
    met = (
        ours.slo_attainment(slo) >= best.slo_attainment(slo)
        and saving >= 0.2
        and all(r.peak_replicas <= budget for r in results)
    )
    return (
        f"| {trace} | {ours.slo_attainment(slo):.1%} | {best.policy} "
        f"({best.slo_attainment(slo):.1%}) | {-saving:+.0%} | {'yes' if met else 'no'} |"
    )


if __name__ == "__main__":
    sys.exit(main())
