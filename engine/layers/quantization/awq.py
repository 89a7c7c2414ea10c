"""AWQ checkpoints (Lin et al. 2024, "AWQ: Activation-aware Weight Quantization"), AutoAWQ's
GEMM packing (``quant_method: "awq"``, ``version: "gemm"``).

Per linear layer, with ``K`` input and ``N`` output features and groups of ``G`` inputs:
``qweight`` ``[K, N / 8]`` int32 and ``qzeros`` ``[K / G, N / 8]`` int32 hold eight 4-bit
values per word along the output in AWQ's interleaved order (bits ``[4i, 4i + 4)`` of word
``w`` are column ``8 w + (0, 2, 4, 6, 1, 3, 5, 7)[i]``), ``scales`` ``[K / G, N]`` (float16);
``W[n, k] = (q[k, n] - z[k / G, n]) * s[k / G, n]``. ``modules_to_not_convert`` stay in the
compute dtype. GEMV packing and ``zero_point: false`` are refused.
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
    AWQ_PACK_ORDER,
    PACK_FACTOR,
    Int4LinearMethod,
    set_int4_layout,
    unpack_int4,
)


class AWQConfig(QuantizationConfig):
    """Settings of an AWQ checkpoint.

    Args:
        weight_bits: must be 4.
        group_size: input features per scale.
        zero_point: must be True (AutoAWQ's GEMM kernels are asymmetric).
        modules_to_not_convert: module names (substrings) left unquantized.

    Raises:
        ValueError: another bit width, version or zero-point setting, named in the message.
    """

    def __init__(
        self,
        weight_bits: int,
        group_size: int,
        zero_point: bool,
        modules_to_not_convert: list[str],
        version: str = "gemm",
    ) -> None:
        if weight_bits != 4:
            raise ValueError(f"awq: {weight_bits}-bit weights are not supported; only 4-bit")
        if str(version).lower() != "gemm":
            raise ValueError(f"awq: version {version!r} is not supported; only gemm packing")
        if not zero_point:
            raise ValueError("awq: zero_point false is not supported")
        if group_size < 1:
            raise ValueError(f"awq: group_size must be positive, got {group_size}")
        self.weight_bits = weight_bits
        self.group_size = group_size
        self.modules_to_not_convert = list(modules_to_not_convert)

    @classmethod
    def get_name(cls) -> str:
        return "awq"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        return cls(
            weight_bits=int(cls.get_from_keys(config, ["w_bit", "bits"])),
            group_size=int(cls.get_from_keys(config, ["q_group_size", "group_size"])),
            zero_point=bool(cls.get_from_keys(config, ["zero_point"], True)),
            modules_to_not_convert=list(config.get("modules_to_not_convert") or []),
            version=str(cls.get_from_keys(config, ["version"], "gemm")),
        )

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if is_layer_skipped(prefix, self.modules_to_not_convert, substring=True):
            return None
        return AWQLinearMethod(self)


class AWQLinearMethod(Int4LinearMethod):
    """Creates, converts and applies one layer's AWQ weights (see the module docstring)."""

    format_name = "awq"

    def __init__(self, config: AWQConfig) -> None:
        self.config = config

    def create_layer_weights(self, layer: nn.Module, shape: LinearWeightShape) -> None:
        group = self.config.group_size
        rows, cols = shape.rows, shape.cols
        if cols % group:
            raise self.input_features_error(layer, shape, f"the group size {group}")
        self.check_output_multiple(layer, shape, PACK_FACTOR, str(PACK_FACTOR))
        packed = {"output_dim": 1, "output_div": PACK_FACTOR}
        grouped = {"input_dim": 0, "input_div": group}
        layer.qweight = new_parameter(
            (cols, rows // PACK_FACTOR), torch.int32, input_dim=0, **packed
        )
        layer.qzeros = new_parameter(
            (cols // group, rows // PACK_FACTOR), torch.int32, **grouped, **packed
        )
        layer.scales = new_parameter(
            (cols // group, rows), shape.params_dtype, output_dim=1, **grouped
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        values = unpack_int4(layer.qweight.data, 1, AWQ_PACK_ORDER).t()
        zeros = unpack_int4(layer.qzeros.data, 1, AWQ_PACK_ORDER).t()
        scales = layer.scales.data.t()
        set_int4_layout(
            layer, values, scales, zeros, self.config.group_size, None, layer.scales.dtype
        )
