"""PagedAttention in plain PyTorch: the CPU path, and a readable second opinion for kernels.

Follows Kwon et al. 2023 ("Efficient Memory Management for Large Language Model Serving with
PagedAttention"): keys/values live in fixed-size blocks reached through each sequence's block
table. Decode sequences (one new token each) are attended in one batched call over their
gathered blocks; every sequence with several new tokens (a prefill or a prefill chunk, attending
to its cached context and causally to itself) gets its own call. Scores are computed by
``scaled_dot_product_attention`` in the activation dtype, as transformers' default ("sdpa")
attention does, so results agree with it to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.kernels.reference import reshape_and_cache


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) mask, broadcast from ``q_pos[..., None]`` vs ``k_pos``."""
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask = mask & (k_pos > q_pos - sliding_window)
    return mask


class TorchAttentionBackend:
    """The ``"torch"`` attention backend (see :class:`~kvpilot.engine.attention.backends.AttentionBackend`)."""

    name = "torch"

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
    ) -> torch.Tensor:
        """Cache the new K/V, then attend; shapes as in ``AttentionBackend.forward``."""
        k_cache, v_cache = kv_cache
        reshape_and_cache(key, value, k_cache, v_cache, attn_metadata.slot_mapping)
        out = torch.empty_like(query)
        starts = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        decode = [i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] == 1]
        if decode:
            self._decode(
                query, k_cache, v_cache, attn_metadata, decode, starts, scale, sliding_window, out
            )
        for i, seq_len in enumerate(seq_lens):
            q_len = starts[i + 1] - starts[i]
            if q_len > 1:
                self._prefill(
                    query,
                    k_cache,
                    v_cache,
                    attn_metadata.block_tables[i],
                    starts[i],
                    q_len,
                    seq_len,
                    scale,
                    sliding_window,
                    out,
                )
        return out

    @staticmethod
    def _prefill(
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        start: int,
        q_len: int,
        seq_len: int,
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor,
    ) -> None:
        block_size = k_cache.shape[1]
        blocks = block_table[: -(-seq_len // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:seq_len]  # [seq_len, num_kv_heads, head_dim]
        v = v_cache[blocks].flatten(0, 1)[:seq_len]
        positions = torch.arange(seq_len, device=query.device)
        mask = _allowed(positions[seq_len - q_len :, None], positions[None, :], sliding_window)
        o = F.scaled_dot_product_attention(
            query[start : start + q_len].transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[start : start + q_len] = o.transpose(0, 1)

    @staticmethod
    def _decode(
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        seqs: list[int],
        starts: list[int],
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor,
    ) -> None:
        block_size = k_cache.shape[1]
        rows = torch.tensor([starts[i] for i in seqs], device=query.device)
        index = torch.tensor(seqs, device=query.device)
        seq_lens = attn_metadata.seq_lens[index].long()  # [batch]
        max_len = int(seq_lens.max())
        tables = attn_metadata.block_tables[index, : -(-max_len // block_size)].long()
        # [batch, max_len, num_kv_heads, head_dim]; slots past a sequence's end hold another
        # sequence's data or uninitialised memory (possibly NaN), so they are zeroed, not only
        # masked: NaN * 0 attention weight would still be NaN.
        k = k_cache[tables].flatten(1, 2)[:, :max_len]
        v = v_cache[tables].flatten(1, 2)[:, :max_len]
        k_pos = torch.arange(max_len, device=query.device)[None, :]
        valid = k_pos < seq_lens[:, None]  # [batch, max_len]
        k = torch.where(valid[:, :, None, None], k, 0)
        v = torch.where(valid[:, :, None, None], v, 0)
        mask = valid & _allowed((seq_lens - 1)[:, None], k_pos, sliding_window)
        o = F.scaled_dot_product_attention(
            query[rows][:, :, None, :],  # [batch, num_heads, 1, head_dim]
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = o[:, :, 0, :]
