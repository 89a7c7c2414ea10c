"""RMSNorm, optionally fused with the residual add, as a Triton kernel (reference:
``reference.rms_norm``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels._utils import (
    FLOAT_DTYPES,
    check_inner_contiguous,
    check_number,
    check_same_device,
    check_tensor,
)

# One program holds a whole row in registers; 64k columns is 4x the widest open model today.
_MAX_HIDDEN = 65536


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    weight_offset: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Root-mean-square layer norm (Zhang & Sennrich 2019), optionally fused with a residual add.

    Matches the reference rounding for rounding. The residual sum is rounded to ``x``'s dtype
    and normalised in float32; with ``weight_offset`` 0.0 (Hugging Face's ``LlamaRMSNorm``) the
    result is rounded to ``x``'s dtype, then multiplied by ``weight``; with 1.0 (Gemma's
    ``GemmaRMSNorm``) it is multiplied by ``1 + weight`` in float32 and rounded once. One
    program normalises one row.

    Args:
        x: ``[..., hidden_size]`` float16, bfloat16 or float32, contiguous in the last dim.
        weight: ``[hidden_size]`` float16, bfloat16 or float32, contiguous.
        eps: added to the mean square before the reciprocal square root (>= 0).
        residual: optional, ``x``'s shape and dtype; when given, ``x + residual`` is
            normalised and also returned as the new residual.
        weight_offset: 0.0 (scale by ``weight``) or 1.0 (scale by ``1 + weight``, Gemma).

    Returns:
        ``out`` ``[..., hidden_size]``, or ``(out, x + residual)`` when ``residual`` is given;
        ``out`` is in ``promote_types(weight.dtype, x.dtype)`` (as ``weight * h`` does in
        PyTorch) with ``weight_offset`` 0.0, in ``x``'s dtype with 1.0. Inputs are not
        modified.

    Raises:
        ValueError: wrong dtype, shape, device or layout of an argument, ``eps`` negative or not
            finite, ``weight_offset`` neither 0.0 nor 1.0, or ``hidden_size`` above 65536.
    """
    fn = "rms_norm"
    if weight_offset not in (0.0, 1.0) or isinstance(weight_offset, bool):
        raise ValueError(f"{fn}: weight_offset must be 0.0 or 1.0, got {weight_offset!r}")
    check_tensor(fn, "x", x, dtypes=FLOAT_DTYPES)
    if x.dim() == 0:
        raise ValueError(f"{fn}: x must be [..., hidden_size], got a 0-D tensor")
    hidden = x.shape[-1]
    if hidden > _MAX_HIDDEN:
        raise ValueError(f"{fn}: x's hidden_size must be <= {_MAX_HIDDEN}, got {hidden}")
    check_tensor(fn, "weight", weight, dtypes=FLOAT_DTYPES, shape=(hidden,))
    check_number(fn, "eps", eps, positive=False)
    check_inner_contiguous(fn, "x", x)
    check_inner_contiguous(fn, "weight", weight)
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        check_tensor(fn, "residual", residual, dtypes=(x.dtype,), shape=tuple(x.shape))
        check_inner_contiguous(fn, "residual", residual)
        tensors["residual"] = residual
    check_same_device(fn, tensors)

    rows = x.reshape(-1, hidden)
    out_dtype = x.dtype if weight_offset else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    res_rows = rows if residual is None else residual.reshape(-1, hidden)
    # Row-major like `out`, as the kernel writes both (empty_like keeps a permuted x's strides).
    new_residual = (
        torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    )
    if rows.shape[0] and hidden:
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            res_rows,
            weight,
            out,
            new_residual,
            rows.stride(0),
            res_rows.stride(0),
            hidden,
            float(eps),
            HAS_RESIDUAL=residual is not None,
            WEIGHT_OFFSET=float(weight_offset),
            BLOCK=triton.next_power_of_2(hidden),
        )
    return out if residual is None else (out, new_residual)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    new_res_ptr,
    stride_x,
    stride_res,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    WEIGHT_OFFSET: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x_dtype = x_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        # The sum is rounded to x's dtype first: the reference adds in that dtype.
        h = (h + r).to(x_dtype)
        tl.store(new_res_ptr + row * hidden + cols, h, mask=mask)
        h = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
    normed = h * rstd
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_OFFSET == 0.0:
        # Llama rounds the normalised row to x's dtype before scaling.
        normed = normed.to(x_dtype).to(tl.float32)
    else:
        # Gemma scales by (offset + weight) in float32 and rounds once, at the store.
        w = w + WEIGHT_OFFSET
    tl.store(out_ptr + row * hidden + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)
