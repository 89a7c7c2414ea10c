"""Gated activations ``act(gate) * up`` as one Triton kernel parameterised by the activation:
SwiGLU (reference: ``reference.silu_and_mul``) and GeGLU, exact or tanh-approximated GELU
(reference: ``reference.gelu_and_mul``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels._utils import FLOAT_DTYPES, check_inner_contiguous, check_tensor

_MAX_BLOCK = 1024

# F.gelu's `approximate` -> the kernel's ACTIVATION.
_GELU_ACTIVATIONS = {"none": "gelu", "tanh": "gelu_tanh"}


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
    return _act_and_mul("silu_and_mul", x, "silu")


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GeGLU activation (Shazeer 2020): ``gelu(x[..., :d]) * x[..., d:]``, GELU exact or with
    PyTorch's tanh approximation (Hendrycks & Gimpel 2016); Gemma's ``gelu_pytorch_tanh`` is
    ``approximate="tanh"``.

    Rounds like the PyTorch reference: ``gelu`` is computed in float32 and rounded to ``x``'s
    dtype before the product, which is rounded again. The tanh form is evaluated as
    ``g * sigmoid(2 * sqrt(2 / pi) * (g + 0.044715 * g^3))``, which equals
    ``0.5 * g * (1 + tanh(...))`` (float32 rounding apart).

    Args:
        x: ``[..., 2 * d]`` float16, bfloat16 or float32, contiguous in the last dimension
            (gate and up projections concatenated).
        approximate: ``"none"`` (exact, erf) or ``"tanh"``, as ``F.gelu``'s argument.

    Returns:
        ``[..., d]``, ``x``'s dtype, a new contiguous tensor.

    Raises:
        ValueError: ``x`` is not a floating tensor of rank >= 1 with an even last dimension,
            its last dimension is strided, or ``approximate`` is another value.
    """
    fn = "gelu_and_mul"
    if approximate not in _GELU_ACTIVATIONS:
        raise ValueError(f"{fn}: approximate must be 'none' or 'tanh', got {approximate!r}")
    return _act_and_mul(fn, x, _GELU_ACTIVATIONS[approximate])


def _act_and_mul(fn: str, x: torch.Tensor, activation: str) -> torch.Tensor:
    """Check ``x`` for ``fn`` and launch the gated-activation kernel with ``activation``."""
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
    _act_and_mul_kernel[grid](rows, out, rows.stride(0), d, ACTIVATION=activation, BLOCK=block)
    return out


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, d, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    # One program: BLOCK columns of one row. ACTIVATION: "silu", "gelu" or "gelu_tanh".
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == "gelu":
        act = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))  # 1 / sqrt(2)
    else:
        # silu(g) = g * sigmoid(g); tanh-GELU(g) = g * sigmoid(2 * inner), as
        # 0.5 * (1 + tanh(z)) = sigmoid(2 * z), with inner = sqrt(2 / pi) * (g + 0.044715 g^3).
        z = gate
        if ACTIVATION == "gelu_tanh":
            z = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)  # 2 * sqrt(2 / pi)
        # z >= -80 keeps exp finite; below it the sigmoid is under 2e-35 either way.
        act = gate / (1.0 + tl.exp(-tl.maximum(z, -80.0)))
    dtype = out_ptr.dtype.element_ty
    act = act.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * d + cols, (act * up).to(dtype), mask=mask)
