"""The inner loop shared by the grouped-matmul kernels (LoRA's SGMV, the fused MoE): one tile of
``x[rows] @ w^T`` with the rows gathered through an index vector."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gathered_dot(
    x_ptr, rows, mask_m, stride_x,
    w_ptr, stride_wn, offs_n, mask_n, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):  # fmt: skip
    """``x[rows[i], :K] @ w[offs_n[j], :K]`` for the tile, accumulated in float32
    (``[BLOCK_M, BLOCK_N]``); masked rows and columns are 0. ``w_ptr`` points at one matrix
    ``[N, K]`` with unit stride along ``K``, ``x`` has unit stride along ``K``. ``FP32_DOT``:
    multiply in IEEE float32; otherwise ``x`` is cast to ``w``'s dtype (tensor cores)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x_tile = tl.load(
            x_ptr + rows[:, None] * stride_x + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w_tile = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if FP32_DOT:
            acc += tl.dot(x_tile.to(tl.float32), w_tile.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x_tile.to(w_tile.dtype), w_tile)
    return acc
