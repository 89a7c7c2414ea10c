"""PyTorch implementations of the quantized-weight matmuls: the engine's CPU path and the
oracle the Triton kernels (``int4_matmul``, ``fp8_matmul``) are tested against.

Both dequantize the weight to the activation dtype and multiply; the float32 accumulation is
``F.linear``'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def dequantize_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The dense weight of the common int4 layout.

    Args:
        qweight: ``[N, K / 8]`` int32, value ``k`` of row ``n`` in bits ``[4 (k % 8), ...)`` of
            word ``k // 8``.
        scales: ``[N, G]`` group scales.
        qzeros: ``[N, G]`` uint8 zero points, or None for 8 (symmetric).
        g_idx: ``[K]`` group of each input feature, or None for ``k // group_size``.
        group_size: input features per group.
        dtype: result dtype.

    Returns:
        ``[N, K]`` ``(q - z) * s`` in ``dtype``.
    """
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = ((qweight.unsqueeze(-1) >> shifts) & 0xF).flatten(1)
    num_k = q.shape[1]
    if g_idx is None:
        groups = torch.arange(num_k, device=q.device) // group_size
    else:
        groups = g_idx.long()
    zeros = 8 if qzeros is None else qzeros[:, groups].to(torch.int32)
    return ((q - zeros).to(dtype) * scales[:, groups].to(dtype)).to(dtype)


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """``x W^T`` with ``W`` in the common int4 layout (see :func:`dequantize_int4`).

    Args:
        x: ``[M, K]`` float32/float16/bfloat16.

    Returns:
        ``[M, N]`` in ``x``'s dtype.
    """
    return F.linear(x, dequantize_int4(qweight, scales, qzeros, g_idx, group_size, x.dtype))


def expand_block_scales(
    scales: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]
) -> torch.Tensor:
    """Per-element scales of a ``shape`` tensor from one scale per ``block`` (rows, columns);
    the last block along each dimension may be partial.

    Args:
        scales: ``[ceil(rows / block[0]), ceil(columns / block[1])]``.
        block: block sizes (a ``[rows, 1]`` per-row scale is block ``(1, columns)``).
        shape: ``(rows, columns)``.
    """
    expanded = scales.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return expanded[: shape[0], : shape[1]]


def quantize_fp8_dynamic(
    x: torch.Tensor, group_size: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic fp8 (e4m3) quantization of activations: one scale per token, or per token and
    group of ``group_size`` features (DeepSeek-V3's 1x128 activation blocks).

    ``scale = amax(|x|) / 448`` over the token (group), as compressed-tensors and vLLM compute
    it; an all-zero token keeps scale ``finfo(float32).eps``.

    Args:
        x: ``[M, K]``.
        group_size: features per scale, or None for one scale per token.

    Returns:
        ``(x_fp8 [M, K] float8_e4m3fn, scales [M, ceil(K / group_size)] float32)`` (``[M, 1]``
        per token).
    """
    num_k = x.shape[1]
    group = num_k if group_size is None else group_size
    num_groups = -(-num_k // group)
    padded = F.pad(x.float(), (0, num_groups * group - num_k)).view(x.shape[0], num_groups, group)
    amax = padded.abs().amax(-1)
    scales = amax / FP8_MAX
    scales = torch.where(scales == 0, torch.finfo(torch.float32).eps, scales)
    scaled = padded / scales.unsqueeze(-1)
    q = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(x.shape[0], -1)[:, :num_k]
    return q, scales


def fp8_scaled_mm(
    x_q: torch.Tensor,
    x_scales: torch.Tensor,
    weight: torch.Tensor,
    weight_scales: torch.Tensor,
    weight_block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(x_q * x_scales) (weight * weight_scales)^T`` for fp8 operands.

    Args:
        x_q: ``[M, K]`` float8_e4m3fn activations, or already dequantized float activations
            (weight-only fp8) with ``x_scales`` of ones.
        x_scales: ``[M, Ka]`` float32: one scale per token (``Ka = 1``) or per token and group
            of ``ceil(K / Ka)`` features.
        weight: ``[N, K]`` float8_e4m3fn.
        weight_scales: ``[ceil(N / bn), ceil(K / bk)]`` float32 for ``weight_block`` ``(bn,
            bk)``; per-channel scales are block ``(1, K)``.
        weight_block: the weight's scale block ``(bn, bk)``.
        out_dtype: result dtype.

    Returns:
        ``[M, N]`` in ``out_dtype``.
    """
    num_m, num_k = x_q.shape
    act_group = -(-num_k // x_scales.shape[1])
    x = x_q.float() * expand_block_scales(x_scales.float(), (1, act_group), (num_m, num_k))
    w = weight.float() * expand_block_scales(
        weight_scales.float(), weight_block, tuple(weight.shape)
    )
    return F.linear(x.to(out_dtype), w.to(out_dtype))
