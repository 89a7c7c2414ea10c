"""The fp8 weight layout both fp8 formats (vLLM's ``fp8``, compressed-tensors' FP8) are
converted to, and its matmul.

After loading, a layer holds ``weight`` ``[N, K]`` float8_e4m3fn and ``weight_scale``
``[ceil(N / bn), ceil(K / bk)]`` float32 for a scale block ``layer.weight_block = (bn, bk)``:
per-tensor and per-channel scales become per-row ones (block ``(1, K)``; a stacked layer's
per-tensor scales, one per projection, become its rows' scales, which is exact), block-wise
ones (DeepSeek-V3's 128x128) stay as they are. ``layer.activation_scheme`` says how inputs are
quantized (:class:`ActivationScheme`); the scaled product follows vLLM's ``Fp8LinearOp``:
``(x_q * s_x) (W_q * s_w)^T``.
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from kvpilot.engine.layers.quantization.base_config import (
    LinearMethodBase,
    LinearWeightShape,
    new_parameter,
    replace_parameter,
)
from kvpilot.kernels.quant_reference import FP8_DTYPE, FP8_MAX, quantize_fp8_dynamic


class ActivationScheme(enum.Enum):
    """How a layer's inputs are quantized to fp8 before the matmul.

    Members:
        NONE: not at all (weight-only fp8, "W8A16").
        TOKEN: dynamically, one scale per token.
        TENSOR: dynamically, one scale for the whole batch.
        GROUP: dynamically, one scale per token and group of ``weight_block[1]`` features
            (DeepSeek-V3's 1x128 activation blocks).
        STATIC: with the checkpoint's ``input_scale``.
    """

    NONE = "none"
    TOKEN = "token"
    TENSOR = "tensor"
    GROUP = "group"
    STATIC = "static"


def set_fp8_layout(
    layer: nn.Module,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_block: tuple[int, int],
    activation_scheme: ActivationScheme,
    input_scale: torch.Tensor | None = None,
) -> None:
    """Replace ``layer``'s checkpoint parameters by the common fp8 layout.

    Args:
        layer: the linear layer.
        weight: ``[N, K]`` float8_e4m3fn.
        weight_scale: ``[ceil(N / bn), ceil(K / bk)]`` scales for ``weight_block``.
        weight_block: ``(bn, bk)``.
        activation_scheme: how inputs are quantized.
        input_scale: the static activation scale (a scalar) for ``STATIC``.
    """
    replace_parameter(layer, "weight", weight.contiguous())
    replace_parameter(layer, "weight_scale", weight_scale.float().contiguous())
    for name in ("weight_scale_inv", "input_scale"):
        replace_parameter(layer, name, None)
    if input_scale is not None:
        replace_parameter(layer, "input_scale", input_scale.float().reshape(1, 1))
    layer.weight_block = weight_block
    layer.activation_scheme = activation_scheme


def per_row_scales(scales: torch.Tensor, rows_per_scale: list[int]) -> torch.Tensor:
    """``[N, 1]`` row scales from one scale per stacked projection of ``rows_per_scale`` rows."""
    counts = torch.tensor(rows_per_scale, device=scales.device)
    return scales.float().reshape(-1).repeat_interleave(counts).unsqueeze(1)


def quantize_weight_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a dense weight to fp8 with one scale (``amax / 448``), as vLLM's online
    ``--quantization fp8`` does.

    Returns:
        ``(weight_fp8 [N, K], scale [1, 1] float32)``.
    """
    scale = (weight.abs().amax().float() / FP8_MAX).clamp(min=torch.finfo(torch.float32).eps)
    q = (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.reshape(1, 1)


def quantize_input(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` quantized as the layer's activation scheme says.

    Returns:
        ``(x_q [M, K], scales [M, Ka] float32)``; for ``NONE`` ``x`` itself with scales 1.
    """
    scheme = layer.activation_scheme
    num_m = x.shape[0]
    if scheme is ActivationScheme.NONE:
        return x, torch.ones(num_m, 1, device=x.device)
    if scheme is ActivationScheme.TOKEN:
        return quantize_fp8_dynamic(x, None)
    if scheme is ActivationScheme.GROUP:
        return quantize_fp8_dynamic(x, layer.weight_block[1])
    if scheme is ActivationScheme.TENSOR:
        scale = (x.abs().amax().float() / FP8_MAX).clamp(min=torch.finfo(torch.float32).eps)
    else:
        scale = layer.input_scale.reshape(())
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.reshape(1, 1).expand(num_m, 1)


def apply_fp8(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` for a layer in the common fp8 layout: the Triton scaled-matmul kernel on
    GPUs with fp8 tensor cores (compute capability 8.9+), dequantize then matmul elsewhere (the
    same quantized operands either way).

    Args:
        layer: see the module docstring.
        x: ``[..., K]``.
        bias: ``[N]`` or None.

    Returns:
        ``[..., N]`` in ``x``'s dtype.
    """
    flat = x.reshape(-1, x.shape[-1])
    x_q, x_scales = quantize_input(layer, flat)
    if x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9):
        from kvpilot.kernels.fp8_matmul import fp8_scaled_mm
    else:
        from kvpilot.kernels.quant_reference import fp8_scaled_mm
    out = fp8_scaled_mm(
        x_q, x_scales, layer.weight, layer.weight_scale, layer.weight_block, x.dtype
    )
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], out.shape[-1])


def per_shard_scale(shape: LinearWeightShape) -> nn.Parameter:
    """One float32 scale per stacked projection (``[num_shards]``; per-tensor weight or input
    scales)."""
    return new_parameter((shape.num_shards,), torch.float32, per_shard=True)


def block_scale(shape: LinearWeightShape, block: tuple[int, int]) -> nn.Parameter:
    """Block-wise weight scales ``[ceil(rows / bn), ceil(cols / bk)]`` float32 for
    ``block = (bn, bk)``, sharded along both dimensions by blocks."""
    bn, bk = block
    return new_parameter(
        (-(-shape.rows // bn), -(-shape.cols // bk)),
        torch.float32,
        output_dim=0,
        input_dim=1,
        output_div=bn,
        input_div=bk,
    )


class Fp8LinearMethodBase(LinearMethodBase):
    """A linear method whose weights end in the common fp8 layout (vLLM ``fp8``,
    compressed-tensors FP8)."""

    @staticmethod
    def create_fp8_weight(layer: nn.Module, shape: LinearWeightShape) -> None:
        """Register ``layer.weight`` ``[rows, cols]`` float8_e4m3fn."""
        layer.weight = new_parameter((shape.rows, shape.cols), FP8_DTYPE, output_dim=0, input_dim=1)

    def check_block_rows(
        self, layer: nn.Module, shape: LinearWeightShape, bn: int, what: str
    ) -> None:
        """Raise unless the output features of each projection on this rank are a multiple
        of the scale block's ``bn`` (``what`` names the block in the message, followed by
        ``bn``). A partial last block is possible only where the layer is one unsplit tensor,
        so an unstacked layer on one rank passes.

        Raises:
            ValueError: naming the format, the layer and the sizes.
        """
        if shape.num_shards > 1 or layer.tp_size > 1:
            self.check_output_multiple(layer, shape, bn, f"{what} {bn}")

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """See :func:`apply_fp8`."""
        return apply_fp8(layer, x, bias)
