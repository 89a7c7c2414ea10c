"""fp8 scaled matmul as a Triton kernel: ``(x_q * s_x) (W_q * s_w)^T`` with per-token (or
per token and group) activation scales and per-row (or block) weight scales (reference:
``quant_reference.fp8_scaled_mm``).

Each program computes a ``[BLOCK_M, BLOCK_N]`` output tile; along ``K`` each ``BLOCK_K`` slice
lies inside one activation group and one weight scale block, so its partial product is scaled
by the two scales of that slice before it is accumulated (the scheme of DeepSeek-V3's
fine-grained quantization, Liu et al. 2024, section 3.3, and of vLLM's
``w8a8_block_fp8_matmul``). fp8 tiles multiply natively on the fp8 tensor cores; Triton
compiles e4m3 only for compute capability 8.9 and up (Ada, Hopper), so older GPUs take the
PyTorch path (``fp8_utils.apply_fp8``). The interpreter casts the tiles to float32 first, which
is exact for e4m3 values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels._utils import (
    FLOAT_DTYPES,
    cdiv,
    check_contiguous,
    check_inner_contiguous,
    check_same_device,
    check_tensor,
    interpreting,
)
from kvpilot.kernels.matmul_tile import (
    BLOCK_K,
    TILE,
    load_x_slice,
    store_tile,
    tile_offsets,
    tile_output,
)
from kvpilot.kernels.quant_reference import FP8_DTYPE


@triton.jit
def _fp8_scaled_mm_kernel(
    x_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    act_group,
    num_act_groups,
    block_n,
    block_k,
    num_w_k_blocks,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m, offs_n, mask_m, mask_n = tile_offsets(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x, offs_k, mask_k = load_x_slice(x_ptr, stride_xm, offs_m, mask_m, k0, K, BLOCK_K)
        w = tl.load(
            w_ptr + offs_n[:, None] * K + offs_k[None, :],
            mask=mask_n[:, None] & mask_k[None, :],
            other=0.0,
        )
        if UPCAST:
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        elif x.dtype != w.dtype:
            part = tl.dot(x, tl.trans(w.to(x.dtype)))
        else:
            part = tl.dot(x, tl.trans(w))
        x_scale = tl.load(
            x_scale_ptr + offs_m * num_act_groups + k0 // act_group, mask=mask_m, other=0.0
        )
        w_scale = tl.load(
            w_scale_ptr + (offs_n // block_n) * num_w_k_blocks + k0 // block_k,
            mask=mask_n,
            other=0.0,
        )
        acc += part * x_scale[:, None] * w_scale[None, :]
    store_tile(out_ptr, acc, offs_m, offs_n, mask_m, mask_n, N)


def fp8_scaled_mm(
    x_q: torch.Tensor,
    x_scales: torch.Tensor,
    weight: torch.Tensor,
    weight_scales: torch.Tensor,
    weight_block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(x_q * x_scales) (weight * weight_scales)^T`` (arguments as
    ``quant_reference.fp8_scaled_mm``).

    Args:
        x_q: ``[M, K]`` float8_e4m3fn (or float for weight-only fp8), contiguous in the last
            dimension.
        x_scales: ``[M, Ka]`` float32, contiguous; each group of ``K / Ka`` features (the
            whole row for ``Ka = 1``) must be a multiple of ``BLOCK_K`` unless ``Ka = 1``.
        weight: ``[N, K]`` float8_e4m3fn, contiguous.
        weight_scales: ``[ceil(N / bn), ceil(K / bk)]`` float32, contiguous.
        weight_block: ``(bn, bk)``; ``bk`` must be ``K`` or a multiple of ``BLOCK_K``.
        out_dtype: float16, bfloat16 or float32.

    Returns:
        ``[M, N]`` in ``out_dtype``, accumulated in float32.

    Raises:
        ValueError: a wrong rank, dtype, shape or device, or scale groups that a ``BLOCK_K``
            slice would straddle.
    """
    fn = "fp8_scaled_mm"
    check_tensor(fn, "x_q", x_q, ndim=2, dtypes=(FP8_DTYPE, *FLOAT_DTYPES))
    check_inner_contiguous(fn, "x_q", x_q)
    num_m, num_k = x_q.shape
    check_tensor(fn, "weight", weight, ndim=2, dtypes=(FP8_DTYPE,), shape=(None, num_k))
    num_n = weight.shape[0]
    bn, bk = weight_block
    check_tensor(
        fn,
        "weight_scales",
        weight_scales,
        ndim=2,
        dtypes=(torch.float32,),
        shape=(cdiv(num_n, bn), cdiv(num_k, bk)),
    )
    check_tensor(fn, "x_scales", x_scales, ndim=2, dtypes=(torch.float32,), shape=(num_m, None))
    num_act_groups = x_scales.shape[1]
    act_group = cdiv(num_k, num_act_groups)
    if num_act_groups > 1 and act_group % BLOCK_K:
        raise ValueError(f"{fn}: activation group {act_group} is not a multiple of {BLOCK_K}")
    if bk < num_k and bk % BLOCK_K:
        raise ValueError(f"{fn}: weight block {bk} is not a multiple of {BLOCK_K}")
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"{fn}: out_dtype must be a float dtype, got {out_dtype}")
    for name, t in {"weight": weight, "weight_scales": weight_scales, "x_scales": x_scales}.items():
        check_contiguous(fn, name, t)
    check_same_device(
        fn, {"x_q": x_q, "x_scales": x_scales, "weight": weight, "weight_scales": weight_scales}
    )
    out, grid = tile_output(fn, num_m, num_n, out_dtype, x_q.device)
    if num_m == 0:
        return out
    _fp8_scaled_mm_kernel[grid](
        x_q,
        x_scales,
        weight,
        weight_scales,
        out,
        num_m,
        num_n,
        num_k,
        x_q.stride(0),
        act_group if num_act_groups > 1 else num_k + BLOCK_K,
        num_act_groups,
        bn,
        bk if bk < num_k else num_k + BLOCK_K,
        weight_scales.shape[1],
        UPCAST=interpreting() or x_q.dtype == torch.float32,
        **TILE,
    )
    return out
