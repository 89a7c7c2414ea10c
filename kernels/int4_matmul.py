"""int4 weight-only matmul as a Triton kernel: ``x W^T`` with ``W`` dequantized tile by tile
from the common int4 layout (reference: ``quant_reference.int4_gemm``).

Each program computes a ``[BLOCK_M, BLOCK_N]`` output tile. Along ``K`` it loads a
``[BLOCK_N, BLOCK_K]`` tile of packed words (each word read by its eight input features),
shifts out each feature's 4 bits, subtracts the zero point and multiplies by the scale of the
feature's group (``g_idx[k]`` or ``k // group_size``), then multiplies with the activation
tile on the tensor cores (the AWQ/GPTQ "dequantize in registers" scheme; Frantar et al. 2024,
Marlin, is the fast-path refinement this kernel does not attempt).
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
    upcast_to_fp32,
)
from kvpilot.kernels.matmul_tile import TILE, load_x_slice, store_tile, tile_offsets, tile_output


@triton.jit
def _int4_gemm_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    g_idx_ptr,
    out_ptr,
    M,
    N,
    K,
    num_groups,
    group_size,
    stride_xm,
    HAS_ZEROS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m, offs_n, mask_m, mask_n = tile_offsets(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    words_per_row = K // 8
    for k0 in range(0, K, BLOCK_K):
        x, offs_k, mask_k = load_x_slice(x_ptr, stride_xm, offs_m, mask_m, k0, K, BLOCK_K)
        mask_nk = mask_n[:, None] & mask_k[None, :]
        words = tl.load(
            qweight_ptr + offs_n[:, None] * words_per_row + (offs_k // 8)[None, :],
            mask=mask_nk,
            other=0,
        )
        q = (words >> ((offs_k % 8) * 4)[None, :]) & 0xF
        if HAS_G_IDX:
            groups = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)
        else:
            groups = offs_k // group_size
        group_offs = offs_n[:, None] * num_groups + groups[None, :]
        scales = tl.load(scales_ptr + group_offs, mask=mask_nk, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zeros = tl.load(zeros_ptr + group_offs, mask=mask_nk, other=0).to(tl.int32)
        else:
            zeros = 8
        w = (q - zeros).to(tl.float32) * scales
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    store_tile(out_ptr, acc, offs_m, offs_n, mask_m, mask_n, N)


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """``x W^T`` with ``W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)]`` from the common int4
    layout (see ``quant_reference.dequantize_int4`` for the arguments).

    Accumulates in float32. On a GPU 16-bit activations multiply on the tensor cores with the
    weight tile rounded to their dtype; float32 activations, and everything under the
    interpreter, multiply in IEEE float32.

    Args:
        x: ``[M, K]`` float16, bfloat16 or float32, contiguous in the last dimension.
        qweight: ``[N, K / 8]`` int32, contiguous.
        scales: ``[N, G]`` float, contiguous.
        qzeros: ``[N, G]`` uint8, contiguous, or None (zero point 8).
        g_idx: ``[K]`` int32 group of each input feature, or None (``k // group_size``).
        group_size: input features per group.

    Returns:
        ``[M, N]`` in ``x``'s dtype.

    Raises:
        ValueError: a wrong rank, dtype, shape or device.
    """
    fn = "int4_gemm"
    check_tensor(fn, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_inner_contiguous(fn, "x", x)
    num_m, num_k = x.shape
    if num_k % 8:
        raise ValueError(f"{fn}: in_features {num_k} must be a multiple of 8")
    check_tensor(fn, "qweight", qweight, ndim=2, dtypes=(torch.int32,), shape=(None, num_k // 8))
    num_n = qweight.shape[0]
    check_tensor(fn, "scales", scales, ndim=2, dtypes=FLOAT_DTYPES, shape=(num_n, None))
    num_groups = scales.shape[1]
    tensors = {"x": x, "qweight": qweight, "scales": scales}
    if qzeros is not None:
        check_tensor(fn, "qzeros", qzeros, dtypes=(torch.uint8,), shape=(num_n, num_groups))
        tensors["qzeros"] = qzeros
    if g_idx is not None:
        check_tensor(fn, "g_idx", g_idx, dtypes=(torch.int32,), shape=(num_k,))
        tensors["g_idx"] = g_idx
    elif group_size < 1 or cdiv(num_k, group_size) > num_groups:
        raise ValueError(f"{fn}: group_size {group_size} needs more than {num_groups} scales")
    for name, t in tensors.items():
        if name != "x":
            check_contiguous(fn, name, t)
    check_same_device(fn, tensors)
    out, grid = tile_output(fn, num_m, num_n, x.dtype, x.device)
    if num_m == 0:
        return out
    _int4_gemm_kernel[grid](
        x,
        qweight,
        scales,
        qzeros if qzeros is not None else qweight,
        g_idx if g_idx is not None else qweight,
        out,
        num_m,
        num_n,
        num_k,
        num_groups,
        group_size,
        x.stride(0),
        HAS_ZEROS=qzeros is not None,
        HAS_G_IDX=g_idx is not None,
        UPCAST=x.dtype == torch.float32 or upcast_to_fp32(x.dtype),
        **TILE,
    )
    return out
