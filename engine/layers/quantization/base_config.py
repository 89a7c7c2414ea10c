"""The interface every quantization format implements (vLLM's ``QuantizationConfig`` and
``LinearMethodBase``).

A :class:`QuantizationConfig` is parsed from a checkpoint's ``quantization_config`` and hands
each linear layer a :class:`LinearMethodBase` (or None: the layer stays in the compute dtype).
The method creates the layer's parameters in the checkpoint's own layout, so checkpoint tensors
load by name; the parameters carry where their output and input features lie (see
:func:`set_weight_attrs`), which is what the tensor-parallel weight loaders of
:mod:`kvpilot.engine.layers.linear` shard by. Once every tensor is loaded,
``process_weights_after_loading`` converts them into the layout ``apply`` computes with.
"""

from __future__ import annotations

import fnmatch
import re
from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

# Names the stacked layers take in place of the checkpoint's projections.
STACKED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def set_weight_attrs(param: nn.Parameter, **attrs: Any) -> None:
    """Attach loading metadata to a quantized parameter.

    Attributes understood by the linear layers' weight loaders:
        output_dim: the dimension indexing output features (None: not split by output).
        input_dim: the dimension indexing input features (None: not split by input).
        output_div: output features per element along ``output_dim`` (8 for int4 packed
            along the output, a block size for block scales; default 1).
        input_div: input features per element along ``input_dim`` (8 for int4 packed along
            the input, the group size for group scales; default 1).
        per_shard: one scalar per stacked projection (per-tensor fp8 scales), shape
            ``[num_shards]``.
        same_in_shards: every stacked projection stores the same tensor (act-order
            ``g_idx``): loaded once, checked against the others.
    """
    for key, value in attrs.items():
        setattr(param, key, value)


def new_parameter(shape: tuple[int, ...], dtype: torch.dtype, **attrs: Any) -> nn.Parameter:
    """An uninitialised, frozen parameter of ``shape`` and ``dtype`` with loading attributes
    (see :func:`set_weight_attrs`)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    set_weight_attrs(param, **attrs)
    return param


def replace_parameter(layer: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Swap ``layer.<name>`` for a frozen parameter holding ``value`` (delete it when None)."""
    if name in layer._parameters:
        del layer._parameters[name]
    if value is not None:
        layer.register_parameter(name, nn.Parameter(value, requires_grad=False))


def _matches(pattern: str, name: str) -> bool:
    # compressed-tensors' "re:" prefix is a regular expression; otherwise a module name (or a
    # suffix of one, as AWQ's modules_to_not_convert lists them) or a glob.
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern) or fnmatch.fnmatchcase(name, pattern)


def is_layer_skipped(prefix: str, ignored: list[str], *, substring: bool = False) -> bool:
    """Whether the checkpoint leaves layer ``prefix`` unquantized.

    A stacked layer (``...qkv_proj``) is skipped when all its projections are; some but not
    all is an inconsistent checkpoint.

    Args:
        prefix: our module name, e.g. ``model.layers.0.self_attn.qkv_proj``.
        ignored: the checkpoint's list of unquantized module names or patterns.
        substring: a pattern matches any name containing it (AWQ's and GPTQ's
            ``modules_to_not_convert``).

    Raises:
        ValueError: only some projections of a stacked layer are ignored.
    """
    parent, _, leaf = prefix.rpartition(".")
    names = [f"{parent}.{p}" if parent else p for p in STACKED_MODULES.get(leaf, (leaf,))]

    def skipped(name: str) -> bool:
        return any((substring and p in name) or _matches(p, name) for p in ignored)

    flags = [skipped(name) for name in names]
    if any(flags) and not all(flags):
        raise ValueError(
            f"the checkpoint quantizes only some of {', '.join(names)}; they are one stacked "
            "layer here and must be quantized alike"
        )
    return all(flags)


class QuantizeMethodBase(ABC):
    """How one layer holds and uses quantized weights."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, **kwargs: Any) -> None:
        """Register the layer's parameters in the checkpoint's layout."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027
        """Convert the loaded parameters into the layout :meth:`apply` uses (default: keep)."""


class LinearMethodBase(QuantizeMethodBase):
    """How a linear layer holds its weight and computes ``x W^T + b``."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        """Register the weight's parameters on ``layer`` (checkpoint names and layout).

        Args:
            layer: the linear layer.
            input_size_per_partition: this rank's input features.
            output_partition_sizes: this rank's output features of each stacked projection.
            input_size, output_size: features of the whole layer.
            params_dtype: the compute dtype (scales are kept in it unless the format says).

        Raises:
            ValueError: sizes the format cannot hold (e.g. not a multiple of its group size),
                naming the size and the format.
        """

    @abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x`` ``[..., input_size_per_partition]`` -> ``[..., output_size_per_partition]``
        in ``x``'s dtype."""


class QuantizationConfig(ABC):
    """A checkpoint's quantization format, parsed from its ``quantization_config``."""

    @classmethod
    @abstractmethod
    def get_name(cls) -> str:
        """The format's ``quant_method`` (vLLM's ``--quantization`` name)."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Parse ``quantization_config``.

        Raises:
            ValueError: a setting this engine does not support, named in the message.
        """

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        """The method for linear layer ``prefix``; None keeps it unquantized."""

    @staticmethod
    def get_from_keys(config: dict[str, Any], keys: list[str], default: Any = ...) -> Any:
        """The first of ``keys`` present in ``config``.

        Raises:
            ValueError: none is present and no default is given.
        """
        for key in keys:
            if key in config:
                return config[key]
        if default is ...:
            raise ValueError(f"quantization_config has none of {keys}")
        return default
