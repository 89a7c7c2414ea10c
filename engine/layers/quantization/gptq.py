"""GPTQ checkpoints (Frantar et al. 2023, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers"), 4-bit, as AutoGPTQ / GPTQModel write them
(``quant_method: "gptq"``).

Per linear layer, with ``K`` input and ``N`` output features and ``num_groups`` groups:
``qweight`` ``[K / 8, N]`` int32 packs eight values along the input (bits ``[4i, 4i + 4)`` of
word ``r`` are input ``8 r + i``); ``qzeros`` ``[num_groups, N / 8]`` int32 packs the zero
points along the output, stored minus one in the original (``checkpoint_format: "gptq"``, v1)
layout and as they are in ``gptq_v2``; ``scales`` ``[num_groups, N]``; ``g_idx`` ``[K]`` the
group of each input feature. ``W[n, k] = (q[k, n] - z[g, n]) * s[g, n]`` with ``g = g_idx[k]``
under act-order (``desc_act: true``: groups follow the order columns were quantized in, so
they are scattered over the input), else ``k // group_size``. ``group_size: -1`` is one group
per output channel. Both ``sym`` settings load (the zero points are stored either way).
Other bit widths and per-module ``dynamic`` overrides are refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvpilot.engine.layers.quantization.base_config import (
    LinearMethodBase,
    LinearWeightShape,
    QuantizationConfig,
    is_layer_skipped,
    new_parameter,
)
from kvpilot.engine.layers.quantization.int4_utils import (
    PACK_FACTOR,
    Int4LinearMethod,
    set_int4_layout,
    unpack_int4,
)

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


class GPTQConfig(QuantizationConfig):
    """Settings of a GPTQ checkpoint.

    Args:
        weight_bits: must be 4.
        group_size: input features per group, or -1 for one group per output channel.
        desc_act: act-order (``g_idx`` decides each input feature's group).
        checkpoint_format: ``"gptq"`` (zero points stored minus one) or ``"gptq_v2"``.
        modules_to_not_convert: module names (substrings) left unquantized.

    Raises:
        ValueError: another bit width or format, named in the message.
    """

    def __init__(
        self,
        weight_bits: int,
        group_size: int,
        desc_act: bool,
        checkpoint_format: str,
        modules_to_not_convert: list[str],
    ) -> None:
        if weight_bits != 4:
            raise ValueError(f"gptq: {weight_bits}-bit weights are not supported; only 4-bit")
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"gptq: checkpoint_format {checkpoint_format!r} is not supported; supported: "
                f"{', '.join(CHECKPOINT_FORMATS)}"
            )
        if group_size != -1 and group_size < 1:
            raise ValueError(f"gptq: group_size must be positive or -1, got {group_size}")
        self.weight_bits = weight_bits
        self.group_size = group_size
        self.desc_act = desc_act
        self.checkpoint_format = checkpoint_format
        self.modules_to_not_convert = list(modules_to_not_convert)

    @classmethod
    def get_name(cls) -> str:
        return "gptq"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        if config.get("dynamic"):
            raise ValueError("gptq: per-module dynamic overrides are not supported")
        return cls(
            weight_bits=int(cls.get_from_keys(config, ["bits", "w_bit"])),
            group_size=int(cls.get_from_keys(config, ["group_size"])),
            desc_act=bool(config.get("desc_act", False)),
            checkpoint_format=str(config.get("checkpoint_format") or "gptq"),
            modules_to_not_convert=list(config.get("modules_to_not_convert") or []),
        )

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if is_layer_skipped(prefix, self.modules_to_not_convert, substring=True):
            return None
        return GPTQLinearMethod(self)


class GPTQLinearMethod(Int4LinearMethod):
    """Creates, converts and applies one layer's GPTQ weights (see the module docstring)."""

    format_name = "gptq"

    def __init__(self, config: GPTQConfig) -> None:
        self.config = config

    def create_layer_weights(self, layer: nn.Module, shape: LinearWeightShape) -> None:
        rows, cols = shape.rows, shape.cols
        group = self.config.group_size
        self.check_packed_input(layer, shape, group)
        self.check_output_multiple(layer, shape, PACK_FACTOR, str(PACK_FACTOR))
        packed_out = {"output_dim": 1, "output_div": PACK_FACTOR}
        layer.qweight = new_parameter(
            (cols // PACK_FACTOR, rows), torch.int32, input_dim=0, input_div=8, output_dim=1
        )
        layer.g_idx = new_parameter((cols,), torch.int32, input_dim=0, same_in_shards=True)
        if group == -1 or (self.config.desc_act and shape.row_split):
            # One group per channel, or act-order groups scattered over the whole input:
            # every rank keeps all groups.
            num_groups = 1 if group == -1 else shape.input_size // group
            grouped = {}
        else:
            num_groups = cols // group
            grouped = {"input_dim": 0, "input_div": group}
        layer.qzeros = new_parameter(
            (num_groups, rows // PACK_FACTOR), torch.int32, **grouped, **packed_out
        )
        layer.scales = new_parameter(
            (num_groups, rows), shape.params_dtype, output_dim=1, **grouped
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        values = unpack_int4(layer.qweight.data, 0).t()
        zeros = unpack_int4(layer.qzeros.data, 1)
        if self.config.checkpoint_format == "gptq":
            zeros = (zeros + 1) & 0xF
        g_idx = layer.g_idx.data if self.config.desc_act else None
        group = self.config.group_size if self.config.group_size != -1 else values.shape[1]
        scales = layer.scales.data.t()
        set_int4_layout(layer, values, scales, zeros.t(), group, g_idx, layer.scales.dtype)
