"""GPU check of kvpilot's Triton kernels, in one run of a few minutes on one CUDA device.

1. Correctness of every kernel against its PyTorch reference (``kvpilot.kernels.reference``) in
   bfloat16 and float16 at Llama-3-8B shapes (32 query heads, 8 KV heads, head_dim 128,
   hidden 4096, intermediate 14336).
2. Decode attention: achieved HBM bandwidth (K/V bytes read / kernel time) as a fraction of the
   device's peak, for batch 1-256 and context 512-32k, beside PyTorch's
   ``scaled_dot_product_attention`` on contiguous K/V; a few launch configurations are swept
   at two cells to tune ``unified_attention.DECODE_CONFIG``. Target: >= 70% of peak for
   batch >= 32 and context >= 4k.
3. Prefill attention: TFLOP/s (causal, ``2 * L^2 * heads * head_dim`` FLOPs per sequence of L
   tokens) beside SDPA (contiguous) and ``flex_attention`` on the same paged layout.
2b. The same decode grid over an fp8 (E4M3) KV cache (``--kv-cache-dtype fp8``), on GPUs
   that compile it (compute capability 8.9+): half the K/V bytes of bf16, so at the same
   bandwidth fraction a step takes about half as long.
4. End to end: the engine's greedy tokens in bfloat16 with the Triton backend (attention,
   RMSNorm with the fused residual add, rotary embedding and SiLU-and-mul all in the Triton
   kernels) against transformers' ``generate()`` on the same model.

Timing uses CUDA events around each call, replayed from a CUDA graph (as the engine would run
it) so host-side launch cost is not counted, with the L2 cache flushed before it (so small
problems are not served from L2), and reports the median of ``--reps`` calls.

Usage::

    python benchmarks/kernels_gpu.py [--out results.json] [--skip-flex] [--skip-e2e]
    python benchmarks/kernels_gpu.py --smoke     # tiny shapes, any device: checks the script

Results are printed as Markdown tables for docs/benchmarks.md and saved as JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kvpilot.kernels.testing import PagedBatch

# Peak HBM bandwidth (GB/s) by device name, for drivers that do not report the memory clock
# and bus width. Vendor datasheet numbers.
PEAK_BANDWIDTH_GBS = {
    "H200": 4800.0,
    "H100 SXM": 3350.0,
    "H100 80GB HBM3": 3350.0,
    "H100 PCIe": 2000.0,
    "H100 NVL": 3900.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100-SXM4-40GB": 1555.0,
    "A100-PCIE-40GB": 1555.0,
    "L40S": 864.0,
    "L4": 300.0,
    "A10G": 600.0,
    "RTX 4090": 1008.0,
}


@dataclass(frozen=True)
class Shapes:
    """Model and sweep sizes of one run."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    block_size: int
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prefill_lengths: tuple[int, ...]
    flex_prefill_lengths: tuple[int, ...]  # each is a torch.compile of its own (tens of s)
    flex_decode_cells: tuple[tuple[int, int], ...]
    sweep_cells: tuple[tuple[int, int], ...]
    decode_candidates: tuple[tuple[int, int], ...]  # (tile_n, num_warps)
    prefill_candidates: tuple[tuple[int, int, int], ...]  # (block_m, tile_n, num_warps)
    correctness_tokens: int


