"""GPU check of the quantized-weight matmul kernels (``kvpilot.kernels.int4_matmul``,
``kvpilot.kernels.fp8_matmul``), in one run of a few minutes on one CUDA device.

1. Correctness against their PyTorch references (``kvpilot.kernels.quant_reference``) in
   bfloat16 at Llama-3-8B's projection shapes.
2. Time (median of ``--reps``, ``triton.testing.do_bench``, L2 flushed) and TFLOP/s of each
   format beside the dense ``torch.matmul`` (bf16 on a GPU) of the same shape and, for per-channel fp8,
   ``torch._scaled_mm`` (cuBLASLt, what vLLM's CUTLASS path stands for), for batches of 1 to
   4096 tokens. The fp8 rows include the dynamic per-token (or 1x128) activation quantization,
   as the engine runs it.

Usage::

    python benchmarks/quant_gpu.py [--out results.json] [--reps 50]
    python benchmarks/quant_gpu.py --smoke     # tiny shapes, any device (the interpreter on CPU)

Prints the command, the machine and Markdown tables for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from kernels_gpu import machine_info, print_table  # noqa: E402

from kvpilot.kernels import quant_reference  # noqa: E402
from kvpilot.kernels.fp8_matmul import fp8_scaled_mm  # noqa: E402
from kvpilot.kernels.int4_matmul import int4_gemm  # noqa: E402

FP8 = torch.float8_e4m3fn
# (name, K, N): Llama-3-8B's stacked q/k/v, gate/up and down projections.
LLAMA3_8B = (("qkv", 4096, 6144), ("gate_up", 4096, 28672), ("down", 14336, 4096))
SMOKE = (("tiny", 128, 96),)


def int4_operands(k: int, n: int, device: torch.device, dtype: torch.dtype):
    qweight = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device=device)
    scales = (torch.rand(n, k // 128, device=device) * 0.01).to(dtype)
    zeros = torch.randint(0, 16, (n, k // 128), dtype=torch.uint8, device=device)
    return qweight, scales, zeros


def fp8_operands(k: int, n: int, device: torch.device, block: tuple[int, int]):
    weight = torch.randn(n, k, device=device).to(FP8)
    scales = torch.rand(-(-n // block[0]), -(-k // block[1]), device=device) * 0.01
    return weight, scales


def check(shapes, dtype: torch.dtype, device: torch.device) -> list[dict]:
    rows = []
    for name, k, n in shapes:
        x = torch.randn(64, k, device=device, dtype=dtype)
        qweight, scales, zeros = int4_operands(k, n, device, dtype)
        got = int4_gemm(x, qweight, scales, zeros, None, 128).float()
        ref = quant_reference.int4_gemm(x.float(), qweight, scales.float(), zeros, None, 128)
        rows.append({"format": "int4", "shape": name, "max_rel_err": rel(got, ref)})
        for label, block, group in (("fp8 channel", (1, k), None), ("fp8 block", (128, 128), 128)):
            weight, w_scales = fp8_operands(k, n, device, block)
            x_q, x_scales = quant_reference.quantize_fp8_dynamic(x, group)
            got = fp8_scaled_mm(x_q, x_scales, weight, w_scales, block, dtype).float()
            ref = quant_reference.fp8_scaled_mm(
                x_q, x_scales, weight, w_scales, block, torch.float32
            )
            rows.append({"format": label, "shape": name, "max_rel_err": rel(got, ref)})
    return rows


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


def candidates(x: torch.Tensor, w: dict, dtype: torch.dtype) -> dict:
    """The timed calls on activations ``x`` ``[M, K]`` with the weights ``w`` of one shape."""
    k = x.shape[1]

    def fp8_channel():
        x_q, x_s = quant_reference.quantize_fp8_dynamic(x, None)
        return fp8_scaled_mm(x_q, x_s, w["fp8"], w["channel"], (1, k), dtype)

    def fp8_block():
        x_q, x_s = quant_reference.quantize_fp8_dynamic(x, 128)
        return fp8_scaled_mm(x_q, x_s, w["fp8"], w["block"], (128, 128), dtype)

    def scaled_mm_peer():
        x_q, x_s = quant_reference.quantize_fp8_dynamic(x, None)
        return torch._scaled_mm(
            x_q, w["fp8"].t(), scale_a=x_s, scale_b=w["channel"].t(), out_dtype=dtype
        )

    calls = {
        "dense torch.matmul": lambda: x @ w["dense"].t(),
        "int4 int4_gemm": lambda: int4_gemm(x, *w["int4"], None, 128),
        "fp8 channel + token quant": fp8_channel,
        "fp8 block + group quant": fp8_block,
    }
    if x.is_cuda:
        calls["fp8 channel torch._scaled_mm peer"] = scaled_mm_peer
    return calls


def median_ms(fn, reps: int, device: torch.device) -> float:
    """Median milliseconds of one call: ``triton.testing.do_bench`` (L2 flushed) on a GPU,
    wall-clock time of a few calls elsewhere (``--smoke`` only checks the script there)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, rep=reps, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def timings(shapes, batches, dtype: torch.dtype, device: torch.device, reps: int) -> list[dict]:
    rows = []
    for name, k, n in shapes:
        w_fp8, w_channel = fp8_operands(k, n, device, (1, k))
        weights = {
            "int4": int4_operands(k, n, device, dtype),
            "dense": torch.randn(n, k, device=device, dtype=dtype),
            "fp8": w_fp8,
            "channel": w_channel,
            "block": fp8_operands(k, n, device, (128, 128))[1],
        }
        for m in batches:
            x = torch.randn(m, k, device=device, dtype=dtype)
            for label, fn in candidates(x, weights, dtype).items():
                ms = median_ms(fn, reps, device)
                tflops = 2 * m * n * k / (ms * 1e-3) / 1e12
                rows.append(
                    {"shape": name, "tokens": m, "kernel": label, "ms": ms, "TFLOP/s": tflops}
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write all results to this JSON file")
    parser.add_argument("--reps", type=int, default=50, help="milliseconds of timed calls")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (checks the script)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print("command:", " ".join(sys.argv))
    info = machine_info(device, None)
    print("machine:", json.dumps(info))
    shapes = SMOKE if args.smoke else LLAMA3_8B
    batches = (1, 16) if args.smoke else (1, 16, 64, 256, 1024, 4096)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    results = {"machine": info, "correctness": check(shapes, dtype, device)}
    print_table("Correctness against the PyTorch references", results["correctness"])
    results["timings"] = timings(shapes, batches, dtype, device, args.reps)
    print_table("Time per call", results["timings"])
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
