"""Multi-LoRA serving: PEFT adapters in fixed slots, applied per token in a mixed batch.

Hu et al. 2021 ("LoRA: Low-Rank Adaptation of Large Language Models") adds ``x A^T B^T * scaling``
to a frozen projection. Following Punica (Chen et al. 2023) and S-LoRA (Sheng et al. 2023), one
batch mixes tokens of many adapters and of the base model: adapters live in fixed slots of
stacked weight tensors, each token names its slot, and a gathered (segmented) matmul applies
every token's own adapter.

- :mod:`.request`: :class:`LoRARequest`, what a caller names (vLLM's), and ``--lora-modules``.
- :mod:`.adapter`: reading a PEFT folder into per-projection weights, with a content digest.
- :mod:`.errors`: the errors of an adapter that cannot be used (no torch: the server's too).
- :mod:`.layers`: the projections wrapped with slot weights and the per-token delta.
- :mod:`.torch_delta`: the delta in PyTorch (CPU); the Triton kernels are
  ``kvpilot.kernels.lora_shrink`` / ``lora_expand``.
- :mod:`.manager`: the slots, LRU residency and the batch's token-to-slot mapping.
"""

from kvpilot.engine.lora.request import LoRAModulePath, LoRARequest, parse_lora_modules

__all__ = ["LoRAModulePath", "LoRARequest", "parse_lora_modules"]
