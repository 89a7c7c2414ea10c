"""The int4 weight-only layout every int4 format is converted to, and its matmul.

AWQ, GPTQ and compressed-tensors' ``pack-quantized`` store the same thing, 4-bit integers
``q`` with one scale ``s`` (and zero point ``z``) per group of input features, packed
differently. After loading, each is repacked into one layout (:class:`Int4Layout`) so one CPU
path and one Triton kernel serve all three; the dequantized weight is
``W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)]`` with ``g(k) = g_idx[k]`` (GPTQ's act-order)
or ``k // group_size``.
"""

from __future__ import annotations

import torch
from torch import nn

from kvpilot.engine.layers.quantization.base_config import (
    LinearMethodBase,
    LinearWeightShape,
    replace_parameter,
)

PACK_FACTOR = 8  # int4 values per int32 word
# AWQ's GEMM packing: the value in bits [4i, 4i + 4) of a word is column ``8 * word + ORDER[i]``.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int4(
    packed: torch.Tensor, dim: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """Unpack int32 words into their eight 4-bit values (0..15) along ``dim``.

    Args:
        packed: int32 words; ``dim`` has ``n`` words.
        dim: the packed dimension (0 or 1 of a 2-D tensor).
        order: position within each group of eight of the value in bits ``[4i, 4i + 4)``;
            None is sequential (GPTQ, compressed-tensors), :data:`AWQ_PACK_ORDER` AWQ's.

    Returns:
        uint8 values with ``8 n`` entries along ``dim``.
    """
    moved = packed.movedim(dim, -1)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (moved.unsqueeze(-1) >> shifts) & 0xF
    if order is not None:
        inverse = torch.empty(PACK_FACTOR, dtype=torch.long)
        inverse[list(order)] = torch.arange(PACK_FACTOR)
        nibbles = nibbles[..., inverse.to(packed.device)]
    values = nibbles.flatten(-2).to(torch.uint8)
    return values.movedim(-1, dim)


def pack_int4_rows(values: torch.Tensor) -> torch.Tensor:
    """Pack ``[rows, 8 w]`` values (0..15) sequentially along dim 1 into ``[rows, w]`` int32."""
    if values.shape[1] % PACK_FACTOR:
        raise ValueError(f"has {values.shape[1]} columns, not a multiple of {PACK_FACTOR}")
    grouped = values.to(torch.int32).view(values.shape[0], -1, PACK_FACTOR)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=values.device)
    return (grouped << shifts).sum(-1, dtype=torch.int32)


def set_int4_layout(
    layer: nn.Module,
    values: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    g_idx: torch.Tensor | None,
    dtype: torch.dtype,
) -> None:
    """Replace ``layer``'s checkpoint parameters by the common layout.

    Args:
        layer: the linear layer; its ``qweight``, ``scales``, ``qzeros`` and ``g_idx`` are set
            (``qzeros`` and ``g_idx`` removed when None).
        values: ``[out_features, in_features]`` int4 values 0..15 (uint8).
        scales: ``[out_features, num_groups]`` group scales.
        zeros: ``[out_features, num_groups]`` zero points 0..15 (uint8), or None for 8
            (symmetric).
        group_size: input features per group (ignored where ``g_idx`` is given).
        g_idx: ``[in_features]`` int group of each input feature (GPTQ act-order), or None.
        dtype: the compute dtype the scales are kept in.
    """
    replace_parameter(layer, "qweight", pack_int4_rows(values).contiguous())
    replace_parameter(layer, "scales", scales.to(dtype).contiguous())
    replace_parameter(
        layer, "qzeros", None if zeros is None else zeros.to(torch.uint8).contiguous()
    )
    replace_parameter(layer, "g_idx", None if g_idx is None else g_idx.to(torch.int32).contiguous())
    layer.group_size = group_size


def apply_int4(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` for a layer in the common int4 layout: the Triton dequantize-and-matmul
    kernel on CUDA, dequantize then matmul on the CPU.

    Args:
        layer: holds ``qweight`` ``[N, K / 8]`` int32, ``scales`` ``[N, G]``, optionally
            ``qzeros`` ``[N, G]`` uint8 and ``g_idx`` ``[K]`` int32, and ``group_size``.
        x: ``[..., K]``.
        bias: ``[N]`` or None.

    Returns:
        ``[..., N]`` in ``x``'s dtype.
    """
    qzeros = layer._parameters.get("qzeros")
    g_idx = layer._parameters.get("g_idx")
    flat = x.reshape(-1, x.shape[-1])
    if x.is_cuda:
        from kvpilot.kernels.int4_matmul import int4_gemm
    else:
        from kvpilot.kernels.quant_reference import int4_gemm
    out = int4_gemm(flat, layer.qweight, layer.scales, qzeros, g_idx, layer.group_size)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], out.shape[-1])


class Int4LinearMethod(LinearMethodBase):
    """A linear method whose weights end in the common int4 layout (AWQ, GPTQ,
    compressed-tensors W4A16): they differ in ``create_layer_weights`` and
    ``process_weights_after_loading`` only."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """See :func:`apply_int4`."""
        return apply_int4(layer, x, bias)

    def check_packed_input(
        self, layer: nn.Module, shape: LinearWeightShape, group: int | None
    ) -> None:
        """Raise unless this rank's input features are a multiple of :data:`PACK_FACTOR` (the
        values are packed along the input) and of the group size ``group`` (None or -1: one
        group per output channel, nothing more to divide).

        Raises:
            ValueError: naming the format, the layer and the sizes.
        """
        grouped = group is not None and group != -1
        if shape.cols % PACK_FACTOR or (grouped and shape.cols % group):
            raise self.input_features_error(
                layer, shape, f"the group size {group} and of {PACK_FACTOR}"
            )
