"""PagedAttention with Triton kernels: the GPU path (and, under ``TRITON_INTERPRET=1``, testable
on CPU).

Two launches a layer: ``reshape_and_cache`` writes the new tokens' K/V into their slots, then
``unified_attention`` attends the whole mixed prefill/decode batch in one kernel (split along
the KV axis for small decode batches). Neither reads the batch metadata on the host, so a step
never waits on the device and the calls can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.kernels.reshape_and_cache import reshape_and_cache
from kvpilot.kernels.unified_attention import unified_attention


class TritonAttentionBackend:
    """The ``"triton"`` attention backend (see
    :class:`~kvpilot.engine.attention.backends.AttentionBackend`)."""

    name = "triton"

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
        """Cache the new K/V, then attend.

        Args:
            query: ``[num_tokens, num_heads, head_dim]``, already rotated; float16, bfloat16 or
                float32, contiguous in the last dimension.
            key, value: ``[num_tokens, num_kv_heads, head_dim]``, key already rotated.
            kv_cache: ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads,
                head_dim]``, contiguous, ``query``'s dtype or fp8 (float8_e4m3fn,
                float8_e5m2: quantized as written, dequantized as read); written in place at
                ``attn_metadata.slot_mapping``.
            attn_metadata: the batch layout.
            scale: softmax scale (usually ``head_dim ** -0.5``).
            sliding_window: when set, a token attends only to the last ``sliding_window``
                positions up to and including itself.
            k_scale, v_scale: ``[]`` float32 dequantization scales of an fp8 cache, on its
                device.

        Returns:
            ``[num_tokens, num_heads, head_dim]``, ``query``'s dtype.

        Raises:
            ValueError: from the kernels' input checks (the message names the argument).
        """
        k_cache, v_cache = kv_cache
        reshape_and_cache(
            key, value, k_cache, v_cache, attn_metadata.slot_mapping, k_scale, v_scale
        )
        return unified_attention(
            query,
            k_cache,
            v_cache,
            query_start_loc=attn_metadata.query_start_loc,
            seq_lens=attn_metadata.seq_lens,
            block_tables=attn_metadata.block_tables,
            scale=scale,
            sliding_window=sliding_window,
            k_scale=k_scale,
            v_scale=v_scale,
        )
