"""Qwen3-MoE (Yang et al. 2025, "Qwen3 Technical Report"): Qwen3's decoder (q/k RMSNorm) with a
sparse mixture of ``num_experts`` SwiGLU experts of ``moe_intermediate_size``, no shared
expert. Softmax over all experts, the top ``num_experts_per_tok``, renormalised only when
``norm_topk_prob`` (Qwen3-30B-A3B and -235B-A22B set it); the weights are rounded to the model
dtype before they scale the experts (transformers' ``Qwen3MoeTopKRouter``). Layer ``i`` is
sparse when it is not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``;
the others have a dense MLP of ``intermediate_size``.
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from kvpilot.engine.layers.fused_moe import SparseMoeBlock
from kvpilot.engine.models.llama import LlamaMLP
from kvpilot.engine.models.moe import MoEForCausalLM
from kvpilot.engine.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(MoEForCausalLM, Qwen3ForCausalLM):
    """Qwen3-MoE causal LM; see :class:`~kvpilot.engine.models.llama.LlamaForCausalLM` for the
    interface."""

    @classmethod
    def mlp(cls, config: PretrainedConfig, layer_idx: int, kernel_backend: str) -> nn.Module:
        """A ``SparseMoeBlock`` on the sparse layers, a dense ``LlamaMLP`` on the others."""
        step = getattr(config, "decoder_sparse_step", 1) or 1
        sparse = (
            config.num_experts > 0
            and layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and (layer_idx + 1) % step == 0
        )
        if not sparse:
            return LlamaMLP(config, kernel_backend)
        return SparseMoeBlock(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            renormalize=bool(config.norm_topk_prob),
            hidden_act=config.hidden_act,
            kernel_backend=kernel_backend,
            weights_in_model_dtype=True,
        )
