"""The attention backend interface and the selector that builds one by name."""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

from kvpilot.engine.attention.metadata import AttentionMetadata

# name -> "module:Class"; imported on first use.
_BACKENDS: dict[str, str] = {
    "torch": "kvpilot.engine.attention.torch_backend:TorchAttentionBackend",
    "triton": "kvpilot.engine.attention.triton_backend:TritonAttentionBackend",
}


class AttentionBackend(Protocol):
    """Attention of one layer over the paged KV cache, for a mixed prefill/decode batch.

    The layout is vLLM V1's: the new tokens of all sequences are concatenated (see
    :class:`~kvpilot.engine.attention.metadata.AttentionMetadata`).
    """

    name: str

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write the new tokens' K/V into the cache, then attend.

        Args:
            query: ``[num_tokens, num_heads, head_dim]``, already rotated.
            key, value: ``[num_tokens, num_kv_heads, head_dim]``, key already rotated.
            kv_cache: ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads,
                head_dim]``, the activation dtype or fp8 (``FP8_DTYPES``: keys and values are
                stored as ``x / scale``); written in place at ``attn_metadata.slot_mapping``.
            attn_metadata: the batch layout.
            scale: softmax scale (usually ``head_dim ** -0.5``).
            sliding_window: when set, a token attends only to the last ``sliding_window``
                positions up to and including itself (Mistral, Qwen2/3 sliding layers).
            k_scale, v_scale: ``[]`` float32 per-tensor dequantization scales of an fp8 cache
                (``x ~ stored * scale``), on the cache's device; ignored for other dtypes.

        Returns:
            ``[num_tokens, num_heads, head_dim]``, ``query``'s dtype.
        """
        ...


def get_attention_backend(name: str) -> AttentionBackend:
    """Build the attention backend called ``name``: ``"torch"`` (CPU) or ``"triton"`` (GPU).

    Raises:
        ValueError: an unknown name (the message lists the available ones).
    """
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(_BACKENDS)}")
    module_name, class_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)()
