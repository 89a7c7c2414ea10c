"""One mixture-of-experts layer on the CPU: kvpilot's grouped path (``FusedMoE.forward_native``:
pairs sorted by expert, a grouped matmul for gate/up and one for down) against transformers 5's
``MixtralExperts`` with its ``eager`` (a loop over experts with tokens) and ``grouped_mm``
(``torch.nn.functional.grouped_mm``, transformers' default) implementations, on the same
weights and routing.

The shape is Qwen3-30B-A3B's MoE layer with fewer experts (hidden 2048, moe_intermediate 768,
top 8 of 32): what matters to the CPU cost is the pairs per expert, not the experts no token
chooses. Each cell is the median of ``--reps`` calls after one warm-up, in milliseconds; the
three take turns call by call.

Usage::

    python benchmarks/moe_layer.py [--threads 1] [--reps 5] [--tokens 1 16 256]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import transformers
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from kvpilot.engine.layers.fused_moe import FusedMoE, fused_topk

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 2048, 768, 32, 8


def interleaved_median_ms(layers: list[tuple], reps: int) -> list[float]:
    """Median ms of each ``(layer, args)``; the layers take turns call by call, so a load
    change on a shared machine hits them alike."""
    for layer, args in layers:
        layer(*args)
    times: list[list[float]] = [[] for _ in layers]
    for _ in range(reps):
        for (layer, args), cell in zip(layers, times, strict=True):
            start = time.perf_counter()
            layer(*args)
            cell.append(time.perf_counter() - start)
    return [1e3 * statistics.median(cell) for cell in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{args.threads} torch threads; torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )
    g = torch.Generator().manual_seed(0)
    ours = FusedMoE(EXPERTS, HIDDEN, INTERMEDIATE)
    ours.w13_weight.data = torch.randn(ours.w13_weight.shape, generator=g) * 0.02
    ours.w2_weight.data = torch.randn(ours.w2_weight.shape, generator=g) * 0.02
    theirs = {}
    for implementation in ("eager", "grouped_mm"):
        # One config each: the experts module reads its implementation from it at every call.
        config = transformers.MixtralConfig(
            hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS
        )
        config._experts_implementation = implementation
        experts = MixtralExperts(config)
        experts.gate_up_proj.data = ours.w13_weight.data
        experts.down_proj.data = ours.w2_weight.data
        theirs[implementation] = experts
    router = torch.randn(EXPERTS, HIDDEN, generator=g) * 0.02
    print(
        "| tokens | kvpilot grouped (ms) | transformers eager (ms) | transformers grouped_mm (ms) |"
    )
    print("| --- | --- | --- | --- |")
    with torch.no_grad():
        for num_tokens in args.tokens:
            hidden = torch.randn(num_tokens, HIDDEN, generator=g)
            weights, ids = fused_topk(hidden @ router.T, TOP_K, renormalize=True)
            expected = theirs["eager"](hidden, ids, weights)
            torch.testing.assert_close(ours(hidden, weights, ids), expected, atol=1e-5, rtol=1e-4)
            cells = interleaved_median_ms(
                [(ours, (hidden, weights, ids))]
                + [(theirs[name], (hidden, ids, weights)) for name in ("eager", "grouped_mm")],
                args.reps,
            )
            print(f"| {num_tokens} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
