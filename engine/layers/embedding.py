"""The token embedding table and the output head, split by vocabulary rows across ranks.

Megatron-LM's vocabulary-parallel embedding (Shoeybi et al. 2019, section 3): rank ``r`` holds
rows ``[r * rows_per_partition, (r + 1) * rows_per_partition)`` with
``rows_per_partition = ceil(vocab_size / tp)``; rows past ``vocab_size`` (last rank only) are
zero padding. A lookup embeds the ids a rank owns, zeros the others and sums over ranks (each id
is owned by exactly one rank, so the sum is exact); the output head computes each rank's logits
slice and gathers them. With one rank both are the plain table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.engine.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from kvpilot.engine.layers import cpu_gemm
from kvpilot.engine.layers.cpu_gemm import linear
from kvpilot.engine.layers.weight_loading import CheckpointTensor, load_shard


class VocabParallelEmbedding(nn.Module):
    """Token id -> embedding row, the table split by rows across ranks.

    Args:
        vocab_size: rows of the whole table (tokens).
        hidden_size: embedding width.

    Attributes:
        rows_per_partition: rows this rank holds (padding included).
        vocab_start: first token id this rank owns.
        num_owned_rows: rows holding real tokens (fewer than ``rows_per_partition`` on the
            last rank when ``vocab_size`` does not divide).
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.rows_per_partition = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_partition
        self.num_owned_rows = max(0, min(vocab_size - self.vocab_start, self.rows_per_partition))
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_partition, hidden_size), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor) -> None:
        """Copy this rank's rows of the checkpoint's ``[vocab_size, hidden_size]`` table and
        zero the padding rows.

        Raises:
            ValueError: the table's shape is not ``[vocab_size, hidden_size]``.
        """
        with torch.no_grad():
            param.data[self.num_owned_rows :].zero_()
            owned = param.data[: self.num_owned_rows]
            load_shard(owned, loaded, (self.vocab_size, self.hidden_size), 0, self.vocab_start)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids``: ``[num_tokens]`` int64 -> ``[num_tokens, hidden_size]``."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        owned = (local >= 0) & (local < self.num_owned_rows)
        hidden = F.embedding(torch.where(owned, local, 0), self.weight)
        hidden = hidden.masked_fill(~owned.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(hidden)


class ParallelLMHead(VocabParallelEmbedding):
    """The output head: hidden states -> logits over the vocabulary, rows split like the
    embedding (so a tied head shares the embedding's shard)."""

    # Its weight only multiplies (see ``prepack_linear_weights``); a tied one is shared.
    matmul_only_weight = True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[n, hidden_size]`` -> logits ``[n, vocab_size]``, hidden's dtype.

        Each rank multiplies by its rows; the slices are gathered in rank order on every rank
        (every rank then samples the same tokens from the same logits) and padding dropped.
        """
        logits = linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        return tensor_model_parallel_all_gather(logits, dim=-1)[..., : self.vocab_size]

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``forward(hidden).argmax(dim=-1)`` (``[n, hidden_size]`` -> ``[n]`` int64, the
        first index of each row's largest logit) without every logit where the CPU's greedy
        head applies (:func:`kvpilot.engine.layers.cpu_gemm.greedy_tokens`: the same indices,
        bit for bit); -1 for a row it leaves undecided; None where it does not apply (another
        dtype or device, tensor parallelism)."""
        if self.tp_size != 1:
            return None
        return cpu_gemm.greedy_tokens(hidden, self.weight)
