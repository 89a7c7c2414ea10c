"""Qwen3 (Yang et al. 2025, "Qwen3 Technical Report"): Llama with per-head RMSNorm on q and k."""

from __future__ import annotations

from transformers import PretrainedConfig

from kvpilot.engine.models.llama import AttentionOptions, LlamaForCausalLM, config_sliding_window


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense causal LM; see :class:`LlamaForCausalLM` for the interface."""

    @classmethod
    def attention_options(cls, config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        """q/k RMSNorm over ``head_dim`` before RoPE; biases follow ``attention_bias``."""
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=True,
            sliding_window=config_sliding_window(config, layer_idx),
        )
