"""How a checkpoint's ``quantization_config`` stores linear weights: bytes per weight and scales.

Sizing only (pure Python, no torch): the planner and ``ModelShape.weight_bytes`` ask how many
bytes one linear layer's shard holds on a GPU. The formats are the ones vLLM loads with the
same ``quant_method`` names:

- ``fp8`` (vLLM ``Fp8Config``; AutoFP8 and DeepSeek-V3 checkpoints, or ``--quantization fp8``
  of an unquantized checkpoint): 1 byte per weight; a float32 ``weight_scale`` per tensor, or
  with ``weight_block_size`` ``[128, 128]`` a float32 ``weight_scale_inv`` per 128 x 128 block;
  a float32 ``input_scale`` per tensor with ``activation_scheme: static``.
- ``compressed-tensors`` (llm-compressor): the ``weights`` scheme of the config group that
  targets ``Linear``: 8-bit float (``tensor``, ``channel`` or ``block`` strategy) or 4/8-bit
  int (``group``/``channel``) packed into int32; scales in the checkpoint's dtype, an int zero
  point per scale when not ``symmetric``.
- ``awq`` (AutoAWQ GEMM) and ``gptq`` (AutoGPTQ): ``bits`` packed into int32, float16
  ``scales`` and packed ``qzeros`` per group of ``group_size`` input channels (``-1``: one
  group per output channel); GPTQ also stores an int32 ``g_idx`` per input channel.

What stays at the checkpoint dtype: embeddings, the LM head, norms, biases, MoE routers (vLLM
builds those layers without a quantization method), and every module the config excludes
(compressed-tensors ``ignore``: exact names or ``re:`` regexes; ``fp8`` ``ignored_layers`` /
``modules_to_not_convert`` and AWQ ``modules_to_not_convert``: names containing the entry).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.layers.quantization import (
    QUANTIZATION_METHODS,
    missing_method_message,
    normalize_quantization_config,
)

SUPPORTED_QUANTIZATION_METHODS: tuple[str, ...] = QUANTIZATION_METHODS
"""The engine's own list (``engine/layers/quantization``): sizing covers exactly what loads."""
"""``quant_method`` values the kvpilot engine loads (vLLM's names; also ``--quantization``)."""

_SCALE_BYTES_FP32 = 4
_SCALE_BYTES_FP16 = 2
_INT32_BYTES = 4


class UnsupportedQuantizationError(ValueError):
    """A ``quantization_config`` this module cannot size; the message names the method or field."""


