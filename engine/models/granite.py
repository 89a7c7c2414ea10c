"""IBM Granite 3.x dense (Granite Team 2024, "Granite 3.0 Language Models"): Llama with four
scalar multipliers.

``embedding_multiplier`` scales the token embeddings, ``residual_multiplier`` each attention and
MLP output before it joins the residual stream, ``attention_multiplier`` replaces
``1/sqrt(head_dim)`` as the attention scale, and the logits are divided by ``logits_scaling``:
the placements of transformers' ``modeling_granite``.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import PretrainedConfig

from kvpilot.engine.models.llama import AttentionOptions, LlamaForCausalLM, ModelOptions


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite 3.x dense causal LM; see :class:`LlamaForCausalLM` for the interface."""

    @classmethod
    def attention_options(cls, config: PretrainedConfig, layer_idx: int) -> AttentionOptions:
        """Llama's, scaled by ``attention_multiplier``."""
        llama = super().attention_options(config, layer_idx)
        return dataclasses.replace(llama, scale=float(config.attention_multiplier))

    @classmethod
    def model_options(cls, config: PretrainedConfig, dtype: torch.dtype) -> ModelOptions:
        """The embedding and residual multipliers and the logits' divisor of the config."""
        return ModelOptions(
            embedding_multiplier=float(config.embedding_multiplier),
            residual_multiplier=float(config.residual_multiplier),
            logits_scaling=float(config.logits_scaling),
        )