LLAMA3_8B = Shapes(
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    hidden=4096,
    intermediate=14336,
    block_size=16,
    decode_batches=(1, 8, 32, 64, 128, 256),
    decode_contexts=(512, 2048, 4096, 8192, 16384, 32768),
    prefill_lengths=(1024, 4096, 16384),
    flex_prefill_lengths=(4096,),
    flex_decode_cells=((32, 4096), (128, 8192)),
    sweep_cells=((32, 4096), (128, 16384)),
    decode_candidates=tuple((t, w) for t in (16, 32, 64, 128) for w in (2, 4, 8)),
    prefill_candidates=tuple((m, t, w) for m in (64, 128) for t in (32, 64, 128) for w in (4, 8)),
    correctness_tokens=512,
)
SMOKE = Shapes(
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    hidden=64,
    intermediate=96,
    block_size=16,
    decode_batches=(1, 3),
    decode_contexts=(17, 64),
    prefill_lengths=(48,),
    flex_prefill_lengths=(48,),
    flex_decode_cells=((3, 64),),
    sweep_cells=((3, 64),),
    decode_candidates=((32, 4),),
    prefill_candidates=((16, 32, 4),),
    correctness_tokens=24,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write all results to this JSON file")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per measurement")
    parser.add_argument("--skip-flex", action="store_true", help="skip flex_attention peers")
    parser.add_argument(
        "--skip-e2e", action="store_true", help="skip the engine vs transformers check"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="model for the end-to-end check (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--peak-gbs",
        type=float,
        default=None,
        help="peak HBM bandwidth in GB/s (default: from the device)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes on any device: checks the script, measures nothing",
    )
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        sys.exit("kernels_gpu.py needs a CUDA device (or --smoke to exercise the script on CPU)")
    if not cuda:
        # Before the first Triton import: kernels run in the interpreter without a GPU.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    device = torch.device("cuda" if cuda else "cpu")
    shapes = SMOKE if args.smoke else LLAMA3_8B
    bench = Bench(device, reps=1 if args.smoke else args.reps, warmup=1 if args.smoke else 3)
    started = time.perf_counter()
    results: dict = {"machine": machine_info(device, args.peak_gbs)}

    print(f"# kvpilot kernels on {results['machine']['device_name']}\n")
    print(f"command: {' '.join(sys.argv)}")
    for key, value in results["machine"].items():
        print(f"- {key}: {value}")

    dtypes = (torch.float32,) if not cuda else (torch.bfloat16, torch.float16)
    results["correctness"] = [
        row for dtype in dtypes for row in check_correctness(shapes, dtype, device)
    ]
    print_table("Correctness against kvpilot.kernels.reference", results["correctness"])

    peak = results["machine"]["peak_bandwidth_gbs"]
    dtype = dtypes[0]
    results["decode"] = decode_grid(bench, shapes, dtype, peak)
    print_table("Decode attention: HBM bandwidth", results["decode"])
    if fp8_supported(device):
        results["decode_fp8"] = decode_grid(bench, shapes, dtype, peak, torch.float8_e4m3fn)
        print_table(
            "Decode attention over an fp8 (E4M3) cache: HBM bandwidth", results["decode_fp8"]
        )
    results["decode_sweep"] = decode_config_sweep(bench, shapes, dtype, peak)
    print_table("Decode launch configurations (best first per cell)", results["decode_sweep"])
    if not args.skip_flex:
        results["decode_flex"] = decode_flex(bench, shapes, dtype, peak)
        print_table("Decode attention: flex_attention on the paged layout", results["decode_flex"])
    results["prefill"] = prefill(bench, shapes, dtype, with_flex=not args.skip_flex)
    print_table("Prefill attention (causal)", results["prefill"])
    results["prefill_sweep"] = prefill_config_sweep(bench, shapes, dtype)
    print_table("Prefill launch configurations", results["prefill_sweep"])
    if not args.skip_e2e and cuda:
        results["e2e"] = [end_to_end(args.model)]
        print_table("Engine (triton backend, bf16) vs transformers, greedy", results["e2e"])

    results["wall_seconds"] = round(time.perf_counter() - started, 1)
    print(f"\nwall time: {results['wall_seconds']} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


# ----------------------------------------------------------------------------- machine, timing


def machine_info(device: torch.device, peak_gbs: float | None) -> dict:
    import triton

    info = {
        "device_name": platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["device_name"] = props.name
        info["sms"] = props.multi_processor_count
        info["memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    info["peak_bandwidth_gbs"] = peak_gbs or peak_bandwidth_gbs(device)
    return info


def peak_bandwidth_gbs(device: torch.device) -> float:
    """Peak DRAM bandwidth (GB/s): from the memory clock and bus width when the driver reports
    them (double data rate), else from the datasheet table; NaN when unknown."""
    if device.type != "cuda":
        return float("nan")
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9
    for name, gbs in PEAK_BANDWIDTH_GBS.items():
        if name in props.name:
            return gbs
    return float("nan")


class Bench:
    """Median time of a callable with CUDA events (wall clock on CPU), L2 flushed before each
    call."""

    def __init__(self, device: torch.device, reps: int, warmup: int) -> None:
        self.device = device
        self.reps = reps
        self.warmup = warmup
        # Larger than any L2 (50-60 MB on H100/H200) so every call reads K/V from HBM.
        self.flush = torch.empty(
            256 * 2**20 if device.type == "cuda" else 1, dtype=torch.int8, device=device
        )

    def ms(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        call = self._graphed(fn) if self.device.type == "cuda" else fn
        times = []
        for _ in range(self.reps):
            self.flush.zero_()
            if self.device.type == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                call()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    @staticmethod
    def _graphed(fn: Callable[[], object]) -> Callable[[], object]:
        """``fn`` captured in a CUDA graph, so the events time the GPU work and not the
        Python launch path (tens of microseconds, as long as a small decode kernel); ``fn``
        itself when it cannot be captured."""
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
        except RuntimeError:
            torch.cuda.synchronize()
            return fn
        return graph.replay


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n## {title}\n")
    if not rows:
        print("(nothing measured)")
        return
    columns = list(dict.fromkeys(key for row in rows for key in row))  # union, first-seen order
    print("| " + " | ".join(columns) + " |")
    print("| " + " | ".join("---" for _ in columns) + " |")
    for row in rows:
        values = [row.get(column, "") for column in columns]
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in values]
        print("| " + " | ".join(cells) + " |")
    sys.stdout.flush()


# ----------------------------------------------------------------------------- batches


def paged_batch(
    shapes: Shapes, specs: list[tuple[int, int]], dtype: torch.dtype, device: torch.device
) -> PagedBatch:
    """``specs``: ``(q_len, seq_len)`` per sequence."""
    from kvpilot.kernels.testing import paged_batch

    return paged_batch(
        specs, num_heads=shapes.num_heads, num_kv_heads=shapes.num_kv_heads,
        head_dim=shapes.head_dim, block_size=shapes.block_size, dtype=dtype, device=device,
    )  # fmt: skip


def fp8_supported(device: torch.device) -> bool:
    """Whether the Triton kernels compile an E4M3 cache here: CUDA 8.9+, or the interpreter."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def to_fp8(batch: PagedBatch, cache_dtype: torch.dtype) -> tuple[PagedBatch, dict]:
    """``batch`` with its caches quantized to ``cache_dtype`` (scale 1.0: N(0, 1) values are in
    range), freeing the originals, and the scale arguments of the kernels."""
    from kvpilot.kernels import reference

    scale = torch.ones((), device=batch.q.device)
    for name in ("k_cache", "v_cache"):
        setattr(batch, name, reference.quantize_to_cache(getattr(batch, name), scale, cache_dtype))
    return batch, {"k_scale": scale, "v_scale": scale}


def fits(nbytes: int, device: torch.device, share: float = 0.6) -> bool:
    """Whether ``nbytes`` fits in ``share`` of the device's free memory (always on CPU)."""
    if device.type != "cuda":
        return True
    torch.cuda.empty_cache()
    return nbytes < share * torch.cuda.mem_get_info(device)[0]


# ----------------------------------------------------------------------------- correctness


def check_correctness(shapes: Shapes, dtype: torch.dtype, device: torch.device) -> list[dict]:
    from kvpilot.kernels import reference
    from kvpilot.kernels.activation import gelu_and_mul, silu_and_mul
    from kvpilot.kernels.reshape_and_cache import reshape_and_cache
    from kvpilot.kernels.rms_norm import rms_norm
    from kvpilot.kernels.rotary_embedding import rotary_embedding
    from kvpilot.kernels.unified_attention import unified_attention

    n = shapes.correctness_tokens
    # One rounding of the output dtype, plus the P rounding of FlashAttention for attention.
    tol = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}[dtype]
    rows = []

    def record(kernel: str, got: torch.Tensor, want: torch.Tensor, scale: float = 1.0) -> None:
        err = (got.float() - want.float()).abs().max().item()
        bound = tol * scale
        rows.append(
            {
                "kernel": kernel,
                "dtype": str(dtype).removeprefix("torch."),
                "max_abs_err": err,
                "tolerance": bound,
                "ok": err <= bound,
            }
        )

    x = torch.randn(n, shapes.hidden, device=device, dtype=dtype)
    w = torch.randn(shapes.hidden, device=device, dtype=dtype)
    res = torch.randn_like(x)
    got, got_res = rms_norm(x, w, 1e-5, res)
    want, want_res = reference.rms_norm(x, w, 1e-5, res)
    record("rms_norm (+residual)", got, want, scale=w.abs().max().item())
    record("rms_norm residual out", got_res, want_res, scale=0.0)
    got, _ = rms_norm(x, w, 1e-5, res, weight_offset=1.0)
    want, _ = reference.rms_norm(x, w, 1e-5, res, weight_offset=1.0)
    record(
        "rms_norm (+residual, weight_offset 1: Gemma)", got, want, scale=1.0 + w.abs().max().item()
    )

    gate_up = torch.randn(n, 2 * shapes.intermediate, device=device, dtype=dtype)
    record("silu_and_mul", silu_and_mul(gate_up), reference.silu_and_mul(gate_up), scale=4.0)
    got, want = gelu_and_mul(gate_up, "tanh"), reference.gelu_and_mul(gate_up, "tanh")
    record("gelu_and_mul (tanh)", got, want, scale=4.0)

    head_dim = shapes.head_dim
    freqs = torch.arange(8192, device=device).float()[:, None] / 500000 ** (
        torch.arange(0, head_dim, 2, device=device).float() / head_dim
    )
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    positions = torch.randint(0, 8192, (n,), device=device)
    for is_neox in (True, False):
        q = torch.randn(n, shapes.num_heads, head_dim, device=device, dtype=dtype)
        k = torch.randn(n, shapes.num_kv_heads, head_dim, device=device, dtype=dtype)
        q_want, k_want = q.clone(), k.clone()
        rotary_embedding(positions, q, k, cos_sin, is_neox)
        reference.rotary_embedding(positions, q_want, k_want, cos_sin, is_neox)
        record(f"rotary_embedding ({'neox' if is_neox else 'gptj'}) q", q, q_want, scale=4.0)
        record(f"rotary_embedding ({'neox' if is_neox else 'gptj'}) k", k, k_want, scale=4.0)

    num_blocks = -(-n // shapes.block_size) + 4
    caches = [
        torch.randn(
            num_blocks, shapes.block_size, shapes.num_kv_heads, head_dim, device=device, dtype=dtype
        )
        for _ in range(2)
    ]
    key, value = (
        torch.randn(n, shapes.num_kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2)
    )
    slots = torch.randperm(num_blocks * shapes.block_size, device=device)[:n]
    slots[::7] = -1
    want_caches = [c.clone() for c in caches]
    reshape_and_cache(key, value, *caches, slots)
    reference.reshape_and_cache(key, value, *want_caches, slots)
    record("reshape_and_cache", torch.stack(caches), torch.stack(want_caches), scale=0.0)

    ctx = 4 * shapes.block_size * 8
    specs = [
        (1, 1),
        (1, ctx + 1),
        (1, 4 * ctx),
        (n // 4, n // 4),
        (n // 8, ctx + n // 8),
        (1, shapes.block_size),
    ]
    batch = paged_batch(shapes, specs, dtype, device)
    for splits in (None, 4):
        got = unified_attention(
            batch.q, batch.k_cache, batch.v_cache, num_kv_splits=splits, **batch.attention_kwargs()
        )
        want = reference.unified_attention(
            batch.q, batch.k_cache, batch.v_cache, **batch.attention_kwargs()
        )
        record(f"unified_attention mixed (splits={splits or 'auto'})", got, want)
    decode = paged_batch(shapes, [(1, s) for s in (1, 17, 500, 4 * ctx)], dtype, device)
    got = unified_attention(decode.q, decode.k_cache, decode.v_cache, **decode.attention_kwargs())
    want = reference.unified_attention(
        decode.q, decode.k_cache, decode.v_cache, **decode.attention_kwargs()
    )
    record("unified_attention decode (auto splits)", got, want)
    if fp8_supported(device):
        e4m3 = torch.float8_e4m3fn
        scale = torch.tensor(0.5, device=device)
        fp8_caches = [torch.zeros_like(c, dtype=e4m3) for c in caches]
        want_caches = [c.clone() for c in fp8_caches]
        reshape_and_cache(key, value, *fp8_caches, slots, scale, scale)
        reference.reshape_and_cache(key, value, *want_caches, slots, scale, scale)
        got, want = (torch.stack(c).view(torch.uint8) for c in (fp8_caches, want_caches))
        record("reshape_and_cache fp8_e4m3 (bytes)", got, want, scale=0.0)
        batch, scales = to_fp8(paged_batch(shapes, specs, dtype, device), e4m3)
        got = unified_attention(
            batch.q, batch.k_cache, batch.v_cache, **scales, **batch.attention_kwargs()
        )
        want = reference.unified_attention(
            batch.q, batch.k_cache, batch.v_cache, **scales, **batch.attention_kwargs()
        )
        record("unified_attention fp8_e4m3 cache, mixed", got, want)
    return rows


# ----------------------------------------------------------------------------- decode


def decode_bytes(
    batch: int,
    context: int,
    shapes: Shapes,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
) -> int:
    """HBM bytes a decode step must move: K and V of every context token (in ``cache_dtype``,
    default ``dtype``), plus q and out."""
    elem = dtype.itemsize
    kv = (
        2
        * batch
        * context
        * shapes.num_kv_heads
        * shapes.head_dim
        * (cache_dtype or dtype).itemsize
    )
    return kv + 2 * batch * shapes.num_heads * shapes.head_dim * elem


def decode_grid(
    bench: Bench,
    shapes: Shapes,
    dtype: torch.dtype,
    peak_gbs: float,
    cache_dtype: torch.dtype | None = None,
) -> list[dict]:
    """The decode bandwidth grid; with an fp8 ``cache_dtype`` the cache is quantized and the
    SDPA peer (which has no fp8 cache) is left out."""
    from kvpilot.kernels.unified_attention import unified_attention

    rows = []
    for batch_size in shapes.decode_batches:
        for context in shapes.decode_contexts:
            nbytes = decode_bytes(batch_size, context, shapes, dtype, cache_dtype)
            # ours and SDPA's contiguous copy side by side (the cache is made in dtype first)
            if fits(decode_bytes(batch_size, context, shapes, dtype), bench.device):
                batch = paged_batch(shapes, [(1, context)] * batch_size, dtype, bench.device)
                scales = {}
                if cache_dtype is not None:
                    batch, scales = to_fp8(batch, cache_dtype)
                ours = bench.ms(
                    lambda b=batch, s=scales: unified_attention(
                        b.q, b.k_cache, b.v_cache, **s, **b.attention_kwargs()
                    )
                )
                del batch
                sdpa = (
                    float("nan")
                    if cache_dtype is not None
                    else sdpa_decode_ms(bench, shapes, batch_size, context, dtype)
                )
            else:  # reported as NaN: the K/V copies do not fit in memory
                ours = sdpa = float("nan")
            rows.append({
                "batch": batch_size,
                "context": context,
                "triton_us": ours * 1e3,
                "triton_gbs": nbytes / ours / 1e6,
                "triton_peak_frac": nbytes / ours / 1e6 / peak_gbs,
                "sdpa_us": sdpa * 1e3,
                "sdpa_peak_frac": nbytes / sdpa / 1e6 / peak_gbs,
                "target_met": "" if batch_size < 32 or context < 4096 else str(nbytes / ours / 1e6 / peak_gbs >= 0.7),
            })  # fmt: skip
    return rows


def sdpa_decode_ms(
    bench: Bench, shapes: Shapes, batch: int, context: int, dtype: torch.dtype
) -> float:
    """SDPA on contiguous ``[batch, kv_heads, context, head_dim]`` K/V, one query token each;
    NaN when it fails (a backend without GQA support may fall back to one that expands K/V and
    runs out of memory)."""
    q = torch.randn(batch, shapes.num_heads, 1, shapes.head_dim, device=bench.device, dtype=dtype)
    k = torch.randn(
        batch, shapes.num_kv_heads, context, shapes.head_dim, device=bench.device, dtype=dtype
    )
    v = torch.randn_like(k)
    try:
        return bench.ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    except (RuntimeError, torch.OutOfMemoryError):  # the peer's failure is a result
        return float("nan")


def time_config(
    bench: Bench, name: str, config: object, fn: Callable[[], object]
) -> tuple[float, str]:
    """``bench.ms(fn)`` with ``unified_attention.<name>`` set to ``config``, and ``""``; a
    configuration that does not compile is a result too: ``nan`` and its error's type."""
    from kvpilot.kernels import unified_attention as ua

    base = getattr(ua, name)
    setattr(ua, name, config)
    try:
        return bench.ms(fn), ""
    except Exception as exc:
        return float("nan"), type(exc).__name__
    finally:
        setattr(ua, name, base)


def decode_config_sweep(
    bench: Bench, shapes: Shapes, dtype: torch.dtype, peak_gbs: float
) -> list[dict]:
    """Time alternative decode launch configurations (and split counts) at a few cells."""
    from kvpilot.kernels import unified_attention as ua

    candidates = [
        replace(ua.DECODE_CONFIG, tile_n=t, num_warps=w) for t, w in shapes.decode_candidates
    ]
    rows = []
    for batch_size, context in shapes.sweep_cells:
        nbytes = decode_bytes(batch_size, context, shapes, dtype)
        if not fits(nbytes, bench.device):
            continue
        batch = paged_batch(shapes, [(1, context)] * batch_size, dtype, bench.device)
        cell = []
        for config in candidates:
            for splits in (None, 1):
                ms, error = time_config(
                    bench,
                    "DECODE_CONFIG",
                    config,
                    lambda b=batch, s=splits: ua.unified_attention(
                        b.q, b.k_cache, b.v_cache, num_kv_splits=s, **b.attention_kwargs()
                    ),
                )
                cell.append(
                    {
                        "batch": batch_size,
                        "context": context,
                        "tile_n": config.tile_n,
                        "num_warps": config.num_warps,
                        "splits": splits or "auto",
                        "us": ms * 1e3,
                        "peak_frac": nbytes / ms / 1e6 / peak_gbs,
                        "error": error,
                    }
                )
        rows += sorted(cell, key=lambda r: (math.isnan(r["us"]), r["us"]))
        del batch
    return rows


def decode_flex(bench: Bench, shapes: Shapes, dtype: torch.dtype, peak_gbs: float) -> list[dict]:
    rows = []
    for batch_size, context in shapes.flex_decode_cells:
        nbytes = decode_bytes(batch_size, context, shapes, dtype)
        if not fits(nbytes, bench.device):
            continue
        batch = paged_batch(shapes, [(1, context)] * batch_size, dtype, bench.device)
        row = {"batch": batch_size, "context": context}
        row.update(time_flex(bench, batch, shapes))
        row["flex_peak_frac"] = nbytes / row["flex_ms"] / 1e6 / peak_gbs
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- flex_attention


def flex_paged(batch: PagedBatch, shapes: Shapes, causal: bool) -> Callable[[], torch.Tensor]:
    """``flex_attention`` reading the engine's paged cache in place, one sequence per batch row.

    The cache ``[num_blocks, block_size, kv_heads, head_dim]`` is viewed (no copy) as one
    ``[1, kv_heads, num_blocks * block_size, head_dim]`` sequence shared by all rows; a
    ``BlockMask`` built from the block tables lists each row's physical blocks and a mask_mod
    maps a physical position back to its logical one (PyTorch's PagedAttention recipe). All
    sequences must have the same number of new tokens.
    """
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    q_lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
    if len(set(q_lens)) != 1:
        raise ValueError("flex_paged: every sequence needs the same number of new tokens")
    num_seqs, q_len = len(q_lens), q_lens[0]
    num_blocks, bs, kv_heads, head_dim = batch.k_cache.shape
    device = batch.q.device
    k = batch.k_cache.view(1, num_blocks * bs, kv_heads, head_dim).transpose(1, 2)
    v = batch.v_cache.view(1, num_blocks * bs, kv_heads, head_dim).transpose(1, 2)
    q = batch.q.view(num_seqs, q_len, -1, head_dim).transpose(1, 2)  # [seqs, heads, q_len, dim]
    tables = batch.block_tables.long()
    logical_of = torch.full((num_seqs, num_blocks), -1, dtype=torch.int64, device=device)
    logical_of.scatter_(
        1, tables, torch.arange(tables.shape[1], device=device).expand(num_seqs, -1)
    )
    seq_lens = batch.seq_lens.long()
    context = seq_lens - q_len

    def mask_mod(b, h, q_idx, kv_idx):
        logical = logical_of[b, kv_idx // bs] * bs + kv_idx % bs
        visible = (logical >= 0) & (logical < seq_lens[b])
        return visible & (logical <= context[b] + q_idx) if causal else visible

    q_block = 128
    rows = -(-q_len // q_block)
    # Each q block row lists the sequence's physical blocks up to its last visible position.
    last = torch.minimum(
        context[:, None] + (torch.arange(rows, device=device)[None, :] + 1) * q_block,
        seq_lens[:, None],
    )
    kv_num_blocks = (-(-last // bs)).int().view(num_seqs, 1, rows)
    # Padded to one column per physical block, as PagedAttention.convert_logical_block_mask does:
    # flex sizes its dense view of the mask by the K/V length, here the whole cache.
    kv_indices = torch.zeros(num_seqs, 1, rows, num_blocks, dtype=torch.int32, device=device)
    kv_indices[..., : tables.shape[1]] = batch.block_tables[:, None, None, :]
    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        BLOCK_SIZE=(q_block, bs),
        mask_mod=mask_mod,
        seq_lengths=(q_len, num_blocks * bs),
    )
    fn = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention
    scale = head_dim**-0.5
    # [seqs, heads, q_len, dim] -> the engine's [num_tokens, heads, dim]
    return lambda: (
        fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
        .transpose(1, 2)
        .flatten(0, 1)
    )


def time_flex(bench: Bench, batch: PagedBatch, shapes: Shapes) -> dict:
    """flex_attention's time on ``batch`` and its largest error against the reference; a
    failure (compile error, unsupported block size) is reported, not raised."""
    from kvpilot.kernels import reference

    try:
        run = flex_paged(batch, shapes, causal=True)
        ms = bench.ms(run)
        want = reference.unified_attention(
            batch.q, batch.k_cache, batch.v_cache, **batch.attention_kwargs()
        )
        err = (run().float() - want.float()).abs().max().item()
        return {"flex_ms": ms, "flex_max_err": err, "flex_error": ""}
    except Exception as exc:  # the peer's failure is a result, the run goes on
        return {
            "flex_ms": float("nan"),
            "flex_max_err": float("nan"),
            "flex_error": f"{type(exc).__name__}: {exc}"[:200],
        }


# ----------------------------------------------------------------------------- prefill


def prefill(bench: Bench, shapes: Shapes, dtype: torch.dtype, with_flex: bool) -> list[dict]:
    from kvpilot.kernels.unified_attention import unified_attention

    rows = []
    for length in shapes.prefill_lengths:
        flops = (
            2 * length * length * shapes.num_heads * shapes.head_dim
        )  # causal: half of 4 L^2 H D
        batch = paged_batch(shapes, [(length, length)], dtype, bench.device)
        ours = bench.ms(
            lambda b=batch: unified_attention(b.q, b.k_cache, b.v_cache, **b.attention_kwargs())
        )
        q = batch.q.transpose(0, 1)[None]
        k = torch.randn(
            1, shapes.num_kv_heads, length, shapes.head_dim, device=bench.device, dtype=dtype
        )
        sdpa = bench.ms(
            lambda q=q, k=k: F.scaled_dot_product_attention(
                q, k, k, is_causal=True, enable_gqa=True
            )
        )
        row = {
            "tokens": length,
            "triton_ms": ours,
            "triton_tflops": flops / ours / 1e9,
            "sdpa_ms": sdpa,
            "sdpa_tflops": flops / sdpa / 1e9,
        }
        if with_flex and length in shapes.flex_prefill_lengths:
            row.update(time_flex(bench, batch, shapes))
            row["flex_tflops"] = flops / row["flex_ms"] / 1e9
        rows.append(row)
        del batch, q, k
    return rows


def prefill_config_sweep(bench: Bench, shapes: Shapes, dtype: torch.dtype) -> list[dict]:
    from kvpilot.kernels import unified_attention as ua

    candidates = [
        replace(ua.PREFILL_CONFIG, block_m=m, tile_n=t, num_warps=w)
        for m, t, w in shapes.prefill_candidates
    ]
    length = shapes.prefill_lengths[len(shapes.prefill_lengths) // 2]
    flops = 2 * length * length * shapes.num_heads * shapes.head_dim
    batch = paged_batch(shapes, [(length, length)], dtype, bench.device)
    rows = []
    for config in candidates:
        ms, error = time_config(
            bench,
            "PREFILL_CONFIG",
            config,
            lambda: ua.unified_attention(
                batch.q, batch.k_cache, batch.v_cache, **batch.attention_kwargs()
            ),
        )
        rows.append(
            {
                "tokens": length,
                "block_m": config.block_m,
                "tile_n": config.tile_n,
                "num_warps": config.num_warps,
                "ms": ms,
                "tflops": flops / ms / 1e9,
                "error": error,
            }
        )
    return sorted(rows, key=lambda r: (math.isnan(r["ms"]), r["ms"]))


# ----------------------------------------------------------------------------- end to end


def end_to_end(model: str | None, new_tokens: int = 32) -> dict:
    """Greedy tokens of the engine (Triton backend, bf16) and of transformers on one model.

    ``layer_kernels`` names the implementations the model's norms, activations and rotary
    embedding ran (``["triton"]`` when every layer ran its Triton kernel).
    """
    import transformers

    from kvpilot.engine import LLM, SamplingParams
    from kvpilot.engine.layers.custom_op import CustomOp
    from kvpilot.engine.model_loader import resolve_model

    model_dir = resolve_model(model)
    prompts = [
        "The capital of France is",
        "Write a haiku about Kubernetes.",
        "def fibonacci(n):",
        "Explain paged attention in one sentence:",
    ]
    gc.collect()
    torch.cuda.empty_cache()  # the engine sizes its KV cache from the memory free now
    llm = LLM(str(model_dir), dtype="bfloat16", attention_backend="triton", max_model_len=1024)
    tokenizer = llm.get_tokenizer()
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outputs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False
    )
    ours = [list(o.outputs[0].token_ids) for o in outputs]
    model = llm.llm_engine.model_runner.model
    layer_kernels = sorted({m.kernel_backend for m in model.modules() if isinstance(m, CustomOp)})
    del llm, model
    gc.collect()
    torch.cuda.empty_cache()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    theirs = []
    for ids in prompt_ids:
        out = hf.generate(
            torch.tensor([ids], device="cuda"),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
        )
        theirs.append(out[0, len(ids) :].tolist())
    # bf16 rounding may legitimately flip a near-tie late in a sequence; report where.
    first_diff = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
        for x, y in zip(ours, theirs, strict=True)
    ]
    return {
        "model": str(model_dir.name),
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "layer_kernels": ",".join(layer_kernels),
        "identical_sequences": sum(d is None for d in first_diff),
        "first_divergence": str(first_diff),
    }


if __name__ == "__main__":
    main()
