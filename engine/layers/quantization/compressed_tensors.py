"""compressed-tensors checkpoints (llm-compressor's output, ``quant_method:
"compressed-tensors"``): FP8 weights (``float-quantized``) and int4 weight-only
(``pack-quantized``, W4A16).

A checkpoint's ``config_groups`` map module ``targets`` (``"Linear"``, or ``"re:"`` regular
expressions over module names) to a scheme of ``weights`` and ``input_activations`` arguments;
``ignore`` lists the modules left unquantized (``lm_head`` usually). Supported schemes:

- FP8 W8A8 / W8A16: ``weights`` float 8-bit, strategy ``tensor`` (``weight_scale`` one per
  projection), ``channel`` (``[N, 1]``) or ``block`` (``[ceil(N / bn), ceil(K / bk)]``);
  ``input_activations`` none, dynamic per ``token`` / ``tensor`` / ``group`` (the block's
  ``bk`` features), or static per ``tensor`` (``input_scale``).
- W4A16: ``weights`` int 4-bit, strategy ``group`` or ``channel``, symmetric (values stored
  ``q + 8``) or asymmetric (``weight_zero_point`` packed along the output), ``actorder``
  none, ``weight`` or ``group`` (``weight_g_idx``). ``weight_packed`` ``[N, K / 8]`` int32
  holds value ``k`` in bits ``[4 (k % 8), ...)`` of word ``k // 8``; ``weight_shape`` is the
  dense shape.

Anything else (other bit widths, sparsity, transforms, a ``kv_cache_scheme``) is refused by
name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvpilot.engine.layers.quantization.base_config import (
    STACKED_MODULES,
    LinearMethodBase,
    LinearWeightShape,
    QuantizationConfig,
    _matches,
    is_layer_skipped,
    new_parameter,
)
from kvpilot.engine.layers.quantization.fp8_utils import (
    ActivationScheme,
    Fp8LinearMethodBase,
    block_scale,
    per_row_scales,
    per_shard_scale,
    set_fp8_layout,
)
from kvpilot.engine.layers.quantization.int4_utils import (
    PACK_FACTOR,
    Int4LinearMethod,
    set_int4_layout,
    unpack_int4,
)

SUPPORTED_FORMATS = ("float-quantized", "pack-quantized")


@dataclass(frozen=True)
class Fp8Scheme:
    """FP8 weights: ``strategy`` tensor/channel/block (``block`` its ``(bn, bk)``) and how
    activations are quantized."""

    strategy: str
    block: tuple[int, int] | None
    activations: ActivationScheme


@dataclass(frozen=True)
class WNA16Scheme:
    """int4 weight-only: ``group_size`` (None per channel), ``symmetric``, ``actorder``."""

    group_size: int | None
    symmetric: bool
    actorder: str | None


def _scheme_name(group: dict[str, Any]) -> str:
    weights = group.get("weights") or {}
    acts = group.get("input_activations") or {}
    return (
        f"weights {weights.get('type')} {weights.get('num_bits')}-bit {weights.get('strategy')}, "
        f"input_activations {acts.get('type', 'none')} {acts.get('num_bits', '')} "
        f"{acts.get('strategy', '')} {'dynamic' if acts.get('dynamic') else 'static' if acts else ''}"
    ).strip()


def parse_scheme(group: dict[str, Any], fmt: str | None) -> Fp8Scheme | WNA16Scheme:
    """One ``config_groups`` entry as a supported scheme.

    Raises:
        ValueError: an unsupported format or scheme, named in the message.
    """
    fmt = group.get("format") or fmt
    weights = group.get("weights")
    acts = group.get("input_activations")
    if group.get("output_activations"):
        raise ValueError("compressed-tensors: output_activations quantization is not supported")
    if not weights:
        raise ValueError("compressed-tensors: a config group without weights is not supported")
    if fmt not in SUPPORTED_FORMATS:
        raise ValueError(
            f"compressed-tensors: format {fmt!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_FORMATS)}"
        )
    wtype, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    name = _scheme_name(group)
    if fmt == "float-quantized" and wtype == "float" and bits == 8:
        if not weights.get("symmetric", True) or weights.get("dynamic"):
            raise ValueError(f"compressed-tensors: unsupported FP8 scheme ({name})")
        block = None
        if strategy == "block":
            structure = weights.get("block_structure")
            if not structure or len(structure) != 2:
                raise ValueError(
                    f"compressed-tensors: block strategy without block_structure ({name})"
                )
            block = (int(structure[0]), int(structure[1]))
        elif strategy not in ("tensor", "channel"):
            raise ValueError(f"compressed-tensors: unsupported FP8 weight strategy ({name})")
        return Fp8Scheme(strategy, block, _activation_scheme(acts, block, name))
    if fmt == "pack-quantized" and wtype == "int" and bits == 4:
        if acts:
            raise ValueError(
                f"compressed-tensors: int4 weights with quantized activations ({name})"
            )
        if strategy not in ("group", "channel"):
            raise ValueError(f"compressed-tensors: unsupported int4 weight strategy ({name})")
        actorder = weights.get("actorder")
        if actorder not in (None, "weight", "group"):
            raise ValueError(f"compressed-tensors: unsupported actorder {actorder!r}")
        group_size = int(weights["group_size"]) if strategy == "group" else None
        return WNA16Scheme(group_size, bool(weights.get("symmetric", True)), actorder)
    raise ValueError(f"compressed-tensors: scheme not supported ({name}, format {fmt})")


def _activation_scheme(
    acts: dict[str, Any] | None, block: tuple[int, int] | None, name: str
) -> ActivationScheme:
    if not acts:
        return ActivationScheme.NONE
    if acts.get("type") != "float" or acts.get("num_bits") != 8:
        raise ValueError(f"compressed-tensors: unsupported input_activations ({name})")
    strategy, dynamic = acts.get("strategy"), bool(acts.get("dynamic"))
    if dynamic and strategy == "token":
        return ActivationScheme.TOKEN
    if dynamic and strategy == "tensor":
        return ActivationScheme.TENSOR
    if dynamic and strategy == "group" and block is not None and acts.get("group_size") == block[1]:
        return ActivationScheme.GROUP
    if not dynamic and strategy == "tensor":
        return ActivationScheme.STATIC
    raise ValueError(f"compressed-tensors: unsupported input_activations ({name})")


class CompressedTensorsConfig(QuantizationConfig):
    """A compressed-tensors checkpoint's schemes.

    Args:
        groups: ``(targets, scheme)`` per config group.
        ignore: module names or ``re:`` patterns left unquantized.
    """

    def __init__(
        self, groups: list[tuple[list[str], Fp8Scheme | WNA16Scheme]], ignore: list[str]
    ) -> None:
        self.groups = groups
        self.ignore = ignore

    @classmethod
    def get_name(cls) -> str:
        return "compressed-tensors"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(
                f"compressed-tensors: quantization_status {status!r} is not supported; only "
                "compressed checkpoints load"
            )
        for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
            if config.get(key):
                raise ValueError(f"compressed-tensors: {key} is not supported")
        groups = [
            (list(group.get("targets") or []), parse_scheme(group, config.get("format")))
            for group in (config.get("config_groups") or {}).values()
        ]
        if not groups:
            raise ValueError("compressed-tensors: quantization_config has no config_groups")
        return cls(groups, list(config.get("ignore") or []))

    def scheme_of(self, name: str) -> Fp8Scheme | WNA16Scheme | None:
        """The scheme of the checkpoint module ``name`` (None: no group targets it)."""
        for targets, scheme in self.groups:
            if any(t == "Linear" or _matches(t, name) for t in targets):
                return scheme
        return None

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if is_layer_skipped(prefix, self.ignore):
            return None
        parent, _, leaf = prefix.rpartition(".")
        names = [f"{parent}.{p}" for p in STACKED_MODULES.get(leaf, (leaf,))]
        schemes = {self.scheme_of(name) for name in names}
        if len(schemes) > 1:
            raise ValueError(
                f"compressed-tensors: {', '.join(names)} have different schemes; they are one "
                "stacked layer here"
            )
        scheme = schemes.pop()
        if scheme is None:
            return None
        if isinstance(scheme, Fp8Scheme):
            return CompressedTensorsW8A8Fp8(scheme)
        return CompressedTensorsWNA16(scheme)


class CompressedTensorsW8A8Fp8(Fp8LinearMethodBase):
    """FP8 weights with per-tensor, per-channel or block scales (see the module docstring)."""

    format_name = "compressed-tensors"

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def create_layer_weights(self, layer: nn.Module, shape: LinearWeightShape) -> None:
        self.create_fp8_weight(layer, shape)
        scheme = self.scheme
        if scheme.strategy == "tensor":
            layer.weight_scale = per_shard_scale(shape)
        elif scheme.strategy == "channel":
            layer.weight_scale = new_parameter((shape.rows, 1), torch.float32, output_dim=0)
        else:
            self.check_block_rows(layer, shape, scheme.block[0], "the block")
            layer.weight_scale = block_scale(shape, scheme.block)
        if scheme.activations is ActivationScheme.STATIC:
            layer.input_scale = per_shard_scale(shape)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scheme = self.scheme
        weight = layer.weight.data
        if scheme.strategy == "tensor":
            scales = per_row_scales(layer.weight_scale.data, layer.output_partition_sizes())
        else:
            scales = layer.weight_scale.data
        block = scheme.block or (1, weight.shape[1])
        static = scheme.activations is ActivationScheme.STATIC
        input_scale = layer.input_scale.data.max() if static else None
        set_fp8_layout(layer, weight, scales, block, scheme.activations, input_scale)


class CompressedTensorsWNA16(Int4LinearMethod):
    """int4 weight-only ``pack-quantized`` weights (see the module docstring)."""

    format_name = "compressed-tensors"

    def __init__(self, scheme: WNA16Scheme) -> None:
        self.scheme = scheme

    def create_layer_weights(self, layer: nn.Module, shape: LinearWeightShape) -> None:
        rows, cols, dtype = shape.rows, shape.cols, shape.params_dtype
        group = self.scheme.group_size
        self.check_packed_input(layer, shape, group)
        act_order = self.scheme.actorder == "group"
        layer.weight_packed = new_parameter(
            (rows, cols // PACK_FACTOR), torch.int32, output_dim=0, input_dim=1, input_div=8
        )
        layer.weight_shape = new_parameter((2,), torch.int64)
        if group is None:
            # One scale per output channel serves every input feature: replicated.
            layer.weight_scale = new_parameter((rows, 1), dtype, output_dim=0)
        elif act_order and shape.row_split:
            # Act-order groups are scattered over the input: every rank keeps all of them.
            layer.weight_scale = new_parameter(
                (rows, shape.input_size // group), dtype, output_dim=0
            )
        else:
            layer.weight_scale = new_parameter(
                (rows, cols // group), dtype, output_dim=0, input_dim=1, input_div=group
            )
        if not self.scheme.symmetric:
            self.check_output_multiple(layer, shape, PACK_FACTOR, str(PACK_FACTOR))
            num_groups = layer.weight_scale.shape[1]
            sharded = getattr(layer.weight_scale, "input_dim", None) is not None
            dims = {"input_dim": 1, "input_div": group} if sharded else {}
            layer.weight_zero_point = new_parameter(
                (rows // PACK_FACTOR, num_groups), torch.int32, output_dim=0, output_div=8, **dims
            )
        if act_order:
            layer.weight_g_idx = new_parameter(
                (cols,), torch.int32, input_dim=0, same_in_shards=True
            )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        values = unpack_int4(layer.weight_packed.data, 1)
        zeros = None
        if not self.scheme.symmetric:
            zeros = unpack_int4(layer.weight_zero_point.data, 0)
        g_idx = layer.weight_g_idx.data if self.scheme.actorder == "group" else None
        group = self.scheme.group_size or values.shape[1]
        dtype = layer.weight_scale.dtype
        scales = layer.weight_scale.data
        for name in (
            "weight_packed",
            "weight_shape",
            "weight_scale",
            "weight_zero_point",
            "weight_g_idx",
        ):
            layer._parameters.pop(name, None)
        set_int4_layout(layer, values, scales, zeros, group, g_idx, dtype)
