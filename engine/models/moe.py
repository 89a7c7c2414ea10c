"""What the mixture-of-experts members of the Llama family share: an MLP chosen per layer
(:meth:`MoEForCausalLM.mlp`) and the checkpoint names of the experts' weights.

The decoder is Llama's (:mod:`kvpilot.engine.models.llama`); only the MLP of the sparse layers
is a :class:`~kvpilot.engine.layers.fused_moe.SparseMoeBlock`. Checkpoints store the experts
either one tensor per expert and projection (``experts.{e}.w1.weight`` for Mixtral,
``experts.{e}.gate_proj.weight`` for Qwen-MoE: what public checkpoints and transformers'
``save_pretrained`` write) or stacked (``experts.gate_up_proj``, ``experts.down_proj``:
transformers 5's in-memory layout); both load into the stacked ``w13_weight``/``w2_weight``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from kvpilot.engine.layers.fused_moe import ExpertShard, expert_param_name, expert_shard_ids
from kvpilot.engine.models.llama import LlamaForCausalLM, ModelOptions


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-family causal LM whose MLPs are (some of them) mixtures of experts; see
    :class:`LlamaForCausalLM` for the interface. Subclasses implement :meth:`mlp`."""

    @classmethod
    def model_options(cls, config: PretrainedConfig, dtype: torch.dtype) -> ModelOptions:
        """Llama's options with the MLP built by :meth:`mlp`."""
        return ModelOptions(mlp=cls.mlp)

    @classmethod
    def mlp(cls, config: PretrainedConfig, layer_idx: int, kernel_backend: str) -> nn.Module:
        """The MLP of layer ``layer_idx``: a ``SparseMoeBlock`` or a dense ``LlamaMLP``."""
        raise NotImplementedError

    def _param_name(self, name: str) -> tuple[str, str | int | ExpertShard | None]:
        expert = expert_param_name(name)
        if expert is not None:
            return expert
        return super()._param_name(name)

    def _shards_of(self, param_name: str) -> set:
        if ".experts." in param_name:
            experts = self.get_submodule(param_name.rsplit(".", 1)[0])
            return expert_shard_ids(param_name, experts.num_experts)
        return super()._shards_of(param_name)
