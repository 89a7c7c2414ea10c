"""Projections with LoRA slots: the base layer's output plus every token's own adapter delta.

Each wrapped projection holds, for ``max_loras`` slots, ``lora_a`` ``[max_loras, num_slices *
max_lora_rank, in_features]`` and ``lora_b`` ``[max_loras, out_features, num_slices *
max_lora_rank]``. A stacked projection (q/k/v, gate/up) has one slice per
stacked part: slice ``i``'s A rows are ``i * max_lora_rank ...`` and its B block sits in the part's
output rows, so ``B`` is block-diagonal and one shrink plus one expand serve all parts. Unused
rank rows and absent parts are zeros, which add nothing.

The delta ``y[t] += x[t] A_s^T B_s^T`` (scaling already folded into ``B``) is applied per token
``t`` with slot ``s = token_slots[t]`` by a gathered, segmented matmul (Punica, Chen et al. 2023):
the Triton ``lora_shrink`` / ``lora_expand`` kernels on a GPU, slot-padded ``bmm`` calls on the
CPU (:mod:`kvpilot.engine.lora.torch_delta`). Base-model tokens (slot ``-1``) are untouched.

The delta is added to the layer's whole output, so the model must not be sharded:
:class:`~kvpilot.engine.lora.manager.LoRAManager` refuses a tensor-parallel one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from kvpilot.engine.layers.linear import ColumnParallelLinear, Linear, UnquantizedLinearMethod
from kvpilot.engine.lora.adapter import LoRAAdapterError, LoRAWeights
from kvpilot.engine.lora.torch_delta import PaddedBatch, add_lora_delta, padded_batch
from kvpilot.kernels.lora_expand import lora_expand
from kvpilot.kernels.lora_segments import LoRASegments, lora_segments
from kvpilot.kernels.lora_shrink import lora_shrink

ShardId = str | int | None


class LoRABatchMapping:
    """Which slot each token of the current forward pass uses; one object shared by every
    wrapped projection of a model (vLLM's ``PunicaWrapper``), set by the model runner before
    each forward pass.

    Args:
        num_slots: ``max_loras``.
        use_kernels: apply the delta with the Triton kernels (True) or in PyTorch (False);
            None: the kernels on a CUDA device, PyTorch elsewhere.

    Attributes:
        active: whether a token of the pass uses an adapter (if not, the wrapped projections
            cost nothing extra).
        token_slots, segments: the kernels' inputs, on the model's device (kernel path).
        padded: the PyTorch path's layout (:mod:`kvpilot.engine.lora.torch_delta`).
    """

    def __init__(self, num_slots: int, use_kernels: bool | None = None) -> None:
        self.num_slots = num_slots
        self.use_kernels = use_kernels
        self.clear()

    def set(self, token_slots: torch.Tensor, device: torch.device | str) -> None:
        """Use ``token_slots`` (``[num_tokens]`` int32 on the host; -1 for base-model tokens)
        for the next forward passes, on ``device``.

        Raises:
            ValueError: a slot outside ``[-1, num_slots)`` or a tensor of the wrong kind.
        """
        segments = lora_segments(token_slots, self.num_slots)
        self.clear()
        if segments.max_tokens_per_slot == 0:
            return
        self.active = True
        device = torch.device(device)
        if self.use_kernels or (self.use_kernels is None and device.type == "cuda"):
            self.token_slots = token_slots.to(device, non_blocking=True)
            self.segments = segments.to(device)
        else:
            self.padded = padded_batch(segments)

    def clear(self) -> None:
        """No adapter in the next forward passes."""
        self.active = False
        self.token_slots: torch.Tensor | None = None
        self.segments: LoRASegments | None = None
        self.padded: PaddedBatch | None = None


class LinearWithLoRA(nn.Module):
    """A projection of the model plus ``max_loras`` slots of LoRA weights.

    Args:
        base_layer: the model's projection (its parameters are shared, not copied).
        shard_ids: the stacked parts in output order (``("q", "k", "v")``, ``(0, 1)``), or
            ``(None,)`` for a projection that stacks nothing.
        max_loras: slots.
        max_lora_rank: rank held per part and slot; smaller adapters are zero-padded.
        mapping: the model's shared token-to-slot mapping.
        dtype: the slots' dtype (vLLM's ``--lora-dtype``); None: the base weight's. Another
            dtype than the activations' is computed in the slots' dtype and added back in the
            activations'.

    Attributes are forwarded to ``base_layer`` (``split``, ``num_heads``...), so the model code
    that calls its projections is unchanged.
    """

    def __init__(
        self,
        base_layer: Linear,
        shard_ids: tuple[ShardId, ...],
        max_loras: int,
        max_lora_rank: int,
        mapping: LoRABatchMapping,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(base_layer.quant_method, UnquantizedLinearMethod):
            raise ValueError(
                f"LoRA on quantized layers ({type(base_layer.quant_method).__name__}) is not "
                "supported"
            )
        self.base_layer = base_layer
        self.shard_ids = shard_ids
        self.max_lora_rank = max_lora_rank
        self.mapping = mapping
        weight = base_layer.weight
        width = len(shard_ids) * max_lora_rank
        in_features, out_features = weight.shape[1], weight.shape[0]
        kwargs = {"dtype": dtype or weight.dtype, "device": weight.device}
        self.register_buffer(
            "lora_a", torch.zeros(max_loras, width, in_features, **kwargs), persistent=False
        )
        self.register_buffer(
            "lora_b", torch.zeros(max_loras, out_features, width, **kwargs), persistent=False
        )

    def __getattr__(self, name: str):
        # The model calls its projections' own attributes (``qkv_proj.split``); nn.Module only
        # comes here for names it does not hold itself.
        try:
            return super().__getattr__(name)
        except AttributeError:
            base = self._modules.get("base_layer")
            if base is None:
                raise
            return getattr(base, name)

    def check_weights(self, module: str, weights: Mapping[ShardId, LoRAWeights]) -> None:
        """Raise :class:`LoRAAdapterError` unless every part fits this projection.

        Args:
            module: the projection's name in the model, for the message.
            weights: shard id -> weights of that part (a subset of ``shard_ids``).
        """
        for shard_id, w in weights.items():
            part = module if shard_id is None else f"{module}[{shard_id}]"
            if shard_id not in self.shard_ids:
                raise LoRAAdapterError(f"{part}: the model has no such stacked part")
            if w.rank > self.max_lora_rank:
                raise LoRAAdapterError(
                    f"{part} has rank {w.rank}, above max_lora_rank {self.max_lora_rank}"
                )
            want = (self._output_slice(shard_id)[1], self.base_layer.input_size)
            got = (w.lora_b.shape[0], w.lora_a.shape[1])
            if got != want:
                raise LoRAAdapterError(
                    f"{part} maps {got[1]} -> {got[0]} features; the model's projection maps "
                    f"{want[1]} -> {want[0]} (an adapter of another base model?)"
                )

    def set_slot(self, slot: int, weights: Mapping[ShardId, LoRAWeights]) -> None:
        """Fill slot ``slot`` with one adapter's weights for this projection (zeros where the
        adapter does not adapt a part). Call :meth:`check_weights` first."""
        rank = self.max_lora_rank
        with torch.no_grad():
            self.lora_a[slot].zero_()
            self.lora_b[slot].zero_()
            for i, shard_id in enumerate(self.shard_ids):
                w = weights.get(shard_id)
                if w is None:
                    continue
                offset, rows = self._output_slice(shard_id)
                cols = slice(i * rank, i * rank + w.rank)
                self.lora_a[slot, cols].copy_(w.lora_a)
                self.lora_b[slot, offset : offset + rows, cols].copy_(w.lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in_features]`` -> the base layer's output plus each token's delta."""
        out = self.base_layer(x)
        if self.mapping.active:
            self._add_delta(x, out)
        return out

    def _add_delta(self, x: torch.Tensor, out: torch.Tensor) -> None:
        x2 = x.reshape(-1, x.shape[-1])
        out2 = out.view(-1, out.shape[-1])
        mapping = self.mapping
        if mapping.padded is not None:
            add_lora_delta(x2, out2, self.lora_a, self.lora_b, mapping.padded)
            return
        # The kernels take x in the slots' dtype and add into a tensor of it: with another
        # --lora-dtype than the model's, the delta goes through a buffer of that dtype.
        lora_dtype = self.lora_a.dtype
        shrunk = lora_shrink(x2.to(lora_dtype), self.lora_a, mapping.token_slots, mapping.segments)
        if out2.dtype == lora_dtype:
            lora_expand(shrunk, self.lora_b, mapping.token_slots, out2, mapping.segments)
            return
        delta = out2.new_zeros(out2.shape, dtype=lora_dtype)
        lora_expand(shrunk, self.lora_b, mapping.token_slots, delta, mapping.segments)
        out2.add_(delta)

    def _output_slice(self, shard_id: ShardId) -> tuple[int, int]:
        """``(first row, rows)`` of one stacked part in this projection's output."""
        if isinstance(self.base_layer, ColumnParallelLinear):
            offset, rows, _, _ = self.base_layer.output_shard(shard_id)
            return offset, rows
        return 0, self.base_layer.output_size