@dataclass(frozen=True)
class WeightQuantization:
    """The storage of every quantized linear layer of one checkpoint.

    Attributes:
        method: ``quant_method`` (one of ``SUPPORTED_QUANTIZATION_METHODS``).
        bits: bits per stored weight (8 or 4).
        weight_type: ``"float"`` (fp8) or ``"int"``.
        strategy: what one scale covers: ``"tensor"``, ``"channel"`` (one output row),
            ``"group"`` (``group_size`` input channels of one row) or ``"block"``
            (``block_size`` = (output rows, input columns)).
        scale_bytes: bytes per scale (float32 4, float16/bfloat16 2; ``None``: the checkpoint
            dtype, for compressed-tensors).
        group_size: input channels per scale for ``"group"``.
        block_size: (rows, columns) per scale for ``"block"``.
        zero_point: a zero point of ``bits`` bits is stored per scale (asymmetric int).
        input_scale: a float32 static activation scale is stored per tensor.
        channel_index: GPTQ's int32 ``g_idx`` per input channel is stored.
        ignore: module names (or ``re:`` regexes) left unquantized.
        ignore_by_substring: ``ignore`` entries match any module name containing them (fp8,
            AWQ), not only the whole name (compressed-tensors).
    """

    method: str
    bits: int
    weight_type: str
    strategy: str
    scale_bytes: int | None
    group_size: int | None = None
    block_size: tuple[int, int] | None = None
    zero_point: bool = False
    input_scale: bool = False
    channel_index: bool = False
    ignore: tuple[str, ...] = ()
    ignore_by_substring: bool = False

    @property
    def description(self) -> str:
        """For people, e.g. ``"awq int4, group 128"``, ``"fp8 float8, block 128x128"``."""
        kind = "float8" if self.weight_type == "float" else f"int{self.bits}"
        detail = {
            "group": f"group {self.group_size}",
            "block": f"block {self.block_size[0]}x{self.block_size[1]}"
            if self.block_size
            else "block",
        }.get(self.strategy, f"per-{self.strategy}")
        return f"{self.method} {kind}, {detail}"

    def quantizes(self, module: str) -> bool:
        """Whether the linear layer named ``module`` (transformers' name, e.g.
        ``model.layers.0.self_attn.q_proj``) is stored quantized."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return False
            elif entry == module or (self.ignore_by_substring and entry in module):
                return False
        return True

    def linear_bytes(self, in_features: int, out_features: int, dtype_bytes: int) -> int:
        """Bytes of one quantized linear shard of ``[out_features, in_features]`` weights.

        Args:
            in_features: input channels of this shard.
            out_features: output channels of this shard.
            dtype_bytes: the checkpoint dtype's bytes (compressed-tensors scales use it).
        """
        weights = math.ceil(in_features * out_features * self.bits / 8)
        scale = self.scale_bytes or dtype_bytes
        if self.strategy == "tensor":
            scales = 1
        elif self.strategy == "channel":
            scales = out_features
        elif self.strategy == "block":
            rows, cols = self.block_size or (128, 128)
            scales = math.ceil(out_features / rows) * math.ceil(in_features / cols)
        else:
            scales = out_features * math.ceil(in_features / (self.group_size or in_features))
        total = weights + scales * scale
        if self.zero_point:
            total += math.ceil(scales * self.bits / 8)
        if self.input_scale:
            total += _SCALE_BYTES_FP32
        if self.channel_index:
            total += in_features * _INT32_BYTES
        return total

    def shard_alignment(self) -> tuple[int, int]:
        """(output rows, input columns) a shard's sizes must be multiples of (vLLM's checks):
        the group size along the input of a group-quantized layer, the block of a block one."""
        if self.strategy == "group" and self.group_size:
            return 1, self.group_size
        if self.strategy == "block" and self.block_size:
            return self.block_size
        return 1, 1


def parse_quantization_config(config: Any) -> WeightQuantization | None:
    """The storage a ``config.json``'s ``quantization_config`` describes (None without one).

    The config is read as the engine reads it (``normalize_quantization_config``): a method
    name or JSON text given as a string, the method's name in any case.

    Raises:
        UnsupportedQuantizationError: no ``quant_method``, a method outside
            ``SUPPORTED_QUANTIZATION_METHODS`` (named), a scheme of a supported method that this
            module does not size (named), or a config that is not an object, a method name or
            an object's JSON text.
    """
    try:
        config = normalize_quantization_config(config)
    except ValueError as exc:
        raise UnsupportedQuantizationError(str(exc)) from None
    if config is None:
        return None
    if config.get("quant_method") is None:
        raise UnsupportedQuantizationError(missing_method_message())
    method = str(config["quant_method"])
    if method == "fp8":
        return _fp8(config)
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method in ("awq", "gptq"):
        return _awq_gptq(method, config)
    raise UnsupportedQuantizationError(
        f"quantization method {method!r} is not supported; the kvpilot engine loads "
        f"{', '.join(SUPPORTED_QUANTIZATION_METHODS)}"
    )


def online_quantization(method: str) -> WeightQuantization:
    """What ``--quantization method`` makes of an unquantized checkpoint: vLLM quantizes to fp8
    with one scale per tensor (dynamic activation scales) while loading; the other methods
    need a checkpoint quantized in their own format.

    Raises:
        UnsupportedQuantizationError: a method other than ``fp8`` (named).
    """
    if method != "fp8":
        raise UnsupportedQuantizationError(
            f"--quantization {method} needs a checkpoint quantized with {method}; only fp8 "
            "quantizes an unquantized checkpoint while loading"
        )
    return _fp8({"quant_method": "fp8", "activation_scheme": "dynamic"})


def _fp8(config: dict) -> WeightQuantization:
    block = config.get("weight_block_size")
    ignore = tuple(config.get("ignored_layers") or ()) + tuple(
        config.get("modules_to_not_convert") or ()
    )
    common = {
        "method": "fp8",
        "bits": 8,
        "weight_type": "float",
        "scale_bytes": _SCALE_BYTES_FP32,
        "input_scale": config.get("activation_scheme") == "static",
        "ignore": ignore,
        "ignore_by_substring": True,
    }
    if block:
        if not (isinstance(block, list | tuple) and len(block) == 2):
            raise UnsupportedQuantizationError(
                f"fp8 weight_block_size must be [rows, columns], got {block!r}"
            )
        return WeightQuantization(
            strategy="block", block_size=(int(block[0]), int(block[1])), **common
        )
    return WeightQuantization(strategy="tensor", **common)


def _compressed_tensors(config: dict) -> WeightQuantization:
    groups = config.get("config_groups") or {}
    schemes = [g for g in groups.values() if isinstance(g, dict) and g.get("weights")]
    if len(schemes) != 1:
        raise UnsupportedQuantizationError(
            f"compressed-tensors with {len(schemes)} weight schemes in config_groups; one is "
            "supported"
        )
    weights = schemes[0]["weights"]
    bits, kind = int(weights.get("num_bits") or 0), str(weights.get("type") or "")
    strategy = str(weights.get("strategy") or "tensor")
    activations = schemes[0].get("input_activations") or None
    name = f"compressed-tensors {kind}{bits} {strategy}"
    if kind == "float" and bits == 8 and strategy in ("tensor", "channel", "block"):
        pass
    elif kind == "int" and bits in (4, 8) and strategy in ("group", "channel") and not activations:
        pass
    else:
        raise UnsupportedQuantizationError(
            f"{name} (activations {'quantized' if activations else 'not quantized'}) is not "
            "supported; the kvpilot engine loads FP8 (tensor, channel, block) and int4/int8 "
            "weight-only (group, channel) schemes"
        )
    block = weights.get("block_structure")
    static_input = bool(activations) and not activations.get("dynamic", False)
    return WeightQuantization(
        method="compressed-tensors",
        bits=bits,
        weight_type=kind,
        strategy=strategy,
        scale_bytes=None,
        group_size=int(weights["group_size"]) if strategy == "group" else None,
        block_size=(int(block[0]), int(block[1])) if strategy == "block" and block else None,
        zero_point=kind == "int" and not weights.get("symmetric", True),
        input_scale=static_input and activations.get("strategy") == "tensor",
        ignore=tuple(config.get("ignore") or ()),
    )


def _awq_gptq(method: str, config: dict) -> WeightQuantization:
    bits = int(config.get("bits") or config.get("w_bit") or 0)
    if bits not in (4, 8):
        raise UnsupportedQuantizationError(f"{method} with {bits} bits is not supported (4 or 8)")
    group = int(config.get("group_size") or config.get("q_group_size") or -1)
    return WeightQuantization(
        method=method,
        bits=bits,
        weight_type="int",
        strategy="group" if group > 0 else "channel",
        scale_bytes=_SCALE_BYTES_FP16,
        group_size=group if group > 0 else None,
        # Both store packed qzeros (GPTQ even when symmetric); GPTQ also g_idx.
        zero_point=True,
        channel_index=method == "gptq",
        ignore=tuple(config.get("modules_to_not_convert") or ()),
        ignore_by_substring=True,
    )
