"""Linear projections, sharded Megatron-style across tensor-parallel ranks.

Following vLLM, projections that read the same input are stacked into one matrix (q/k/v into
``qkv_proj``, gate/up into ``gate_up_proj``): one matmul instead of several. Each parameter
carries a ``weight_loader(param, loaded, shard_id)`` that copies this rank's piece of one
checkpoint tensor into its place, so the model's name mapping stays a table; a stacked layer
also takes a checkpoint tensor that is already stacked (Phi-3's fused ``qkv_proj``) and cuts it
into its shards.

Tensor parallelism follows Megatron-LM (Shoeybi et al. 2019, section 3): a column-parallel
layer splits its output features across ranks (each rank computes its slice, no
communication); a row-parallel layer splits its input features, each rank computes a partial
product and an all-reduce sums them. A column-parallel layer followed by a row-parallel one
(q/k/v -> attention -> o, gate/up -> SiLU -> down) needs one all-reduce per pair. With one rank
every layer is an ordinary matmul over the whole weight
(:func:`kvpilot.engine.layers.cpu_gemm.linear`).

A layer's weight is held and multiplied by its quantization method (vLLM's
``LinearMethodBase``, :mod:`kvpilot.engine.layers.quantization`): the unquantized one is a
dense ``[out, in]`` matrix; a quantized format registers its own parameters (packed int4
words, fp8 values, scales), each marked with the dimensions of its output and input features
and how many features one element covers (``output_div``, ``input_div``), which is all the
loaders need to cut a rank's piece of a packed tensor.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvpilot.engine.distributed import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from kvpilot.engine.layers.cpu_gemm import is_gated, is_packed, linear, prepack, silu_and_mul
from kvpilot.engine.layers.quantization.base_config import (
    LinearMethodBase,
    LinearWeightShape,
    new_parameter,
)
from kvpilot.engine.layers.weight_loading import (
    CheckpointTensor,
    copy_weight,
    load_shard,
    narrow,
    shape_of,
)

if TYPE_CHECKING:
    from kvpilot.engine.layers.quantization import QuantizationConfig

__all__ = [
    "ColumnParallelLinear",
    "Linear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RowParallelLinear",
    "copy_weight",
    "prepack_linear_weights",
]

# Where one checkpoint tensor (or one stacked shard of it) goes: the parameter region to fill,
# the shape the whole checkpoint tensor must have, the sharded dimension, and where this rank's
# piece starts along it.
Placement = tuple[torch.Tensor, tuple[int, ...], int, int]


def _elements(features: int, div: int, what: str, strict: bool) -> int:
    """Elements covering ``features`` features at ``div`` features per element."""
    if strict and features % div:
        raise ValueError(
            f"{what} {features} is not a multiple of {div} (the quantization format's packing, "
            "group or block size)"
        )
    return math.ceil(features / div)


class UnquantizedLinearMethod(LinearMethodBase):
    """The dense weight: ``weight`` ``[out_features, in_features]`` in the compute dtype."""

    def create_layer_weights(self, layer: nn.Module, shape: LinearWeightShape) -> None:
        """Register ``layer.weight`` (this rank's rows or columns)."""
        layer.weight = new_parameter(
            (shape.rows, shape.cols), shape.params_dtype, output_dim=0, input_dim=1
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing to convert."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x W^T + b`` (see :func:`~kvpilot.engine.layers.cpu_gemm.linear`)."""
        return linear(x, layer.weight, bias)


class Linear(nn.Module):
    """``y = x W^T + b`` with uninitialised parameters (they are always loaded).

    The base class is replicated: every rank holds the whole weight. Subclasses hold a
    partition and say where each checkpoint tensor's piece goes (:meth:`placement`).

    Args:
        input_size, output_size: feature sizes of the whole (unsharded) layer.
        bias: whether a bias vector is present.
        input_size_per_partition, output_size_per_partition: this rank's parameter sizes
            (default: the whole layer).
        quant_config: the checkpoint's quantization format, or None (dense weights).
        prefix: the layer's module name (``model.layers.0.self_attn.qkv_proj``): the format
            looks it up in its list of unquantized layers.

    Attributes:
        pack_gated: set on a stacked gate/up projection whose activation is SiLU (a SwiGLU
            MLP's ``gate_up_proj``): :func:`prepack_linear_weights` then packs its weight for
            :meth:`MergedColumnParallelLinear.forward_silu_and_mul`. False by default.

    Raises:
        ValueError: sizes the quantization format cannot hold (named in the message).
    """

    pack_gated = False

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        input_size_per_partition: int | None = None,
        output_size_per_partition: int | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = input_size_per_partition or input_size
        self.output_size_per_partition = output_size_per_partition or output_size
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.prefix = prefix
        method = quant_config.get_quant_method(self, prefix) if quant_config else None
        self.quant_method = method or UnquantizedLinearMethod()
        self.quant_method.create_weights(
            self,
            self.input_size_per_partition,
            self.output_partition_sizes(),
            input_size,
            output_size,
            torch.get_default_dtype(),
        )
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.output_size_per_partition), requires_grad=False
            )
            self.bias.output_dim = 0
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader

    def output_partition_sizes(self) -> list[int]:
        """This rank's output features of each stacked projection (one entry unstacked)."""
        return [self.output_size_per_partition]

    def output_shard(self, shard_id: str | int | None) -> tuple[int, int, int, int]:
        """``(offset in this rank's rows, rows, checkpoint tensor rows, first checkpoint row)``
        of one stacked shard (of the whole output when not stacked), in output features."""
        if shard_id is not None:
            raise ValueError(f"is a stacked shard ({shard_id!r}) of a layer that stacks nothing")
        return 0, self.output_size_per_partition, self.output_size, 0

    def input_shard(self) -> tuple[int, int] | None:
        """``(checkpoint tensor columns, first checkpoint column)`` of this rank's input
        features, or None where every rank holds all of them."""
        return None

    def stacked_shards(self) -> list[tuple[str | int, int]]:
        """``(shard id, checkpoint rows)`` of each stacked projection in output order; empty
        for a layer that stacks nothing."""
        return []

    def placement(self, param: nn.Parameter, shard_id: str | int | None) -> Placement:
        """Where ``param``'s checkpoint tensor (or its stacked shard ``shard_id``) goes.

        The parameter's ``output_dim`` / ``input_dim`` say which dimensions hold output and
        input features, ``output_div`` / ``input_div`` how many features one element covers
        (:func:`~kvpilot.engine.layers.quantization.base_config.set_weight_attrs`); the dense
        weight is ``output_dim=0, input_dim=1``, both 1.

        Raises:
            ValueError: a ``shard_id`` for a layer that stacks nothing, or a rank's piece that
                does not fall on the format's packing, group or block boundaries.
        """
        target, full = param.data, list(param.shape)
        dim = start = 0
        out_dim = getattr(param, "output_dim", None)
        offset, rows, full_rows, out_start = self.output_shard(shard_id)
        if out_dim is not None:
            div = getattr(param, "output_div", 1)
            # A partial last block is fine when this is the whole tensor.
            strict = rows != full_rows
            n = _elements(rows, div, "output features per shard", strict)
            first = _elements(offset, div, "output offset", True)
            target = target.narrow(out_dim, first, n)
            full[out_dim] = _elements(full_rows, div, "output features", False)
            dim, start = out_dim, _elements(out_start, div, "output offset", strict)
        in_dim = getattr(param, "input_dim", None)
        input_shard = self.input_shard()
        if in_dim is not None and input_shard is not None:
            full_cols, in_start = input_shard
            div = getattr(param, "input_div", 1)
            strict = full_cols != self.input_size_per_partition
            _elements(self.input_size_per_partition, div, "input features per rank", strict)
            full[in_dim] = _elements(full_cols, div, "input features", False)
            dim, start = in_dim, _elements(in_start, div, "input offset", strict)
        return target, tuple(full), dim, start

    def shard_index(self, shard_id: str | int | None) -> int:
        """Position of stacked shard ``shard_id`` among :meth:`stacked_shards` (0 unstacked)."""
        ids = [sid for sid, _ in self.stacked_shards()]
        if shard_id is None:
            if ids:
                raise ValueError("is a per-projection scale of a stacked layer without a shard id")
            return 0
        if shard_id not in ids:
            raise ValueError(f"is a stacked shard ({shard_id!r}) of a layer that stacks {ids}")
        return ids.index(shard_id)

    def weight_loader(
        self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: str | int | None = None
    ) -> None:
        """Copy this rank's piece of one checkpoint tensor (or one stacked shard of it).

        A per-projection scalar (``per_shard``: an fp8 per-tensor scale) goes to its
        projection's slot. A tensor every stacked projection stores alike (``same_in_shards``:
        GPTQ's act-order ``g_idx``, the same for projections of the same input) is loaded
        once and the others checked against it.

        Raises:
            ValueError: the tensor's shape does not match its place, or stacked projections
                disagree on a tensor they must share.
        """
        with torch.no_grad():
            if getattr(param, "same_in_shards", False) and shard_id is not None:
                target, expected_shape, dim, start = self.placement(param, shard_id)
                piece = torch.empty_like(target)
                load_shard(piece, loaded, expected_shape, dim, start)
                if getattr(param, "loaded_once", False) and not torch.equal(piece, target):
                    raise ValueError(f"(shard {shard_id!r}) differs from the other projections'")
                target.copy_(piece)
                param.loaded_once = True
                return
            if getattr(param, "per_shard", False):
                value = loaded if isinstance(loaded, torch.Tensor) else loaded[...]
                if value.numel() != 1:
                    raise ValueError(f"has shape {tuple(value.shape)}, the model expects a scalar")
                param.data[self.shard_index(shard_id)] = value.reshape(())
                return
            target, expected_shape, dim, start = self.placement(param, shard_id)
            load_shard(target, loaded, expected_shape, dim, start)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., input_size_per_partition]`` -> ``[..., output_size_per_partition]``."""
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(Linear):
    """Output features split across ranks: rank ``r`` holds output rows
    ``[r * output_size / tp, (r + 1) * output_size / tp)`` (and that slice of the bias).

    Args:
        input_size, output_size: feature sizes of the whole layer.
        bias: whether a bias vector is present.
        quant_config, prefix: see :class:`Linear`.

    Raises:
        ValueError: ``output_size`` not divisible by the tensor-parallel size.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        output_size_per_partition: int | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        super().__init__(
            input_size,
            output_size,
            bias,
            output_size_per_partition=output_size_per_partition
            or divide(output_size, tp_size, "output_size"),
            quant_config=quant_config,
            prefix=prefix,
        )

    def output_shard(self, shard_id: str | int | None) -> tuple[int, int, int, int]:
        if shard_id is not None:
            raise ValueError(f"is a stacked shard ({shard_id!r}) of a layer that stacks nothing")
        rows = self.output_size_per_partition
        return 0, rows, self.output_size, self.tp_rank * rows

    def weight_loader(
        self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: str | int | None = None
    ) -> None:
        """Copy this rank's piece of one checkpoint tensor (or one stacked shard of it).

        A stacked layer also takes its whole stacked tensor (``shard_id`` None), as checkpoints
        that store it fused do (Phi-3's ``qkv_proj`` and ``gate_up_proj``): the tensor is cut
        into its projections' rows and each loaded as its shard, so every rank still gets its
        heads or channels of each projection (read lazily from a safetensors slice).

        Raises:
            ValueError: the tensor's shape does not match its place.
        """
        shards = self.stacked_shards()
        if shard_id is not None or not shards:
            super().weight_loader(param, loaded, shard_id)
            return
        if getattr(param, "output_dim", None) != 0 or getattr(param, "output_div", 1) != 1:
            raise ValueError("is a fused stacked tensor of a quantized layer; not supported")
        expected = (self.output_size, *param.shape[1:])
        if shape_of(loaded) != expected:
            raise ValueError(f"has shape {shape_of(loaded)}, the model expects {expected}")
        start = 0
        for stacked_id, rows in shards:
            super().weight_loader(param, narrow(loaded, 0, start, rows), stacked_id)
            start += rows


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input stacked along the output (gate
    and up): each rank holds its slice of every projection, ``[gate_r | up_r]``.

    Args:
        input_size: input features.
        output_sizes: output features of each stacked projection (whole layer), in order;
            checkpoint shard ``i`` fills this rank's ``i``-th slice.
        bias: whether the projections have biases.

        quant_config, prefix: see :class:`Linear`.

    Raises:
        ValueError: an output size not divisible by the tensor-parallel size.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        *,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.output_sizes = list(output_sizes)
        self.output_sizes_per_partition = [
            divide(size, tp_size, "output_size") for size in output_sizes
        ]
        super().__init__(
            input_size,
            sum(output_sizes),
            bias,
            output_size_per_partition=sum(self.output_sizes_per_partition),
            quant_config=quant_config,
            prefix=prefix,
        )

    def output_partition_sizes(self) -> list[int]:
        return list(self.output_sizes_per_partition)

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of a gate/up pair, ``[..., output_size_per_partition / 2]``,
        computed by the CPU GEMM kernel in the same pass as the projection (the same bits as
        :meth:`forward` then the activation), where the weight was packed for it
        (``pack_gated``, :func:`prepack_linear_weights`) and there is no bias; else None, and
        the caller applies the activation to :meth:`forward`'s output."""
        weight = getattr(self, "weight", None)  # a quantized layer has qweight and scales
        if self.bias is not None or weight is None or not is_gated(weight):
            return None
        return silu_and_mul(x, weight)

    def stacked_shards(self) -> list[tuple[str | int, int]]:
        return list(enumerate(self.output_sizes))

    def output_shard(self, shard_id: str | int | None) -> tuple[int, int, int, int]:
        index = int(shard_id)
        rows = self.output_sizes_per_partition[index]
        offset = sum(self.output_sizes_per_partition[:index])
        return offset, rows, self.output_sizes[index], self.tp_rank * rows


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections stacked along the output, split by heads:
    each rank holds ``[q_r | k_r | v_r]`` for its query heads and the KV heads they read.

    Query heads divide evenly across ranks. KV heads divide evenly when there are at least as
    many as ranks; otherwise each rank holds one KV head, replicated on ``tp / num_kv_heads``
    consecutive ranks (vLLM's rule; Megatron-LM's GQA layout), so a rank's query heads always
    find their KV head locally.

    Args:
        hidden_size: input features.
        head_dim: features per head.
        num_heads: query heads of the whole layer.
        num_kv_heads: key/value heads of the whole layer (fewer under grouped-query attention).
        bias: whether q/k/v have biases (Qwen2).
        quant_config, prefix: see :class:`Linear`.

    Attributes:
        num_heads, num_kv_heads: heads held by this rank.
        q_size, kv_size: this rank's q and k (= v) output features.

    Raises:
        ValueError: heads that cannot be split (see
            ``kvpilot.engine.model_shape.check_tensor_parallel_size``).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        *,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.head_dim = head_dim
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = divide(num_heads, tp_size, "num_attention_heads")
        if tp_size >= num_kv_heads:
            if tp_size % num_kv_heads:
                raise ValueError(
                    f"num_key_value_heads {num_kv_heads} and tensor_parallel_size {tp_size}: "
                    "neither divides the other"
                )
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp_size // num_kv_heads
        else:
            self.num_kv_heads = divide(num_kv_heads, tp_size, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(
            hidden_size,
            (num_heads + 2 * num_kv_heads) * head_dim,
            bias,
            output_size_per_partition=self.q_size + 2 * self.kv_size,
            quant_config=quant_config,
            prefix=prefix,
        )

    def output_partition_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def stacked_shards(self) -> list[tuple[str | int, int]]:
        kv_rows = self.total_num_kv_heads * self.head_dim
        return [("q", self.total_num_heads * self.head_dim), ("k", kv_rows), ("v", kv_rows)]

    def output_shard(self, shard_id: str | int | None) -> tuple[int, int, int, int]:
        if shard_id == "q":
            return 0, self.q_size, self.total_num_heads * self.head_dim, self.tp_rank * self.q_size
        if shard_id not in ("k", "v"):
            raise ValueError(f"has shard id {shard_id!r}; q/k/v expected")
        first_kv_head = (self.tp_rank // self.num_kv_head_replicas) * self.num_kv_heads
        offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        full_rows = self.total_num_kv_heads * self.head_dim
        return offset, self.kv_size, full_rows, first_kv_head * self.head_dim

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[num_tokens, q_size + 2 * kv_size]`` -> q, k, v views (this rank's heads)."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(Linear):
    """Input features split across ranks; the partial products are summed by an all-reduce.

    Rank ``r`` holds weight columns ``[r * input_size / tp, (r + 1) * input_size / tp)`` and
    expects the matching slice of the input features (the output of a column-parallel layer).
    The bias is replicated and added once, after the all-reduce.

    Args:
        input_size, output_size: feature sizes of the whole layer.
        bias: whether a bias vector is present.
        quant_config, prefix: see :class:`Linear`.

    Raises:
        ValueError: ``input_size`` not divisible by the tensor-parallel size.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        super().__init__(
            input_size,
            output_size,
            bias,
            input_size_per_partition=divide(input_size, tp_size, "input_size"),
            quant_config=quant_config,
            prefix=prefix,
        )

    def input_shard(self) -> tuple[int, int] | None:
        return self.input_size, self.tp_rank * self.input_size_per_partition

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., input_size_per_partition]`` -> ``[..., output_size]`` (summed)."""
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        out = tensor_model_parallel_all_reduce(self.quant_method.apply(self, x))
        return out if self.bias is None else out + self.bias


def prepack_linear_weights(model: nn.Module) -> int:
    """Replace the weight of every matmul-only layer by its packed copy, in place.

    A float32 model on the CPU otherwise holds each linear weight twice: the dense parameter
    and the packed copy :func:`~kvpilot.engine.layers.cpu_gemm.linear` multiplies with. After
    this only the packed one is left; it cannot be loaded into again, so call it once the
    weights are loaded. A weight held by more than one module (an LM head tied to the input
    embedding, which also serves lookups) stays dense. A layer with ``pack_gated`` is packed
    for its SwiGLU (:meth:`MergedColumnParallelLinear.forward_silu_and_mul`). Other dtypes and
    devices: no change.

    Args:
        model: the loaded model; its ``weight`` parameters of ``[out_features, in_features]``
            on :class:`Linear` layers and on modules whose ``forward`` is only a matmul
            (those with ``matmul_only_weight = True``, the untied LM head) are replaced.

    Returns:
        Bytes of dense weights released (0 where nothing was packed).
    """
    holders = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    modules = []
    for module in model.modules():
        weight = module._parameters.get("weight")
        if not (isinstance(module, Linear) or getattr(module, "matmul_only_weight", False)):
            continue
        if weight is None or is_packed(weight) or holders[id(weight)] > 1:
            continue
        modules.append(module)
    released = 0
    for batch in _batches(modules, PREPACK_BATCH_BYTES):
        gated = [getattr(m, "pack_gated", False) for m in batch]  # matmul-only heads: False
        for module, packed in zip(batch, prepack([m.weight for m in batch], gated), strict=True):
            if packed is not None:
                released += module.weight.nbytes
                module.weight = nn.Parameter(packed, requires_grad=False)
    return released


PREPACK_BATCH_BYTES = 256 * 1024**2
"""Dense bytes packed at a time into one buffer: the packed copies of a batch exist beside
their dense weights until the batch is done, so this bounds the extra memory of packing."""


def _batches(modules: list[nn.Module], limit: int) -> Iterator[list[nn.Module]]:
    """Consecutive runs of ``modules`` whose weights hold at most ``limit`` bytes (a larger
    weight alone)."""
    batch: list[nn.Module] = []
    size = 0
    for module in modules:
        if batch and size + module.weight.nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(module)
        size += module.weight.nbytes
    if batch:
        yield batch