def wrap_lora_layers(
    model: nn.Module,
    stacked_params_mapping: Iterable[tuple[str, str, ShardId]],
    target_names: Iterable[str],
    make: Callable[[Linear, tuple[ShardId, ...]], LinearWithLoRA],
) -> dict[str, LinearWithLoRA]:
    """Replace the model's target projections by LoRA-wrapped ones, in place.

    Call after the weights are loaded: the wrapped projection's parameters move under
    ``base_layer`` in ``named_parameters()``.

    Args:
        model: the loaded model.
        stacked_params_mapping: the model's ``(stacked, part, shard id)`` table.
        target_names: the PEFT module names to adapt (``q_proj``, ``gate_proj``...).
        make: builds the wrapper of one projection from it and its stacked shard ids.

    Returns:
        Module path (``model.layers.0.self_attn.qkv_proj``) -> its wrapper.
    """
    mapping = tuple(stacked_params_mapping)
    # Our projection's attribute name -> its stacked parts in output order.
    shards_of: dict[str, tuple[ShardId, ...]] = {}
    for target in target_names:
        stacked = [s for s, part, _ in mapping if part == f".{target}"]
        attr = stacked[0].lstrip(".") if stacked else target
        shards_of[attr] = tuple(shard for s, _, shard in mapping if s == f".{attr}") or (None,)
    wrapped: dict[str, LinearWithLoRA] = {}
    for path, module in list(model.named_modules()):
        parent_path, _, attr = path.rpartition(".")
        if attr in shards_of and isinstance(module, Linear):
            layer = make(module, shards_of[attr])
            setattr(model.get_submodule(parent_path), attr, layer)
            wrapped[path] = layer
    return wrapped
