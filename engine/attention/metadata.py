"""What the model runner passes to every attention layer for one forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Flat description of one mixed batch of prefill and decode tokens (vLLM V1 layout).

    The new tokens of all sequences are concatenated in one ``[num_tokens]`` dimension; sequence
    ``i`` owns ``query_start_loc[i]:query_start_loc[i+1]``. Its new tokens are its last
    positions: token ``j`` of sequence ``i`` sits at absolute position
    ``seq_lens[i] - query_len_i + j`` and attends causally to every earlier position.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64; the flat KV slot (``block * block_size + offset``)
            each new token's K/V is written to; ``-1`` skips the write (padding).
        query_start_loc: ``[num_seqs + 1]`` int32; cumulative new-token counts, starting at 0.
        seq_lens: ``[num_seqs]`` int32; context length after this step (cached + new tokens).
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32; physical block ids per sequence,
            padded with 0 past each sequence's last block.
        max_query_len: the largest number of new tokens of one sequence (python int, no sync).
        max_seq_len: the largest ``seq_lens`` entry (python int, no sync).
        prompt_seqs: ``[num_seqs]`` bool, True where a sequence's new tokens are prompt tokens
            (a prompt or a chunk of one; not decodes or drafts), or None when not known. The
            CPU paged-attention kernel takes a marked one-token chunk as it takes longer ones.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    prompt_seqs: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])
