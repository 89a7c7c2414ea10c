"""vLLM's ``fp8`` format: fp8 (e4m3) weights with per-tensor or 128x128 block scales.

Checkpoints (``quant_method: "fp8"``): each linear layer's ``weight`` is float8_e4m3fn with

- a per-tensor ``weight_scale`` (one scalar per projection; AutoFP8 and llm-compressor's
  older exports), activations quantized per tensor at run time (``activation_scheme:
  "dynamic"``) or with the checkpoint's ``input_scale`` (``"static"``); or
- block-wise ``weight_scale_inv`` ``[ceil(N / bn), ceil(K / bk)]`` for ``weight_block_size:
  [bn, bk]`` (DeepSeek-V3, Liu et al. 2024, section 3.3: 128x128 weight blocks, activations
  quantized per token and group of 128 features at run time). Despite its name it multiplies:
  ``W = W_q * weight_scale_inv``.

``ignored_layers`` / ``modules_to_not_convert`` stay in the compute dtype. A checkpoint that is
not fp8 (``--quantization fp8`` on a 16/32-bit one) is quantized while loading, one scale per
tensor, as vLLM does.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from kvpilot.engine.layers.quantization.base_config import (
    LinearMethodBase,
    LinearWeightShape,
    QuantizationConfig,
    is_layer_skipped,
    new_parameter,
)
from kvpilot.engine.layers.quantization.fp8_utils import (
    ActivationScheme,
    Fp8LinearMethodBase,
    block_scale,
    per_row_scales,
    per_shard_scale,
    quantize_weight_per_tensor,
    set_fp8_layout,
)


class Fp8Config(QuantizationConfig):
    """Settings of an ``fp8`` checkpoint.

    Args:
        is_checkpoint_fp8_serialized: the weights are stored in fp8 (else quantized at load).
        activation_scheme: ``"dynamic"`` or ``"static"``.
        ignored_layers: module names left unquantized.
        weight_block_size: ``[bn, bk]`` for block-wise scales, or None (per tensor).

    Raises:
        ValueError: an unknown activation scheme, static activations with block scales, or a
            malformed block size.
    """

    def __init__(
        self,
        is_checkpoint_fp8_serialized: bool,
        activation_scheme: str,
        ignored_layers: list[str],
        weight_block_size: list[int] | None,
    ) -> None:
        if activation_scheme not in ("dynamic", "static"):
            raise ValueError(
                f"fp8: unsupported activation_scheme {activation_scheme!r}; expected dynamic or "
                "static"
            )
        if weight_block_size is not None:
            if len(weight_block_size) != 2 or any(int(b) < 1 for b in weight_block_size):
                raise ValueError(
                    f"fp8: weight_block_size must be [bn, bk], got {weight_block_size}"
                )
            if activation_scheme != "dynamic":
                raise ValueError("fp8: block-wise weight scales need activation_scheme dynamic")
            if not is_checkpoint_fp8_serialized:
                raise ValueError(
                    "fp8: weight_block_size applies to fp8-serialized checkpoints only"
                )
        self.is_checkpoint_fp8_serialized = is_checkpoint_fp8_serialized
        self.activation_scheme = activation_scheme
        self.ignored_layers = list(ignored_layers)
        self.weight_block_size = (
            None if weight_block_size is None else tuple(int(b) for b in weight_block_size)
        )

    @classmethod
    def get_name(cls) -> str:
        return "fp8"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        return cls(
            is_checkpoint_fp8_serialized=bool(config.get("is_checkpoint_fp8_serialized", True)),
            activation_scheme=str(config.get("activation_scheme", "dynamic")),
            ignored_layers=list(
                config.get("ignored_layers") or config.get("modules_to_not_convert") or []
            ),
            weight_block_size=config.get("weight_block_size"),
        )

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if is_layer_skipped(prefix, self.ignored_layers, substring=True):
            return None
        return Fp8LinearMethod(self)


class Fp8LinearMethod(Fp8LinearMethodBase):
    """Creates, converts and applies one layer's ``fp8`` weights (see the module docstring)."""

    format_name = "fp8"

    def __init__(self, config: Fp8Config) -> None:
        self.config = config

    def create_layer_weights(self, layer: nn.Module, shape: LinearWeightShape) -> None:
        if not self.config.is_checkpoint_fp8_serialized:
            layer.weight = new_parameter(
                (shape.rows, shape.cols), shape.params_dtype, output_dim=0, input_dim=1
            )
            return
        self.create_fp8_weight(layer, shape)
        block = self.config.weight_block_size
        if block is not None:
            bn, bk = block
            self.check_block_rows(layer, shape, bn, "the weight block")
            if shape.row_split and shape.cols % bk:
                raise self.input_features_error(layer, shape, f"the weight block {bk}")
            layer.weight_scale_inv = block_scale(shape, block)
            return
        layer.weight_scale = per_shard_scale(shape)
        if self.config.activation_scheme == "static":
            layer.input_scale = per_shard_scale(shape)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        block = self.config.weight_block_size
        if not self.config.is_checkpoint_fp8_serialized:
            weight, scale = quantize_weight_per_tensor(layer.weight.data)
            whole = (weight.shape[0], weight.shape[1])
            set_fp8_layout(layer, weight, scale, whole, ActivationScheme.TENSOR)
        elif block is not None:
            set_fp8_layout(
                layer, layer.weight.data, layer.weight_scale_inv.data, block, ActivationScheme.GROUP
            )
        else:
            scales = per_row_scales(layer.weight_scale.data, layer.output_partition_sizes())
            static = self.config.activation_scheme == "static"
            set_fp8_layout(
                layer,
                layer.weight.data,
                scales,
                (1, layer.weight.shape[1]),
                ActivationScheme.STATIC if static else ActivationScheme.TENSOR,
                # vLLM's rule: the stacked projections share the largest input scale.
                layer.input_scale.data.max() if static else None,
            )
