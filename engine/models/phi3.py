"""Microsoft Phi-3 / Phi-3.5 / Phi-4-mini (Abdin et al. 2024, "Phi-3 Technical Report"): the
Llama architecture with q/k/v and gate/up stored fused in the checkpoint.

The checkpoints' ``qkv_proj`` and ``gate_up_proj`` tensors are already our stacked layers; their
weight loaders cut a fused tensor into its projections (each rank keeping its heads and
channels). ``rope_scaling`` ``longrope`` (LongRoPE, Ding et al. 2024: Phi-3-128k, Phi-3.5,
Phi-4-mini) and ``partial_rotary_factor`` are the rotary embedding's; ``sliding_window``
(Phi-3-mini-4k's 2047) applies to every layer, as in Mistral.
"""

from __future__ import annotations

from kvpilot.engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3-family causal LM; see :class:`LlamaForCausalLM` for the interface.

    The Llama name mapping stays: fused checkpoint names match the stacked parameters as they
    are, so they load whole (``shard_id`` None), and split q/k/v or gate/up checkpoints would
    load too.
    """
