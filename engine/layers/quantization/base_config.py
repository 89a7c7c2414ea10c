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
from dataclasses import dataclass
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


@dataclass(frozen=True)
class LinearWeightShape:
    """The sizes a linear method creates one layer's parameters for (the arguments of
    :meth:`LinearMethodBase.create_weights`).

    Attributes:
        output_partition_sizes: this rank's output features of each stacked projection.
        cols: this rank's input features (``input_size_per_partition``).
        input_size, output_size: features of the whole layer.
        params_dtype: the compute dtype.
    """

    output_partition_sizes: tuple[int, ...]
    cols: int
    input_size: int
    output_size: int
    params_dtype: torch.dtype

    @property
    def rows(self) -> int:
        """This rank's output features, all stacked projections together."""
        return sum(self.output_partition_sizes)

    @property
    def num_shards(self) -> int:
        """How many projections are stacked (1 for an unstacked layer)."""
        return len(self.output_partition_sizes)

    @property
    def row_split(self) -> bool:
        """Whether the input features are split over the ranks (a row-parallel layer)."""
        return self.cols != self.input_size


class LinearMethodBase(QuantizeMethodBase):
    """How a linear layer holds its weight and computes ``x W^T + b``.

    Subclasses implement :meth:`create_layer_weights` (called by :meth:`create_weights` with
    the sizes gathered in a :class:`LinearWeightShape`), and check the sizes their format can
    hold with :meth:`check_output_multiple` and :meth:`input_features_error`, whose messages
    start with :attr:`format_name`.
    """

    #: The format's name in error messages (its ``quant_method``).
    format_name = ""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        """Register the weight's parameters on ``layer`` (checkpoint names and layout): see
        :meth:`create_layer_weights`.

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
        shape = LinearWeightShape(
            tuple(output_partition_sizes),
            input_size_per_partition,
            input_size,
            output_size,
            params_dtype,
        )
        self.create_layer_weights(layer, shape)

    @abstractmethod
    def create_layer_weights(self, layer: nn.Module, shape: LinearWeightShape) -> None:
        """Register the weight's parameters on ``layer`` for this rank's ``shape``.

        Raises:
            ValueError: sizes the format cannot hold, naming the size and the format.
        """

    def check_output_multiple(
        self, layer: nn.Module, shape: LinearWeightShape, multiple: int, what: str
    ) -> None:
        """Raise unless each stacked projection's output features on this rank are a multiple
        of ``multiple`` (``what`` names it in the message, e.g. ``"the block 128"``).

        Raises:
            ValueError: naming the format, the layer and the sizes.
        """
        if any(size % multiple for size in shape.output_partition_sizes):
            raise ValueError(
                f"{self.format_name}: {layer.prefix} has {list(shape.output_partition_sizes)} "
                f"output features per projection and rank, not multiples of {what}"
            )

    def input_features_error(
        self, layer: nn.Module, shape: LinearWeightShape, what: str
    ) -> ValueError:
        """The error for this rank's input features not being a multiple of ``what`` (e.g.
        ``"the group size 128"``), naming the format and the layer."""
        return ValueError(
            f"{self.format_name}: {layer.prefix} has {shape.cols} input features per rank, not "
            f"a multiple of {what}"
        )

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
