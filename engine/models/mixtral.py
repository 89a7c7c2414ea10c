"""Mixtral (Jiang et al. 2024, "Mixtral of Experts"): Mistral's decoder with a sparse mixture
of SwiGLU experts in every layer. The router scores all ``num_local_experts`` experts, the
softmax is taken over all of them, each token goes to its ``num_experts_per_tok`` best and their
weights are renormalised to sum to 1 (transformers' ``MixtralTopKRouter``; the weights stay
float32 when they scale the experts' outputs). Checkpoints name the MLP ``block_sparse_moe``
and each expert's gate, down and up projections ``w1``, ``w2``, ``w3``.
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from kvpilot.engine.layers.fused_moe import ExpertShard, SparseMoeBlock
from kvpilot.engine.models.moe import MoEForCausalLM


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral causal LM; see :class:`~kvpilot.engine.models.llama.LlamaForCausalLM` for the
    interface (attention as Mistral's, ``sliding_window`` included)."""

    @classmethod
    def mlp(cls, config: PretrainedConfig, layer_idx: int, kernel_backend: str) -> nn.Module:
        """Every layer: ``num_local_experts`` experts of ``intermediate_size``, top
        ``num_experts_per_tok``, renormalised."""
        return SparseMoeBlock(
            config.num_local_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            renormalize=True,
            hidden_act=config.hidden_act,
            kernel_backend=kernel_backend,
        )

    def _param_name(self, name: str) -> tuple[str, str | int | ExpertShard | None]:
        return super()._param_name(name.replace(".block_sparse_moe.", ".mlp."))
