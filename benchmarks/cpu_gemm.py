"""The linear layers' matrix multiply on the CPU: oneDNN with a packed weight against kvpilot's
GEMM kernel (``kvpilot.kernels.cpu.gemm``), float32.

For each batch size ``M`` of ``--rows``, the linear layers of ``--layers`` decoder layers of a
model shape (SmolLM2-135M's by default: qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536, each layer its own weights, so that as in a real step the weights stream from memory
rather than sit in a cache), then its LM head (``--vocab`` x hidden): best wall time of
``--repeats`` passes after one warm-up, at ``--threads`` torch threads pinned to the first
cores, in GFLOP/s. Also checks that each of kvpilot's rows equals the same row computed alone.

    python benchmarks/cpu_gemm.py --threads 1
    python benchmarks/cpu_gemm.py --threads 2 --hidden 4096 --intermediate 14336 --heads 32 \\
        --kv-heads 8 --layers 2 --vocab 0      # a Llama-3-8B layer

Takes about a minute.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from kvpilot.kernels.cpu import gemm
from kvpilot.machine import describe_machine


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152, help="LM head rows (0: none)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", default="1,4,8,16,32,64,256,2048", help="batch sizes M")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    return parser.parse_args()


def shapes(args: argparse.Namespace) -> list[tuple[int, int]]:
    """``(out_features, in_features)`` of one decoder layer's linear layers."""
    q, kv = args.heads * args.head_dim, args.kv_heads * args.head_dim
    return [
        (q + 2 * kv, args.hidden),
        (args.hidden, q),
        (2 * args.intermediate, args.hidden),
        (args.hidden, args.intermediate),
    ]


def best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    args = parse_args()
    os.sched_setaffinity(0, set(range(args.threads)))
    torch.set_num_threads(args.threads)
    if not gemm.available():
        raise SystemExit("the CPU GEMM kernel is not available here (needs AVX-512)")
    print(f"machine: {describe_machine()}; threads: {args.threads}")
    layer = shapes(args) * args.layers + ([(args.vocab, args.hidden)] if args.vocab else [])
    weights = [torch.randn(n, k) for n, k in layer]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    packed = [gemm.pack_weight(w) for w in weights]
    del weights
    print(f"{len(layer)} matrices, {sum(n * k for n, k in layer) * 4 / 1e6:.0f} MB of weights")
    print(f"{'M':>6} {'oneDNN GFLOP/s':>15} {'kvpilot GFLOP/s':>16} {'kvpilot / oneDNN':>17}")
    for rows in (int(m) for m in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k) for _, k in layer}
        flops = sum(2 * rows * n * k for n, k in layer)

        def run_onednn(inputs=inputs):
            for (_, k), w in zip(layer, onednn, strict=True):
                torch.ops.mkldnn._linear_pointwise(inputs[k], w, None, "none", [], "")

        def run_kvpilot(inputs=inputs):
            for (_, k), w in zip(layer, packed, strict=True):
                gemm.packed_linear(inputs[k], w)

        t_onednn = best_time(run_onednn, args.repeats)
        t_kvpilot = best_time(run_kvpilot, args.repeats)
        x, w = inputs[layer[0][1]], packed[0]
        batch = gemm.packed_linear(x, w)
        assert all(
            torch.equal(batch[i], gemm.packed_linear(x[i : i + 1], w)[0]) for i in range(rows)
        )
        print(
            f"{rows:>6} {flops / t_onednn / 1e9:>15.1f} {flops / t_kvpilot / 1e9:>16.1f} "
            f"{t_onednn / t_kvpilot:>16.2f}x"
        )


if __name__ == "__main__":
    main()
