"""SwiGLU activation ``silu(gate) * up`` as a Triton kernel (reference: ``reference.silu_and_mul``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels._utils import FLOAT_DTYPES, check_inner_contiguous, check_tensor

_MAX_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation (Shazeer 2020, "GLU Variants Improve Transformer"):
    ``silu(x[..., :d]) * x[..., d:]``.

    Rounds like the PyTorch reference: ``silu`` is computed in float32 and rounded to ``x``'s
    dtype before the product, which is rounded again.

    Args:
        x: ``[..., 2 * d]`` float16, bfloat16 or float32, contiguous in the last dimension
            (gate and up projections concatenated).

    Returns:
        ``[..., d]``, ``x``'s dtype, a new contiguous tensor.

    Raises:
        ValueError: ``x`` is not a floating tensor of rank >= 1 with an even last dimension,
            or its last dimension is strided.
    """
    fn = "silu_and_mul"
    check_tensor(fn, "x", x, dtypes=FLOAT_DTYPES)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(
            f"{fn}: x must be [..., 2 * d] with an even last dimension, got {tuple(x.shape)}"
        )
    check_inner_contiguous(fn, "x", x)
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    rows = x.reshape(-1, 2 * d)
    if rows.shape[0] == 0 or d == 0:
        return out
    block = min(triton.next_power_of_2(d), _MAX_BLOCK)
    grid = (rows.shape[0], triton.cdiv(d, block))
    _silu_and_mul_kernel[grid](rows, out, rows.stride(0), d, BLOCK=block)
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, d, BLOCK: tl.constexpr):
    # One program: BLOCK columns of one row.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * d + cols, (act * up).to(dtype), mask=mask)
