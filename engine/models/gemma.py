"""Google Gemma 1 (Gemma Team 2024, "Gemma: Open Models Based on Gemini Research and
Technology"): the Llama decoder with three changes, as transformers' ``modeling_gemma`` has them.

- GeGLU MLP: ``hidden_act`` ``gelu_pytorch_tanh`` (the released configs' ``gelu`` is read as
  that by transformers' ``GemmaConfig``, and by vLLM).
- Token embeddings scaled by ``sqrt(hidden_size)``, the factor rounded to the model dtype first.
- RMSNorm scaling by ``1 + weight``, computed in float32
  (:class:`~kvpilot.engine.layers.layernorm.GemmaRMSNorm`).

``head_dim`` comes from the config (256 for Gemma-7B, where heads x head_dim exceeds
hidden_size), and the LM head is tied to the embedding table (``GemmaConfig``'s default).
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from kvpilot.engine.layers.layernorm import GemmaRMSNorm
from kvpilot.engine.models.llama import LlamaForCausalLM, ModelOptions


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 1 causal LM; see :class:`LlamaForCausalLM` for the interface."""

    @classmethod
    def model_options(cls, config: PretrainedConfig, dtype: torch.dtype) -> ModelOptions:
        """``sqrt(hidden_size)`` on the embeddings, rounded to ``dtype`` as transformers' scale
        buffer is (``55.5`` in bfloat16 for hidden 3072); the ``1 + weight`` RMSNorm.

        Raises:
            ValueError: a config with ``use_bidirectional_attention`` (an encoder, not a causal
                LM).
        """
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(
                "GemmaForCausalLM with use_bidirectional_attention is not a causal LM; "
                "only causal Gemma models are supported"
            )
        normalizer = torch.tensor(config.hidden_size**0.5, dtype=dtype).item()
        return ModelOptions(embedding_multiplier=normalizer, norm=GemmaRMSNorm)
