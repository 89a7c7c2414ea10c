"""Qwen2 (Yang et al. 2024, "Qwen2 Technical Report"): Llama with biases on q/k/v only."""

from __future__ import annotations

from transformers import PretrainedConfig

from kvpilot.engine.models.llama import AttentionOptions, LlamaForCausalLM, config_sliding_window


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 causal LM; see :class:`LlamaForCausalLM` for the interface."""

    @classmethod
    def attention_options(cls, config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        """q/k/v always carry biases, the output projection never; per-layer sliding windows."""
        return AttentionOptions(
            qkv_bias=True, o_bias=False, sliding_window=config_sliding_window(config, layer_idx)
        )
